"""The command line: commands are listed and the self-check runs and passes."""

from __future__ import annotations

from typer.testing import CliRunner

from ats_cli import __version__
from ats_cli.cli import app

runner = CliRunner()


def test_help_lists_the_commands():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0, result.output
    for command in ("selfcheck", "make-dataset"):
        assert command in result.output


def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and __version__ in result.output


def test_selfcheck_passes():
    result = runner.invoke(app, ["selfcheck", "--draws", "20000"])
    assert result.exit_code == 0, result.output
    assert "all checks passed" in result.output
