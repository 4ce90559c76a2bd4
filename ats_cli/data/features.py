"""The feature store: a frozen encoder's feature of a patch computed once, then read back.

Why: with a frozen feature net (``feature_train none``, the default for pretrained
encoders) the feature of a patch is a fixed function of its pixels, yet attention
sampling draws many of the same places epoch after epoch (the attention concentrates:
that is its point), and each draw ran the encoder again. The encoder is most of a step's
cost on a CPU, and a patch read from a slide is the rest. Here a patch already encoded
(the same source content, read the same way, at the same position and size, by the same
encoder) is read back instead: a lookup for a batch returns the stored features and
computes only the missing ones (:meth:`FeatureStore.features`).

Results do not change: a stored feature is the float32 the encoder computed for that
patch, read back bit for bit; the estimator, its weights and the gradients are those of a
run without the store (the encoder's output enters them as a constant either way,
:class:`ats_cli.nets.encoders.Encoder`). One caveat, measured and not ours to remove: a
backend whose kernels depend on the batch size (oneDNN's convolutions on a CPU for
ResNet-18: up to 2e-7 between a patch encoded in a batch of 16 and alone) gives a
recomputed feature that differs in the last bits from the stored one, as two batch sizes
do without a store. With an encoder whose per-patch output does not depend on the batch
(``small-cnn`` on a CPU: tested), a run with the store gives the losses and weights of
one without, bit for bit.

**Keys.** A patch's key hashes (BLAKE2b, 128 bits):

* its source's content key: the file's size, mtime, ctime and content digest, the key the
  view cache names slides' views by (:func:`ats_cli.data.inputs.source_state`), plus how
  it is read (reader, pyramid level, the resampling factor of ``--mpp``, a virtual slide's
  renderer, the size and channels handed out). A file rewritten or touched gets new keys;
  a file whose times do not yet prove it unchanged (written within a timestamp tick of
  the read, :func:`ats_cli.io.settled`) is encoded without the store. An OME-Zarr store (a
  directory) has no such key and is always encoded;
* the patch's top-left corner and size in the pixels handed out;
* where it was computed: the device type and the autocast dtype (CUDA encodes a frozen
  backbone in bf16: other bits than a CPU's).

and the encoder's identity names the store's sub-folder: the feature net's name and
arguments (input size, normalisation, head), a digest of every weight and buffer (the
normalisation's mean and std included), the torch version. Another encoder, other weights
or another torch never read another's features.

**Augmentation bypasses the store.** A patch augmented in the training step (colour
jitter, flips: :mod:`ats_cli.augment`) has new pixels at every draw, so its feature
would never be met again; keying on the augmentation's draw would store features that
are never read. Such steps encode as without the store (evaluation, never augmented,
still uses it). ``feature_store auto`` is therefore on only without augmentation.

**On disk.** ``RUN/cache/features/<encoder>/`` by default, beside the view cache and for
the same reasons (a run directory is the run's own and writable; a dataset directory may
be read-only or shared between people); ``ATS_FEATURE_STORE=DIR`` shares one between runs
(a sweep over heads on one frozen encoder: the later runs' first epochs hit too), and
``ATS_FEATURE_STORE=off`` turns it off. Features are written in segments of up to
:data:`SEGMENT_BYTES`, each a new file written atomically (:func:`ats_cli.io.atomic_path`)
under a name no other process uses (time, pid, counter): processes (runs sharing a
store; in one DDP run rank 0 alone writes, the others read) never write the same file,
need no lock to write, and see each other's segments at the next
:meth:`~FeatureStore.refresh` (each epoch). A killed process loses
its unwritten buffer only; the next run reads every whole segment (resumable), and its
temporary file is swept by the next process that evicts, once the pid is gone.

A segment (little-endian)::

    b"ATSFEAT1" | u32 header length | header JSON (format, encoder, dim, count)
    keys: count x 16 bytes, sorted | crc32 of each row: count x u32 | rows: count x dim float32

Each row's CRC-32 is checked as it is read; a row that fails it (a damaged file) is said
in one line, its segment removed, and the patch encoded again.

**Bounded.** On disk, at ``feature_store_gb`` (all encoders' segments together): after a
segment is written, the oldest segments (by modification time) are deleted until the store
is within it, under an OS lock on ``.lock`` so that two processes do not evict at once; a
process that had indexed a deleted segment reads its rows as missing and encodes them
again (never wrong, only slower). In memory: the index holds 24 bytes per stored feature
(its key, segment and row) and the buffer at most :data:`SEGMENT_BYTES`; rows are read
from the files as they are asked for.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import struct
import sys
import time
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ats_cli.io import atomic_path, held, released, settled

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: eviction by two processes at once is then the user's care
    fcntl = None

__all__ = ["ENV", "FORMAT", "MAGIC", "SEGMENT_BYTES", "FeatureStore", "FeatureStoreError", "encoder_identity",
           "feature_store_for", "image_keys", "ImageKeys"]

ENV = "ATS_FEATURE_STORE"
FORMAT = 1
MAGIC = b"ATSFEAT1"
SEGMENT_BYTES = 8 << 20  # a segment's rows: few files, and a killed process loses at most this much work
SUFFIX = ".seg"


class FeatureStoreError(ValueError):
    """A segment that cannot be read as one (another format, damaged)."""


# ---------------------------------------------------------------- keys


def encoder_identity(feature_net: torch.nn.Module, name: str, kwargs: dict[str, Any]) -> str:
    """A digest of what a frozen feature net computes: its name and arguments (input size,
    normalisation, head), every parameter and buffer (persistent or not: the mean and std of
    :class:`~ats_cli.nets.encoders.Encoder` are buffers outside its state dict), and the
    torch version. Read once per run (a ResNet-18's 45 MB in about 0.1 s)."""
    h = hashlib.sha256()
    h.update(json.dumps({"format": FORMAT, "net": name, "kwargs": kwargs, "torch": torch.__version__},
                        sort_keys=True, default=str).encode())
    for key, t in itertools.chain(feature_net.named_parameters(), feature_net.named_buffers()):
        data = t.detach().cpu().contiguous()
        h.update(f"{key}\0{data.dtype}\0{tuple(data.shape)}\0".encode())
        h.update(data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return h.hexdigest()


class ImageKeys:
    """Each image's content key, as :mod:`ats_cli.data.inputs`'s view cache names a file (its
    size, mtime, ctime and content digest) plus how it is read; the digest is taken again
    only when the file's stat changes, so a step costs one ``os.stat`` per image."""

    def __init__(self) -> None:
        self._known: dict[str, tuple[tuple[int, int, int], str]] = {}

    def key(self, path: str | os.PathLike[str], source: Any) -> str | None:
        """``path``'s key as ``source`` (its patch source in the batch, or None for a batch
        stacked into one tensor) hands out its pixels; None when there is none to trust: a
        directory (OME-Zarr), a file that cannot be read, or one whose times do not yet
        prove it unchanged (module docstring)."""
        from ats_cli.data.inputs import content_digest

        path = str(path)
        stamped = time.time_ns()
        try:
            st = os.stat(path)
            if not os.path.isfile(path):
                return None
            stat = (st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            known = self._known.get(path)
            digest = known[1] if known and known[0] == stat else content_digest(path)
        except OSError:
            return None
        if not settled(stamped, st.st_mtime_ns, st.st_ctime_ns):
            return None
        self._known[path] = (stat, digest)
        size = getattr(source, "size", None)
        reading = {"bytes": stat[0], "mtime_ns": stat[1], "ctime_ns": stat[2], "content": digest,
                   "path": str(Path(path).resolve()),
                   "reader": getattr(source, "name", None), "level": getattr(source, "level", None),
                   "resampled": repr(float(getattr(source, "factor", 1.0))),
                   "renderer": getattr(source, "renderer", None),
                   "size": list(size) if size is not None else None,
                   "channels": getattr(source, "channels", None)}
        return hashlib.sha256(json.dumps(reading, sort_keys=True, default=str).encode()).hexdigest()


def image_keys(keys: ImageKeys, dataset: Any, indices: torch.Tensor, sources: Any) -> list[str | None]:
    """The content keys of a batch's images: ``indices`` are positions in ``dataset``'s
    records (:class:`~ats_cli.data.inputs.Batch`), ``sources`` the batch's sources (a stacked
    tensor of ordinary images carries no reader of its own)."""
    records = dataset.records
    lazy = not isinstance(sources, torch.Tensor)
    return [keys.key(records[int(i)].path, sources[k] if lazy else None) for k, i in enumerate(indices.tolist())]


def _patch_keys(image: Sequence[str | None], offsets: torch.Tensor, size: tuple[int, int], where: str
                ) -> list[bytes | None]:
    """One 16-byte key per patch of offsets [B, n, 2] (host), None for an image without a key:
    120 bits of BLAKE2b and a last byte of 1, because numpy's fixed-width bytes (the index's
    ``S16``) drop trailing zero bytes, and a key that ends in none reads back as it was."""
    out: list[bytes | None] = []
    for b, rows in enumerate(offsets.tolist()):
        for top, left in rows:
            out.append(None if image[b] is None else hashlib.blake2b(
                f"{image[b]}\0{top}\0{left}\0{size[0]}\0{size[1]}\0{where}".encode(), digest_size=15).digest()
                + b"\1")
    return out


# ---------------------------------------------------------------- the store


class FeatureStore:
    """Frozen features on disk in ``folder`` (the module docstring says how), at most
    ``cap_bytes`` of segments, for the encoder ``encoder`` (:func:`encoder_identity`) whose
    features have ``dim`` values."""

    def __init__(self, folder: str | os.PathLike[str], encoder: str, dim: int, *, cap_bytes: int):
        self.root = Path(folder)
        self.encoder = encoder
        self.dim = int(dim)
        self.cap_bytes = int(cap_bytes)
        self.folder = self.root / encoder[:32]
        self.writable = True
        self.hits = self.misses = 0
        self.keys_of = ImageKeys()  # the images' content keys, for image_keys
        self._segments: list[Path] = []  # index -> file
        self._seen: set[str] = set()
        self._keys = np.empty(0, dtype="S16")  # sorted, with their segment and row
        self._seg = np.empty(0, dtype=np.int32)
        self._row = np.empty(0, dtype=np.int32)
        self._pending: dict[bytes, np.ndarray] = {}
        self._counter = itertools.count()
        self._damaged_said = False
        self.refresh()

    # ---- reading
    def refresh(self) -> None:
        """Index the segments written since the last look (by this process or another)."""
        try:
            names = sorted(p.name for p in self.folder.glob("*" + SUFFIX))
        except OSError:
            names = []
        new = [n for n in names if n not in self._seen]
        parts = []
        for name in new:
            self._seen.add(name)
            path = self.folder / name
            try:
                keys = self._read_keys(path)
            except FileNotFoundError:  # evicted meanwhile
                continue
            except (OSError, FeatureStoreError) as e:
                self._damaged(path, e)
                continue
            self._segments.append(path)
            parts.append((keys, len(self._segments) - 1))
        if parts:
            self._index(parts)

    def _index(self, parts: list[tuple[np.ndarray, int]]) -> None:
        keys = np.concatenate([self._keys, *(k for k, _ in parts)])
        seg = np.concatenate([self._seg, *(np.full(len(k), s, dtype=np.int32) for k, s in parts)])
        row = np.concatenate([self._row, *(np.arange(len(k), dtype=np.int32) for k, _ in parts)])
        order = np.argsort(keys, kind="stable")
        self._keys, self._seg, self._row = keys[order], seg[order], row[order]

    def _read_keys(self, path: Path) -> np.ndarray:
        with open(path, "rb") as fh:
            header, start = self._header(fh, path)
            raw = fh.read(16 * header["count"])
        if len(raw) != 16 * header["count"]:
            raise FeatureStoreError("cut short")
        return np.frombuffer(raw, dtype="S16")

    def _header(self, fh: Any, path: Path) -> tuple[dict[str, Any], int]:
        head = fh.read(len(MAGIC) + 4)
        if len(head) != len(MAGIC) + 4 or head[:len(MAGIC)] != MAGIC:
            raise FeatureStoreError("not a feature segment")
        (length,) = struct.unpack("<I", head[len(MAGIC):])
        if length > 1 << 16:
            raise FeatureStoreError("a header too large")
        try:
            header = json.loads(fh.read(length).decode())
        except (UnicodeDecodeError, ValueError) as e:
            raise FeatureStoreError(f"its header is damaged ({e})") from None
        if not isinstance(header, dict) or header.get("format") != FORMAT or header.get("encoder") != self.encoder \
                or header.get("dim") != self.dim or not isinstance(header.get("count"), int):
            raise FeatureStoreError("another format or encoder")
        return header, len(head) + length

    def lookup(self, keys: Sequence[bytes | None]) -> tuple[np.ndarray, np.ndarray]:
        """(features [len(keys), dim] float32, found [len(keys)] bool): the stored features
        of ``keys`` (None: never stored), zeros where not found."""
        out = np.zeros((len(keys), self.dim), dtype=np.float32)
        found = np.zeros(len(keys), dtype=bool)
        wanted: dict[int, list[tuple[int, int]]] = {}  # segment -> (position, row)
        for i, key in enumerate(keys):
            if key is None:
                continue
            if key in self._pending:
                out[i], found[i] = self._pending[key], True
                continue
            j = int(np.searchsorted(self._keys, key)) if len(self._keys) else 0
            if j < len(self._keys) and self._keys[j] == key:
                wanted.setdefault(int(self._seg[j]), []).append((i, int(self._row[j])))
        for seg, rows in wanted.items():
            self._read_rows(seg, rows, out, found)
        n_found = int(found.sum())
        self.hits += n_found
        self.misses += len(keys) - n_found
        return out, found

    def _read_rows(self, seg: int, rows: list[tuple[int, int]], out: np.ndarray, found: np.ndarray) -> None:
        path = self._segments[seg]
        row_bytes = 4 * self.dim
        try:
            with open(path, "rb") as fh:
                header, start = self._header(fh, path)
                n = header["count"]
                crc_at, data_at = start + 16 * n, start + 20 * n
                fd = fh.fileno()
                for i, r in rows:
                    (crc,) = struct.unpack("<I", os.pread(fd, 4, crc_at + 4 * r))
                    raw = os.pread(fd, row_bytes, data_at + row_bytes * r)
                    if len(raw) != row_bytes or zlib.crc32(raw) != crc:
                        raise FeatureStoreError(f"row {r} does not match its checksum")
                    out[i] = np.frombuffer(raw, dtype="<f4")
                    found[i] = True
        except FileNotFoundError:  # evicted by another process: encoded again
            self._forget(seg)
        except (OSError, FeatureStoreError, struct.error) as e:
            self._damaged(path, e)
            self._forget(seg)
            for i, _ in rows:
                found[i] = False

    def _forget(self, seg: int) -> None:
        keep = self._seg != seg
        self._keys, self._seg, self._row = self._keys[keep], self._seg[keep], self._row[keep]

    def _damaged(self, path: Path, e: BaseException) -> None:
        print(f"warning: {path}: a damaged feature segment ({e}); removed, its patches are encoded again",
              file=sys.stderr, flush=True)
        with contextlib.suppress(OSError):
            path.unlink()

    # ---- writing
    def add(self, keys: Sequence[bytes | None], feats: np.ndarray) -> None:
        """Keep ``feats`` [len(keys), dim] (float32) under ``keys`` (None: not kept); written
        as a segment once :data:`SEGMENT_BYTES` are buffered."""
        if not self.writable or self.cap_bytes <= 0:
            return
        for key, row in zip(keys, feats, strict=True):
            if key is not None:
                self._pending[key] = np.array(row, dtype=np.float32)
        if len(self._pending) * (4 * self.dim + 20) >= SEGMENT_BYTES:
            self.flush()

    def flush(self) -> None:
        """Write the buffered features as one segment (atomically), then keep the store
        within its cap. A folder that cannot take it is said once, and the store then
        only reads."""
        if not self._pending or not self.writable:
            self._pending.clear()
            return
        order = sorted(self._pending)
        keys = np.array(order, dtype="S16")
        rows = np.stack([self._pending[k] for k in order]).astype("<f4")
        crcs = np.array([zlib.crc32(r.tobytes()) for r in rows], dtype="<u4")
        header = json.dumps({"format": FORMAT, "encoder": self.encoder, "dim": self.dim,
                             "count": len(keys)}).encode()
        name = f"{time.time_ns():020d}-{os.getpid()}-{next(self._counter)}{SUFFIX}"
        path = self.folder / name
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with atomic_path(path) as tmp, open(tmp, "wb") as fh:
                fh.write(MAGIC + struct.pack("<I", len(header)) + header)
                fh.write(keys.tobytes())
                fh.write(crcs.tobytes())
                fh.write(rows.tobytes())
        except OSError as e:
            self.writable = False
            print(f"warning: {self.folder}: cannot write the feature store ({e.strerror or e}); going on without "
                  f"storing features (set {ENV}=DIR elsewhere, or {ENV}=off)", file=sys.stderr, flush=True)
            self._pending.clear()
            return
        self._pending.clear()
        self._seen.add(name)
        self._segments.append(path)
        self._index([(keys, len(self._segments) - 1)])
        self._evict()

    def _evict(self) -> None:
        """Delete the oldest segments (of every encoder) until the store is within its cap;
        one process at a time (an OS lock on ``.lock``), and temporaries left by dead
        processes are swept meanwhile."""
        segments = []
        for p in self.root.glob("*/*" + SUFFIX):
            with contextlib.suppress(OSError):
                st = p.stat()
                segments.append((st.st_mtime_ns, p.name, p, st.st_size))
        total = sum(s[3] for s in segments)
        if total <= self.cap_bytes:
            return
        with _lock(self.root / ".lock"):
            _sweep_dead(self.root)
            for _, _, p, size in sorted(segments):
                if total <= self.cap_bytes:
                    break
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
                total -= size

    # ---- for the model
    def features(self, feature_net: torch.nn.Module, patches_of: Any, image: Sequence[str | None],
                 offsets: torch.Tensor, size: tuple[int, int], device: torch.device) -> torch.Tensor:
        """The feature net's output [B * n, dim] for the patches at ``offsets`` [B, n, 2] of
        images with content keys ``image``: stored rows where there are, the others computed
        by ``feature_net`` on ``patches_of(missing)`` (the float patches [m, C, ph, pw] of a
        bool mask [B, n]) and stored. Rows come out in the order of the patches."""
        from ats_cli.core.model import pixels_to_float
        from ats_cli.core.source import to_device

        autocast = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else ""
        where = f"{device.type}:{autocast}"
        host = offsets.detach().cpu()
        keys = _patch_keys(image, host, size, where)
        stored, found = self.lookup(keys)
        B, n = host.shape[:2]
        missing = torch.from_numpy(~found).view(B, n)
        out = torch.from_numpy(stored).to(device)
        if missing.any():
            # as the model reads patches without a store: to the device, then to float
            computed = feature_net(pixels_to_float(to_device(patches_of(missing), device))).float()
            rows = missing.flatten().nonzero().flatten()
            out = out.index_copy(0, rows.to(device), computed)
            fresh = computed.detach().cpu().numpy()
            self.add([keys[int(r)] for r in rows], fresh)
        return out

    def summary(self) -> str:
        total = self.hits + self.misses
        rate = self.hits / total if total else 0.0
        return f"feature store {self.folder}: {self.hits} of {total} patches read back ({rate:.0%})"


@contextlib.contextmanager
def _lock(path: Path):
    if fcntl is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = held(os.open(path, os.O_RDWR | os.O_CREAT, 0o644))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        released(fd)
        os.close(fd)  # closing drops the lock


def _sweep_dead(root: Path) -> None:
    """Temporaries (``.NAME.PID.tmp``, :func:`ats_cli.io.atomic_path`) whose process is gone."""
    from ats_cli.io import alive

    for stray in root.glob("*/.*.tmp"):
        try:
            pid = int(stray.name.rsplit(".", 2)[-2])
        except (ValueError, IndexError):
            continue
        if not alive(pid):
            stray.unlink(missing_ok=True)


def feature_store_for(run: str | os.PathLike[str], feature_net: torch.nn.Module, name: str, kwargs: dict[str, Any],
                      *, cap_gb: float) -> FeatureStore | None:
    """The store a run uses: ``RUN/cache/features``, or ``$ATS_FEATURE_STORE``; None when that
    is ``off`` or the cap is 0."""
    where = os.environ.get(ENV, "").strip()
    if where.lower() in ("off", "0", "none", "no") or cap_gb <= 0:
        return None
    folder = Path(where).expanduser() if where else Path(run) / "cache" / "features"
    return FeatureStore(folder, encoder_identity(feature_net, name, kwargs), int(feature_net.out_features),
                        cap_bytes=int(cap_gb * (1 << 30)))
