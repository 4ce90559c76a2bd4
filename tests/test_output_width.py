"""Command output piped to a file or a pipe keeps its width: tables are not cut at 80 columns."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image
from rich.table import Table
from typer.testing import CliRunner

from ats_cli.cli import OutputConsole, app

LONG = "x" * 150


def _table() -> Table:
    table = Table(title="t")
    table.add_column("name")
    table.add_column("value")
    table.add_row(LONG, "y" * 40)
    return table


def test_a_piped_table_keeps_its_width(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    out = io.StringIO()  # not a terminal
    OutputConsole(file=out).print(_table())
    (row,) = [line for line in out.getvalue().splitlines() if "xxx" in line]
    assert LONG in row and "y" * 40 in row
    # a width the user asks for still rules
    monkeypatch.setenv("COLUMNS", "60")
    out = io.StringIO()
    OutputConsole(file=out).print(_table())
    assert max(map(len, out.getvalue().splitlines())) <= 60 and LONG not in out.getvalue()


def test_a_command_run_under_a_pipe_prints_long_rows_on_one_line(tmp_path, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    path = tmp_path / ("d" * 120) / "an-image-with-a-long-name.png"
    path.parent.mkdir()
    Image.fromarray(np.zeros((40, 30), np.uint8)).save(path)
    result = CliRunner().invoke(app, ["info", str(path)])
    assert result.exit_code == 0, result.output
    assert str(path) in result.output.splitlines()
