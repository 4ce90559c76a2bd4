"""The native patch-extraction kernels in ``csrc/``: lazy build, use, and graceful fallback.

Why lazy: compiling takes a minute and needs a compiler (and nvcc for CUDA), which a
user who runs on CPU should never pay for. The extension is built on the first CUDA call
of :func:`ats_cli.core.extract_patches` with ``torch.utils.cpp_extension.load`` (ninja)
and cached under ``$ATS_CACHE`` or ``~/.cache/ats``, in a directory named by a hash of
the kernel sources, the build flags and the torch/CUDA/Python versions
(:func:`build_key`): checkouts with the same sources share one build, a changed source
byte never loads a stale one, and later runs load it in milliseconds. A finished build is
imported directly, not handed to ninja again: ninja's record names the compiler's include
paths, which differ between virtual environments (each clone's own ``.venv``), so asking it
would recompile for every environment although the key says the build is the same. A build announces
itself on stderr (where it goes, then every 15 s, then how long it took), so a first
``ats predict`` does not look hung. If anything fails -- no compiler, no nvcc, a toolkit
that does not match torch -- the torch implementation is used and ONE log line says why.

CPU: the C++ kernel is used too, because it is faster than the vectorised torch gather on
realistic sizes by more than the 1.5x that makes a native build worth its one-time
first-use compile (benchmarks/patch_extraction.py; figures in csrc/README.md).
``ATS_NATIVE=0`` disables both kernels. ``ats doctor`` prints
:func:`status`.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

import torch

from ats_cli.io import atomic_write_bytes

__all__ = ["ExtractPatches", "build", "build_dir", "build_key", "is_built", "kernel_for", "status"]

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parents[2] / "csrc"
SOURCES_CPU = ["ats_patches.cpp"]
SOURCES_CUDA = ["ats_patches.cpp", "ats_patches_cuda.cu"]

_lock = threading.Lock()
_modules: dict[bool, ModuleType | None] = {}
_reasons: dict[bool, str] = {}


def _enabled() -> bool:
    """``ATS_NATIVE=0`` (or off/false/no) turns the native kernels off; anything else leaves them on."""
    return os.environ.get("ATS_NATIVE", "1").strip().lower() not in ("0", "off", "false", "no")


HEADERS = ["ats_geometry.h", "ats_patches.h", "ats_patches_wide.cuh"]
HEARTBEAT_S = 15.0  # a line on stderr this often while the compiler runs


def _name(cuda: bool) -> str:
    return "ats_patches_cuda" if cuda else "ats_patches_cpu"


def _flags(cuda: bool) -> list[str]:
    return ["-O3"] + (["-DATS_WITH_CUDA"] if cuda else [])


def build_key(cuda: bool, csrc: Path | None = None) -> str:
    """What a build depends on, hashed: the bytes of its source files and headers (not
    their paths or times, so two checkouts of the same sources share a build), the flags,
    and the torch, CUDA and Python versions."""
    csrc = CSRC if csrc is None else Path(csrc)
    digest = hashlib.sha256()
    for name in sorted(set(SOURCES_CUDA if cuda else SOURCES_CPU) | set(HEADERS)):
        data = (csrc / name).read_bytes()
        digest.update(f"{name}\0{len(data)}\0".encode() + data)
    digest.update(repr((_flags(cuda), torch.__version__, torch.version.cuda if cuda else None,
                        sys.version_info[:2], torch.compiled_with_cxx11_abi())).encode())
    return digest.hexdigest()[:16]


def _cache_root() -> Path:
    return Path(os.environ.get("ATS_CACHE", Path.home() / ".cache" / "ats")) / "extensions"


def build_dir(cuda: bool) -> Path:
    """Where the build for these sources and versions lives (``$ATS_CACHE`` or ``~/.cache/ats``)."""
    flavour = f"cu{torch.version.cuda}" if cuda else "cpu"
    tag = f"torch{torch.__version__}-{flavour}-py{sys.version_info[0]}{sys.version_info[1]}"
    try:
        key = build_key(cuda)
    except OSError:  # no csrc/ (not a source checkout): build() says so
        key = "nosource"
    return _cache_root() / f"{tag.replace('+', '_')}-{key}"


BUILT = "built"  # written after a build succeeds: a .so without it may be a linker's half-written file


def is_built(cuda: bool) -> bool:
    """True when :func:`build_dir` holds a finished build (loading it takes milliseconds)."""
    directory = build_dir(cuda)
    return (directory / BUILT).is_file() and (directory / f"{_name(cuda)}.so").is_file()


def _import_built(path: Path) -> ModuleType:
    """Import a finished build's extension module from its file, as torch's loader does."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path}: not an extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _stage_sources(directory: Path, cuda: bool) -> list[str]:
    """Copy the sources into the build directory and compile those copies: ninja's record
    then names the same paths and the same file times whichever checkout built it, so a
    second checkout with the same sources (same directory, by :func:`build_key`) reuses
    the build instead of recompiling."""
    src = directory / "src"
    src.mkdir(parents=True, exist_ok=True)
    for name in sorted(set(SOURCES_CUDA if cuda else SOURCES_CPU) | set(HEADERS)):
        data = (CSRC / name).read_bytes()
        target = src / name
        if not target.is_file() or target.read_bytes() != data:
            atomic_write_bytes(target, data, fsync=False)  # compared byte for byte on every use
    return [str(src / s) for s in (SOURCES_CUDA if cuda else SOURCES_CPU)]


def _announce(message: str) -> None:
    print(f"ats: {message}", file=sys.stderr, flush=True)


def _wheel_cuda_includes(directory: Path, toolkit: str | os.PathLike | None = None) -> list[str]:
    """Headers of the CUDA libraries that torch's pip wheels ship (``nvidia/*/include``)
    that the toolkit lacks, linked into ``directory/wheel-include``.

    torch's CUDA headers include cuSPARSE/cuBLAS headers that a minimal toolkit (nvcc
    only) lacks; the wheels torch depends on carry them, matching torch's own CUDA. Only
    what the toolkit lacks: the wheels also carry the CUDA runtime and CCCL headers of
    torch's CUDA version, and nvcc refuses runtime headers newer than itself ("CUDA
    compiler and CUDA toolkit headers are incompatible": torch for CUDA 13.2 with nvcc
    13.0), so those must come from the toolkit that compiles.
    """
    try:
        import nvidia  # namespace package installed with torch's CUDA wheels
    except ImportError:
        return []
    roots = sorted(p for root in nvidia.__path__ for p in Path(root).glob("*/include") if p.is_dir())
    own = Path(toolkit) / "include" if toolkit else None
    if own is None or not own.is_dir():
        return [str(p) for p in roots]
    linked = directory / "wheel-include"
    linked.mkdir(parents=True, exist_ok=True)
    for root in roots:
        for entry in sorted(root.iterdir()):
            target = linked / entry.name
            if (own / entry.name).exists() or target.exists() or target.is_symlink():
                continue
            with contextlib.suppress(FileExistsError):  # another process building the same sources
                target.symlink_to(entry)
    return [str(linked)]


def _toolkit_ok(home: str | os.PathLike | None) -> bool:
    return bool(home) and (Path(home) / "include" / "cuda_runtime.h").is_file() and any(
        (Path(home) / lib / "libcudart.so").exists() for lib in ("lib64", "lib")
    )


def _resolve_cuda_home(cpp_extension: ModuleType) -> None:
    """Point torch's builder at a real toolkit when its guess is not one.

    Without ``CUDA_HOME``, torch takes the parent of ``which nvcc``; where nvcc is a
    wrapper script (e.g. /usr/local/bin/nvcc -> /usr/local/cuda-13.0) that guess has no
    headers or libcudart and the link fails. Look in the usual places instead.
    """
    if _toolkit_ok(cpp_extension.CUDA_HOME):
        return
    candidates = [os.environ.get("CUDA_PATH"), "/usr/local/cuda", *sorted(map(str, Path("/usr/local").glob("cuda-*")))]
    for home in candidates:
        if _toolkit_ok(home):
            cpp_extension.CUDA_HOME = home
            return


def build(cuda: bool, verbose: bool = False) -> ModuleType:
    """Compile (or load the cached build of) the extension; raises on failure."""
    if not CSRC.is_dir():
        raise FileNotFoundError(f"{CSRC} not found (the kernels ship with a source checkout)")
    directory = build_dir(cuda)
    if is_built(cuda):  # before the builder's import and the toolkit search, which only a build needs
        try:
            return _import_built(directory / f"{_name(cuda)}.so")
        except Exception as exc:  # noqa: BLE001 - a damaged build is rebuilt below, as if absent
            log.info("ats: the cached %s could not be imported (%s); rebuilding", directory, exc)
    # Importing the builder warns "No CUDA runtime is found" on every CPU-only machine:
    # true, expected, and noise on a user's terminal, so it is silenced here.
    quiet = logging.getLogger("torch.utils.cpp_extension")
    level, quiet.level = quiet.level, logging.ERROR
    try:
        from torch.utils import cpp_extension
    finally:
        quiet.setLevel(level)

    if cuda:
        _resolve_cuda_home(cpp_extension)
    directory.mkdir(parents=True, exist_ok=True)
    sources = _stage_sources(directory, cuda)
    what = f"native {'CUDA' if cuda else 'CPU'} patch kernel"
    fresh = not is_built(cuda)
    done = threading.Event()
    start = time.monotonic()
    if fresh:
        _announce(f"building the {what} (first use, about {'1.5 minutes' if cuda else 'a minute'}; "
                  f"cached in {directory})...")

        def heartbeat() -> None:
            while not done.wait(HEARTBEAT_S):
                _announce(f"  still compiling the {what} ({time.monotonic() - start:.0f} s)...")

        threading.Thread(target=heartbeat, name="ats-native-build", daemon=True).start()
    try:
        module = cpp_extension.load(
            name=_name(cuda),
            sources=sources,
            extra_cflags=_flags(cuda),
            extra_cuda_cflags=["-O3", "-DATS_WITH_CUDA"],
            extra_include_paths=[str(directory / "src")]
            + (_wheel_cuda_includes(directory, cpp_extension.CUDA_HOME) if cuda else []),
            build_directory=str(directory),
            with_cuda=cuda,
            verbose=verbose,
        )
    except BaseException:
        done.set()
        if fresh:
            _announce(f"building the {what} failed after {time.monotonic() - start:.0f} s")
        raise
    done.set()
    atomic_write_bytes(directory / BUILT, build_key(cuda).encode(), fsync=False)
    if fresh:
        _announce(f"built the {what} in {time.monotonic() - start:.0f} s (later runs load it from the cache)")
    return module


def _module(cuda: bool) -> ModuleType | None:
    with _lock:
        if cuda not in _modules:
            try:
                _modules[cuda] = build(cuda)
                _reasons[cuda] = f"built in {build_dir(cuda)}"
            except Exception as exc:  # noqa: BLE001 - any build failure means: use the torch path
                _modules[cuda] = None
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                _reasons[cuda] = f"build failed ({type(exc).__name__}: {first[:200]})"
                log.warning("ats: native %s patch kernel unavailable, using the torch path: %s",
                            "CUDA" if cuda else "CPU", _reasons[cuda])
        return _modules[cuda]


def kernel_for(images: torch.Tensor) -> ModuleType | None:
    """The extension module to use for ``images`` (built on first call), or None for the torch path."""
    if not _enabled() or images.device.type not in ("cpu", "cuda"):
        return None
    return _module(cuda=images.is_cuda)


def status(try_build: bool = False) -> dict[str, str]:
    """Which patch-extraction path each device uses, and why (for ``ats doctor``)."""
    if not _enabled():
        return {"cpu": "torch path (ATS_NATIVE=0)", "cuda": "torch path (ATS_NATIVE=0)"}
    out: dict[str, str] = {}
    for device, cuda in (("cpu", False), ("cuda", True)):
        if cuda and not torch.cuda.is_available():
            out[device] = "torch path (no CUDA device visible to torch)"
            continue
        if try_build:
            _module(cuda)
        if cuda not in _modules:
            out[device] = "native kernel, built on first use (`ats doctor --build` builds it now)"
        elif _modules[cuda] is None:
            out[device] = f"torch path: {_reasons[cuda]}"
        else:
            out[device] = f"native kernel ({_reasons[cuda]})"
    return out


class ExtractPatches(torch.autograd.Function):
    """Autograd wrapper: the backward is the kernel's scatter-add into the image."""

    @staticmethod
    def forward(ctx, module: ModuleType, images: torch.Tensor, offsets: torch.Tensor, h: int, w: int):
        ctx.module, ctx.image_hw = module, images.shape[-2:]
        ctx.save_for_backward(offsets)
        return module.extract(images, offsets, h, w)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (offsets,) = ctx.saved_tensors
        grad_images = None
        if ctx.needs_input_grad[1]:
            grad_images = ctx.module.scatter(grad, offsets, *ctx.image_hw)
        return None, grad_images, None, None, None
