"""Reading a split's images once each, in worker processes: every image's labelled patches
(stage 1) and, when stage 1b runs, its low-res view and the cells of each of its objects."""

from __future__ import annotations

import multiprocessing
import sys
from concurrent.futures import ProcessPoolExecutor

import numpy as np

from ats_cli.pretrain.patches import SMALL_PATCHES, cut_patches
from ats_cli.pretrain.regions import row_regions

View = tuple[float, tuple[int, int], int]  # (scale, attention map shape, margin): what stage 1b's views need


def read_example(path: str, boxes: list[list[int]], size: int, seed: int, shrunken: int = SMALL_PATCHES,
                 view: View | None = None, none: int = 10, channels: int = 1):
    """One image, decoded once: its labelled patches (:func:`~ats_cli.pretrain.patches.cut_patches`)
    and, with ``view``, its low-res view and object cells for stage 1b
    (:func:`~ats_cli.pretrain.attention.attention_example`; else None, None). None for an
    image that cannot be read, with a line on stderr naming it."""
    from ats_cli.data.images import ImageReadError, read_image
    from ats_cli.pretrain.attention import attention_example

    try:
        image = read_image(path, channels=channels)
    except (ImageReadError, OSError) as e:
        print(f"skipped: {str(e).splitlines()[0]}", file=sys.stderr, flush=True)  # the message names the file
        return None
    pixels = image[0].numpy() if channels == 1 else image.numpy()
    patches, labels = cut_patches(pixels, boxes, size, seed, shrunken, none)
    low, cells = attention_example(image, boxes, size, *view) if view else (None, None)
    return patches, labels, low, cells


def read_all(records, classes: list[str], size: int, seed: int, workers: int, where: str, shrunken: int,
             view: View | None, column: str = "digits", base: str | None = None, channels: int = 1):
    """:func:`read_example` over ``records`` (image ``i`` seeded ``seed * 1_000_003 + i``):
    patches [n, size, size] (one channel; else [n, C, size, size]), labels [n], and with
    ``view`` the views [images, h, w] (else [images, C, h, w]) and the object cells per
    image (else None, None). ``column``: the regions' CSV column, GeoJSON paths in it
    relative to ``base`` (:func:`~ats_cli.pretrain.regions.row_regions`). A row without
    usable regions raises :class:`~ats_cli.pretrain.PretrainError` before any image is read."""
    none = len(classes)
    jobs = [(str(r.path), row_regions(dict(r.extra), column, classes, f"{where}:{r.line}", base), size,
             seed * 1_000_003 + i, shrunken, view, none, channels) for i, r in enumerate(records)]
    if workers <= 1:
        parts = [read_example(*job) for job in jobs]
    else:
        # spawned, not forked: the caller has run torch (the model, the attention map's shape),
        # and a forked child of a process whose torch thread pool has started can hang. One
        # torch thread each: N workers with a thread per core each oversubscribe the cores N
        # times over
        from ats_cli.data.inputs import single_thread_worker

        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                 initializer=single_thread_worker, initargs=(0,)) as pool:
            parts = list(pool.map(read_example, *zip(*jobs, strict=True), chunksize=16))
    parts = [p for p in parts if p is not None]
    empty = (0, size, size) if channels == 1 else (0, channels, size, size)
    x = np.concatenate([p[0] for p in parts]) if parts else np.zeros(empty, np.uint8)
    y = np.concatenate([p[1] for p in parts]) if parts else np.zeros(0, np.int64)
    if view is None:
        return x, y, None, None
    views = np.stack([p[2] for p in parts]) if parts else np.zeros((0, 1, 1), np.float16)
    return x, y, views, [p[3] for p in parts]
