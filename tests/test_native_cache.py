"""Where the native kernel is cached and how its build announces itself (no compiler runs here:
the compile is replaced by a stand-in; tests/test_native.py builds the real one)."""

from __future__ import annotations

import shutil
import types
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ats_cli.cli import app
from ats_cli.core import native


def test_build_key_follows_the_source_bytes_not_the_checkout(tmp_path):
    one, two = tmp_path / "checkout1" / "csrc", tmp_path / "checkout2" / "csrc"
    shutil.copytree(native.CSRC, one)
    shutil.copytree(native.CSRC, two)
    for cuda in (False, True):
        assert native.build_key(cuda, one) == native.build_key(cuda, two) == native.build_key(cuda)
    assert native.build_key(False, one) != native.build_key(True, one)  # separate CPU and CUDA builds

    header = two / "ats_patches.h"
    data = bytearray(header.read_bytes())
    data[len(data) // 2] ^= 1  # one bit of one byte
    header.write_bytes(bytes(data))
    assert native.build_key(False, two) != native.build_key(False, one)
    assert native.build_key(True, two) != native.build_key(True, one)
    cu = one / "ats_patches_cuda.cu"
    cu.write_bytes(cu.read_bytes() + b"\n")
    assert native.build_key(True, one) != native.build_key(True, two)
    assert native.build_key(False, one) == native.build_key(False)  # the CPU build does not compile the .cu


@pytest.fixture
def fake_compiler(tmp_path, monkeypatch):
    """``cpp_extension.load`` replaced by one that writes the .so it would have built."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("ATS_CACHE", str(tmp_path / "cache"))
    calls = []

    def load(name, sources, build_directory, **kwargs):
        calls.append((name, sources, build_directory))
        (Path(build_directory) / f"{name}.so").write_bytes(b"")
        return types.SimpleNamespace(name=name)

    monkeypatch.setattr(cpp_extension, "load", load)
    return calls


def test_a_build_is_announced_on_stderr_and_a_cached_one_is_not(fake_compiler, capsys):
    directory = native.build_dir(False)
    assert directory.parent == Path(native.os.environ["ATS_CACHE"]) / "extensions"
    assert directory.name.endswith(native.build_key(False)) and not native.is_built(False)

    assert native.build(cuda=False).name == "ats_patches_cpu"
    err = capsys.readouterr().err
    assert "building the native CPU patch kernel (first use" in err and str(directory) in err
    assert "built the native CPU patch kernel in" in err and native.is_built(False)
    # the compiler got copies inside the cache, so every checkout hands ninja the same paths
    ((_, sources, build_directory),) = fake_compiler
    assert build_directory == str(directory) and sources == [str(directory / "src" / "ats_patches.cpp")]
    assert (directory / "src" / "ats_patches.h").read_bytes() == (native.CSRC / "ats_patches.h").read_bytes()

    native.build(cuda=False)  # cached: loaded without a word (the stand-in .so is empty, so ninja is asked again)
    assert capsys.readouterr().err == "" and len(fake_compiler) == 2


def test_a_finished_build_is_imported_without_asking_the_compiler(fake_compiler, monkeypatch, capsys):
    """Each clone's own venv hands the compiler other include paths, and ninja rebuilds when its
    command changes: a finished build for the same key is imported from its file instead."""
    imported = []
    monkeypatch.setattr(native, "_import_built", lambda path: imported.append(path) or types.SimpleNamespace())
    native.build(cuda=False)
    assert len(fake_compiler) == 1 and imported == []  # the first build compiles
    directory = native.build_dir(False)
    assert (directory / native.BUILT).read_text() == native.build_key(False)
    capsys.readouterr()
    native.build(cuda=False)
    assert len(fake_compiler) == 1 and imported == [directory / "ats_patches_cpu.so"]
    assert capsys.readouterr().err == ""
    # negative control: a .so that no finished build vouches for (a linker still writing it) is not imported
    (directory / native.BUILT).unlink()
    native.build(cuda=False)
    assert len(fake_compiler) == 2 and len(imported) == 1


def test_a_failed_build_says_so(fake_compiler, monkeypatch, capsys):
    from torch.utils import cpp_extension

    def broken(**kwargs):
        raise RuntimeError("c++: not found")

    monkeypatch.setattr(cpp_extension, "load", broken)
    with pytest.raises(RuntimeError, match="c[+][+]: not found"):
        native.build(cuda=False)
    assert "building the native CPU patch kernel failed after" in capsys.readouterr().err


def test_ats_doctor_names_the_cache_and_whether_it_is_built(fake_compiler, monkeypatch):
    monkeypatch.setenv("ATS_NATIVE", "0")  # no build attempt from `status`
    result = CliRunner().invoke(app, ["doctor"])
    assert result.exit_code == 0, result.output
    assert "kernel cache (cpu)" in result.output and str(native.build_dir(False)) in result.output
    assert "not built yet" in result.output
    native.build(cuda=False)
    result = CliRunner().invoke(app, ["doctor"])
    assert f"{native.build_dir(False)} (built)" in result.output


def test_ats_doctor_does_not_call_a_built_kernel_built_on_first_use(fake_compiler, monkeypatch):
    """doctor said "native kernel, built on first use" beside "kernel cache (cpu) ... (built)"."""
    monkeypatch.delenv("ATS_NATIVE", raising=False)
    monkeypatch.setattr(native, "_modules", {})  # a process that has not used the kernel yet
    result = CliRunner().invoke(app, ["doctor"], env={"COLUMNS": "1000"})
    assert "native kernel, built on first use" in result.output and "not built yet" in result.output
    native.build(cuda=False)
    result = CliRunner().invoke(app, ["doctor"], env={"COLUMNS": "1000"})
    assert result.exit_code == 0, result.output
    assert f"{native.build_dir(False)} (built)" in result.output
    (line,) = [x for x in result.output.splitlines() if "patches on cpu" in x]
    assert "built on first use" not in line and "native kernel (built; loaded on first use)" in line, line
