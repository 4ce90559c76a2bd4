"""Prepared images: an ordinary image (PNG, JPEG, ... read whole) decoded once into a
layout that hands out patches and its low-res view without decoding or resizing again.

Why: attention sampling reads n small patches of an image and a low-res view of it, yet
an image read whole is decoded and resized in full every epoch, and the whole image is
copied into the batch, to be read ten patches of. A prepared entry keeps the view as it
was computed and the pixels in small compressed tiles, so a read costs the view and the
tiles the patches touch, whatever the image's size.

The layout (chosen against raw memory-mapped arrays; the figures of both are in
benchmarks/README.md, "Loader", measured by benchmarks/loader.py): one file per image
with the float view, stored sparsely, and zlib-compressed 64x64 tiles (:mod:`.entry`).
Raw arrays take the image's full uint8 size on disk, many times a PNG of mostly dark
pixels, and were not faster to read (opening a memory map costs more than decoding the
few tiles ten patches touch); the tiles take about the PNG's size. Where the entries
live and when one may be used: :mod:`.store`; preparing, in parallel, resumable, one
preparer at a time: :mod:`.prepare`; what ``ats train`` does (``--prepare``, the
default): :mod:`.training`; ``ats make-dataset prepare DATA`` does it ahead of training.

Results do not change: a prepared image gives bit for bit the view and patches the
source gives (tested), so a run with the same seed gives the same metrics.
"""

from ats_cli.data.prepared.entry import PreparedSource
from ats_cli.data.prepared.prepare import PrepareReport, prepare
from ats_cli.data.prepared.store import PreparedStore, store_folder
from ats_cli.data.prepared.training import prepare_for_run

__all__ = ["PrepareReport", "PreparedSource", "PreparedStore", "prepare", "prepare_for_run",
           "store_folder"]
