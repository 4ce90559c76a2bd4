"""Build the dataset format from an ImageFolder-style tree (one sub-folder per class).

Why reference by absolute path by default: whole-slide and megapixel images are large,
and copying a 500 GB slide collection to get three CSV files would be absurd. ``copy``
and ``link`` (symlink) modes exist for when the dataset directory must be
self-contained or portable. Splits are stratified (each class is split separately, so
rare classes appear in every split) and seeded; each class's shuffle depends only on the
seed and the class *name*, so adding a class does not reshuffle the others.
"""

from __future__ import annotations

import os
import shutil
import zlib
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from ats_cli.data.dataset import (
    DATASET_JSON,
    INPUT_SUFFIXES,
    OMEZARR,
    PILLOW,
    Dataset,
    DatasetError,
    Problem,
    backend,
    load_dataset,
    write_dataset,
)
from ats_cli.data.images import pil_channels
from ats_cli.io import atomic_path

__all__ = ["MODES", "dataset_from_folder", "stratified_split"]

MODES = ("reference", "copy", "link")


def stratified_split(n: int, fractions: dict[str, float], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Split ``range(n)`` into the named parts; ``train`` takes what the others leave.

    A part with a positive fraction gets ``round(n * fraction)`` items but at least one
    as long as ``train`` keeps at least one, so small classes still reach every split.
    """
    order = rng.permutation(n)
    sizes: dict[str, int] = {}
    left = n
    for name, fraction in fractions.items():
        k = int(round(n * fraction))
        if fraction > 0 and k == 0:
            k = 1
        k = min(k, left - 1) if left > 0 else 0
        sizes[name] = max(k, 0)
        left -= sizes[name]
    parts: dict[str, np.ndarray] = {}
    start = 0
    for name, k in sizes.items():
        parts[name] = order[start : start + k]
        start += k
    parts["train"] = order[start:]
    return parts


def _files(folder: Path, extensions: Iterable[str]) -> list[Path]:
    """The image files under the class folder ``folder``, each once.

    Links are followed, but never out of the class folder and never twice into one
    directory: a directory link is entered only when its real path lies inside the class
    folder's real path and has not been walked yet. A link to ``..`` or to another class
    would otherwise walk the tree again (a loop walks it once per level of the loop),
    giving every file several rows, some under another class's label and in both train
    and test. A file reached twice (two links to it, or a link beside its target) is
    listed once, at the first path found. The class folder itself may be a link (a class
    kept on another disk): it is the tree's root. A link to a file is followed wherever it
    points: it names one file, so it can neither loop nor multiply the tree, and gathering
    a class from several disks by linking its files is common; two classes reaching one
    file are refused (:func:`_one_class_per_file`)."""
    exts = {e.lower() if e.startswith(".") else "." + e.lower() for e in extensions}
    root = folder.resolve()
    found, seen_dirs, seen_files = [], set(), set()
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
        real = Path(dirpath).resolve()
        if real in seen_dirs or not (real == root or root in real.parents):
            dirnames[:] = []  # a loop, or a link out of the class folder: not walked
            continue
        seen_dirs.add(real)
        # an OME-Zarr store is one image: listed with the files, never walked into
        stores = [d for d in dirnames if backend(d) == OMEZARR and d.lower().endswith(tuple(exts))]
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in stores)
        files = [f for f in filenames if backend(f) != OMEZARR]  # a file named .zarr is no store
        for name in sorted(files + stores):
            if not name.startswith(".") and name.lower().endswith(tuple(exts)):  # .vslide.json: two suffixes
                file = Path(dirpath) / name
                key = os.path.realpath(file)
                if key not in seen_files:
                    seen_files.add(key)
                    found.append(file)
    return found


def _one_class_per_file(src: Path, per_class: dict[str, list[Path]]) -> None:
    """Refuse a file that two class folders both reach (a link in one to the other's
    file): it would be labelled twice, and could land in train and test at once."""
    owner: dict[str, str] = {}
    problems = []
    for c, files in per_class.items():
        for f in files:
            key = os.path.realpath(f)
            if key in owner and owner[key] != c:
                problems.append(Problem(str(f), 0, f"is {key}, which both {owner[key]}/ and {c}/ hold (through a "
                                        "link): one file cannot have two labels; keep it in one class folder"))
            owner.setdefault(key, c)
    if problems:
        raise DatasetError(src, problems)


def _channels(path: Path) -> int | None:
    """The channels the readers will give ``path`` (the ``channels`` hint), from its
    header; None (no hint rather than a wrong one) when it cannot be opened."""
    if backend(path) in (None, PILLOW):
        return pil_channels(path)
    try:
        from ats_cli.data.slides import open_image  # torch: only for a dataset of TIFFs or slides

        with open_image(path) as slide:
            return slide.channels
    except Exception:  # noqa: BLE001 - any reader, any failure (OpenSlide not installed): no hint
        return None


def dataset_from_folder(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    test_fraction: float = 0.2,
    val_fraction: float = 0.0,
    seed: int = 0,
    mode: str = "reference",
    extensions: Iterable[str] = INPUT_SUFFIXES,
    overwrite: bool = False,
) -> Dataset:
    """Write ``train.csv``/``test.csv`` (and ``val.csv`` if ``val_fraction`` > 0) for ``src`` into ``out``.

    ``src`` has one sub-folder per class (sorted names = class order), images anywhere
    below it. ``mode``: ``reference`` (CSV paths are absolute paths into ``src``),
    ``copy`` or ``link`` (files copied or symlinked to ``out/images/<class>/...``, CSV paths
    relative). Refuses an ``out`` that already holds a dataset unless ``overwrite``.
    Returns the written dataset, loaded and validated.
    """
    src = Path(src).expanduser().resolve()
    out = Path(out).expanduser().resolve()
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if not (0 <= test_fraction < 1 and 0 <= val_fraction < 1 and test_fraction + val_fraction < 1):
        raise ValueError(f"need 0 <= test ({test_fraction}), val ({val_fraction}) and test + val < 1")
    if test_fraction == 0:
        raise ValueError("test_fraction must be > 0: the format requires a test split")
    if not src.is_dir():
        what = "is a file, not a folder of class folders" if src.exists() else "does not exist"
        raise DatasetError(src, [Problem(str(src), 0, what)])
    if out == src or src in out.parents:
        raise DatasetError(src, [Problem(str(out), 0, "the output directory must not be inside the source tree "
                                         "(it would be read as a class folder)")])
    if (out / DATASET_JSON).exists() and not overwrite:
        raise DatasetError(out, [Problem(DATASET_JSON, 0, "already exists; pass overwrite (--force) to replace it")])

    classes = sorted(d.name for d in src.iterdir() if d.is_dir() and not d.name.startswith("."))
    if not classes:
        raise DatasetError(src, [Problem(str(src), 0, "no class sub-folders (expected SRC/<class>/<image>)")])
    per_class = {c: _files(src / c, extensions) for c in classes}
    _one_class_per_file(src, per_class)
    empty = [c for c, files in per_class.items() if not files]
    if empty:
        raise DatasetError(src, [Problem(f"{c}/", 0, "class folder holds no images with extensions "
                                         f"{' '.join(sorted(set(extensions)))}") for c in empty])

    fractions = {"test": test_fraction}
    if val_fraction > 0:
        fractions["val"] = val_fraction
    splits: dict[str, list[dict[str, str]]] = {"train": [], **{k: [] for k in fractions}}
    for c in classes:
        files = per_class[c]
        rng = np.random.default_rng(np.random.SeedSequence(entropy=seed, spawn_key=(zlib.crc32(c.encode("utf-8")),)))
        for split, picks in stratified_split(len(files), fractions, rng).items():
            for i in sorted(picks.tolist()):
                splits[split].append({"path": _place_file(files[i], src, out, c, mode), "label": c})

    empty_splits = [s for s, rows in splits.items() if not rows]
    if empty_splits:
        raise DatasetError(src, [Problem(str(src), 0, f"too few images for a {s} split: every class keeps at least "
                                         "one training image; add images or raise the fraction")
                                 for s in empty_splits])
    first = per_class[classes[0]][0]
    hints = {"channels": ch} if (ch := _channels(first)) else {}
    write_dataset(
        out,
        classes,
        splits,
        hints=hints,
        description=f"built by `ats make-dataset from-folder` from {src} ({mode}, test {test_fraction:g}, "
        f"val {val_fraction:g}, seed {seed})",
    )
    return load_dataset(out)


def _place_file(file: Path, src: Path, out: Path, label: str, mode: str) -> str:
    if mode == "reference":
        return str(file)
    rel = Path("images") / label / file.relative_to(src / label)
    dest = out / rel
    dest.parent.mkdir(parents=True, exist_ok=True)
    if mode == "copy" and file.is_dir():  # an OME-Zarr store
        _copy_store(file, dest)
        return rel.as_posix()
    with atomic_path(dest) as tmp:
        if mode == "copy":
            shutil.copy2(file, tmp)
        else:
            tmp.unlink(missing_ok=True)  # a stale one would make symlink fail
            os.symlink(file, tmp)
    return rel.as_posix()


def _copy_store(store: Path, dest: Path) -> None:
    """Copy the OME-Zarr store (a directory) to ``dest`` as :func:`ats_cli.io.atomic_path`
    writes a file: into a temporary directory beside it, renamed into place when whole, so
    an interrupted copy leaves no partial store that a later run would read (or that
    :class:`~ats_cli.data.omezarr.OmeZarrReader` would refuse for its missing chunks)."""
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        shutil.copytree(store, tmp, symlinks=False)
        if dest.is_dir() and not dest.is_symlink():
            shutil.rmtree(dest)  # --force over an earlier copy
        elif dest.exists() or dest.is_symlink():
            dest.unlink()
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
