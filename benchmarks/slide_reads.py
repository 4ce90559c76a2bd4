"""Benchmark: a slide's patches read one at a time vs batched and concurrent (issue 39).

Writes an N x N RGB pyramidal tiled TIFF (JPEG tiles, as scanners write them; white glass
and one textured "tissue" ellipse) with tifffile, and with ``vips`` when it is installed
(``vips tiffsave --tile --pyramid``), then times reading n patches of P x P at level 0
drawn around a few centres (as the attention draws them: neighbours share tiles):

* ``one by one``: ``read_region`` for each patch in turn, each decoding the tiles it
  overlaps (how ``read_patches`` read before);
* ``batched + pooled``: ``read_patches`` -- the patches in tile order, each tile they
  overlap decoded once, concurrently on the reading threads (``READ_THREADS``).

Both give identical pixels (checked here, and in tests/test_slide_reads.py). The two are
interleaved (A B A B ...) and the median of ``--repeats`` is reported, so that a loaded
machine slows both alike.

Usage: python benchmarks/slide_reads.py [--size 20000] [--patches 10 100] [--patch 256]
Prints a Markdown table; copy it into benchmarks/slides.md with the machine and `uptime`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import tifffile
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's ats_cli, not an installed one

from ats_cli.core.source import READ_THREADS  # noqa: E402
from ats_cli.data.slides import open_image  # noqa: E402

TILE = 256


def tissue_tile(r: int, c: int, size: int, rng: np.random.Generator) -> np.ndarray:
    yy, xx = np.mgrid[r:r + TILE, c:c + TILE]
    inside = ((yy - size / 2) / (0.4 * size)) ** 2 + ((xx - size / 2) / (0.4 * size)) ** 2 < 1
    noise = rng.integers(-40, 41, (TILE, TILE, 3), dtype=np.int16)
    return np.clip(np.where(inside[..., None], np.array([190, 110, 170]) + noise, 244), 0, 255).astype(np.uint8)


def write_tifffile(path: Path, size: int) -> None:
    """Level 0 tile by tile from a generator (never whole in memory), then 4x smaller levels."""
    rng = np.random.default_rng(0)
    sizes = [size]
    while sizes[-1] > 4 * TILE:
        sizes.append(sizes[-1] // 4)
    with tifffile.TiffWriter(path, bigtiff=True) as tw:
        for k, s in enumerate(sizes):
            tiles = (tissue_tile(r, c, s, rng) for r in range(0, s, TILE) for c in range(0, s, TILE))
            tw.write(tiles, shape=(s, s, 3), dtype=np.uint8, tile=(TILE, TILE), photometric="rgb",
                     compression="jpeg", compressionargs={"level": 90}, subfiletype=1 if k else 0,
                     metadata=None)  # no shaped description: vips would copy it, and tifffile then reads
                                     # all of vips's levels as one shaped series (refused)


def write_vips(source: Path, path: Path) -> bool:
    """The same pixels re-saved by libvips as a tiled JPEG pyramid (its own writer)."""
    vips = shutil.which("vips")
    if vips is None:
        return False
    subprocess.run([vips, "tiffsave", str(source), str(path), "--tile", "--pyramid", "--compression", "jpeg",
                    "--Q", "90", "--tile-width", str(TILE), "--tile-height", str(TILE), "--bigtiff"], check=True)
    return True


def draw(n: int, size: int, patch: int, seed: int) -> torch.Tensor:
    """n top-left corners around 4 centres inside the tissue (the attention's bunches)."""
    g = torch.Generator().manual_seed(seed)
    centres = (torch.rand(4, 2, generator=g) * 0.5 + 0.25) * size
    pick = torch.randint(0, 4, (n,), generator=g)
    return (centres[pick] + torch.randn(n, 2, generator=g) * 2 * patch).long().clamp(0, size - patch)


def one_by_one(reader, offs: torch.Tensor, patch: int) -> torch.Tensor:
    return torch.from_numpy(np.stack([reader.read_region(r, c, patch, patch, 0) for r, c in offs.tolist()])
                            .transpose(0, 3, 1, 2).copy())


def bench(path: Path, counts: list[int], patch: int, repeats: int) -> list[dict]:
    rows = []
    with open_image(path, reader="tifffile") as reader:
        size = reader.size[0]
        reader.read_patches(draw(4, size, patch, 99), (patch, patch))  # start the threads, warm the file cache
        for n in counts:
            times = {"one by one": [], "batched + pooled": []}
            for rep in range(repeats):
                offs = draw(n, size, patch, rep)
                t0 = time.perf_counter()
                a = one_by_one(reader, offs, patch)
                t1 = time.perf_counter()
                b = reader.read_patches(offs, (patch, patch))
                t2 = time.perf_counter()
                if not torch.equal(a, b):
                    raise AssertionError(f"{path.name}: pooled patches differ from one-by-one reads")
                times["one by one"].append(t1 - t0)
                times["batched + pooled"].append(t2 - t1)
            seq, pooled = (statistics.median(times[k]) for k in ("one by one", "batched + pooled"))
            rows.append({"file": path.name, "n": n, "seq_ms": 1e3 * seq, "pooled_ms": 1e3 * pooled,
                         "speedup": seq / pooled})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=20000, help="level-0 side in pixels")
    ap.add_argument("--patches", type=int, nargs="+", default=[10, 100])
    ap.add_argument("--patch", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", type=Path, default=None, help="folder for the TIFFs (default: a temporary one)")
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="ats-slide-reads-"))
    out.mkdir(parents=True, exist_ok=True)
    files = [out / f"tifffile_{args.size}.tif"]
    if not files[0].exists():
        write_tifffile(files[0], args.size)
    vips_file = out / f"vips_{args.size}.tif"
    if vips_file.exists() or write_vips(files[0], vips_file):
        files.append(vips_file)
    else:
        print("vips not installed: tifffile's pyramid only (apt-get install libvips-tools)")
    print(f"{os.cpu_count()} CPUs, READ_THREADS={READ_THREADS}, torch threads {torch.get_num_threads()}, "
          f"{args.size}x{args.size} RGB, {TILE}x{TILE} JPEG tiles, patches {args.patch}x{args.patch}, "
          f"median of {args.repeats}")
    print("| file | patches | one by one ms | batched + pooled ms | speed-up |")
    print("|---|---:|---:|---:|---:|")
    for f in files:
        for row in bench(f, args.patches, args.patch, args.repeats):
            print(f"| {row['file']} | {row['n']} | {row['seq_ms']:.1f} | {row['pooled_ms']:.1f} | "
                  f"{row['speedup']:.2f}x |")


if __name__ == "__main__":
    main()
