"""Benchmark: `ats predict` on large pyramidal TIFFs vs dense tiling with the same feature net.

Writes an N x N RGB pyramidal tiled TIFF per size (white glass, one elliptical pink
"tissue" region covering ~40% of the area, noise texture), then for each size:

* runs ``python -m ats_cli predict SLIDE -m MODEL`` in a fresh process and records its
  wall time and peak RSS (``resource.getrusage(RUSAGE_CHILDREN)``, i.e. the whole process
  including Python and torch start-up);
* dense tiling baseline: reads every tissue tile (patch-size tiles whose low-res cell is
  tissue) at level 0 through the same reader and runs the same feature network on all of
  them, in batches, as tiling tools do. Timed in this process.

With ``--url``: the same ``ats predict`` on the slide read from a URL, served from
127.0.0.1 by this process (tests/httpserve.py: byte ranges, ETag), against the local
file: wall times, and the bytes the server sent against the file's size (no dense
baseline). ``--slide jpeg`` writes the URL tests' pyramid instead (256² JPEG tiles, about a
third of it tissue: tests/test_urls.py), whose tiles are the size of a scanner's.
``--url --omezarr``: the same for an OME-Zarr copy of each slide with the same pixels
(NGFF 0.5, one chunk per TIFF tile, zstd: tests/test_omezarr_urls.py), beside the TIFF's
rows, and the store's local wall time against the TIFF's.

Usage: python benchmarks/slides.py --sizes 10000 20000 --out /tmp/slidebench
       python benchmarks/slides.py --url --slide jpeg --sizes 20000 100000
       python benchmarks/slides.py --url --omezarr --slide jpeg --sizes 100000 \
           --model models/synthetic-slides-100k-ats.pt
Prints a Markdown table row per size; copy it into benchmarks/slides.md with `uptime`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import tifffile
import torch

TILE = 512
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's ats_cli, not an installed one


def write_slide(path: Path, n: int, seed: int = 0) -> None:
    """Pyramid levels as separate IFDs (subfiletype=1), written tile by tile from a
    generator so that writing never holds more than one tile row in memory."""
    rng = np.random.default_rng(seed)
    noise = rng.integers(-25, 26, (TILE, TILE, 3), dtype=np.int16)

    def tiles(size: int):
        for r in range(0, size, TILE):
            for c in range(0, size, TILE):
                yy, xx = np.mgrid[r : r + TILE, c : c + TILE]
                inside = ((yy - size / 2) / (0.36 * size)) ** 2 + ((xx - size / 2) / (0.36 * size)) ** 2 < 1
                t = np.where(inside[..., None], np.array([200, 100, 170]) + noise, 245)
                yield np.clip(t, 0, 255).astype(np.uint8)

    sizes = [n]
    while sizes[-1] > 2 * TILE:
        sizes.append(sizes[-1] // 4)
    with tifffile.TiffWriter(path, bigtiff=True) as tw:
        for k, s in enumerate(sizes):
            tw.write(tiles(s), shape=(s, s, 3), dtype=np.uint8, tile=(TILE, TILE), photometric="rgb",
                     compression="zlib", compressionargs={"level": 1}, subfiletype=1 if k else 0)


def make_model(path: Path) -> None:
    from ats_cli.checkpoint import save_checkpoint
    from ats_cli.config import TrainConfig
    from ats_cli.models import create_model, model_spec

    torch.manual_seed(0)
    # eval_n_patches=0: predict draws the 20 patches the figures in benchmarks/slides.md name
    cfg = TrainConfig(patch_size=64, scale=0.01, n_patches=20, eval_n_patches=0, feature_width=32)
    spec = model_spec(cfg, n_classes=2, channels=3)
    save_checkpoint(path, spec=spec, classes=["a", "b"], model=create_model(spec))


def measure(args: list[str], *, cpu: bool = False) -> tuple[float, ...]:
    """Wall time and peak RSS (MB) of ``python ARGS`` run in a fresh grandchild process, so
    that RUSAGE_CHILDREN sees that process alone; with ``cpu``, also its CPU time (user +
    system, s), which a loaded machine inflates less than the wall time."""
    code = (
        "import resource, subprocess, sys, time;"
        "t=time.perf_counter();"
        f"r=subprocess.run([sys.executable,*{args!r}],capture_output=True,text=True);"
        "dt=time.perf_counter()-t;"
        "assert r.returncode==0, r.stdout+r.stderr;"
        "u=resource.getrusage(resource.RUSAGE_CHILDREN);"
        "print(dt, u.ru_maxrss/1024, u.ru_utime+u.ru_stime)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT).stdout.split()
    return (float(out[0]), float(out[1]), float(out[2])) if cpu else (float(out[0]), float(out[1]))


def run_baseline() -> tuple[float, float]:
    """A process that only imports torch and the CLI: the floor under every `ats predict`
    figure, whatever the slide."""
    return measure(["-c", "import torch, ats_cli.cli, ats_cli.predict"])


def run_predict(slide: Path | str, model: Path) -> tuple[float, float]:
    return measure(["-m", "ats_cli", "predict", str(slide), "-m", str(model), "--device", "cpu"])


def dense(slide: Path, model: Path, batch: int = 256) -> tuple[float, int]:
    from ats_cli.checkpoint import load_model
    from ats_cli.data.slides import open_image, tissue_mask

    net, _ = load_model(model, torch.device("cpu"))
    ph, pw = net.patch_size
    t = time.perf_counter()
    with open_image(slide) as s, torch.no_grad():
        H, W = s.size
        gh, gw = H // ph, W // pw
        mask = tissue_mask(s.low_res_view(gh / H))[:gh, :gw]
        cells = torch.nonzero(mask)
        for i in range(0, len(cells), batch):
            offs = cells[i : i + batch] * torch.tensor([ph, pw])
            x = s.read_patches(offs, (ph, pw)).float() / 255
            net.feature_net(x)
    return time.perf_counter() - t, len(cells)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000])
    ap.add_argument("--out", type=Path, default=Path("/tmp/slidebench"))
    ap.add_argument("--no-dense", action="store_true")
    ap.add_argument("--batch", type=int, default=0,
                    help="also time `ats predict DIR` over N hard links to each slide: the per-slide cost once "
                         "the process has started ((wall_N - wall_1) / (N - 1))")
    ap.add_argument("--url", action="store_true",
                    help="also predict each slide from a URL served on 127.0.0.1: wall time and bytes fetched")
    ap.add_argument("--omezarr", action="store_true",
                    help="with --url: also write each slide as an OME-Zarr store with the same pixels and predict it "
                         "from its path and from a URL")
    ap.add_argument("--slide", choices=("zlib", "jpeg"), default="zlib",
                    help="zlib: 512² noise tiles (write_slide); jpeg: the URL tests' pyramid of 256² JPEG tiles")
    ap.add_argument("--model", type=Path, default=None,
                    help="predict with this model (e.g. models/synthetic-slides-100k-ats.pt, two levels) instead of "
                         "the untrained one-level one")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    model = a.model or a.out / "model.pt"
    if a.model is None:
        make_model(model)
    if a.url:
        return url_table(a, model)
    base_t, base_rss = run_baseline()
    print(f"start-up floor (import torch + ats_cli, no slide): {base_t:.2f} s, {base_rss:,.0f} MB peak RSS")
    print("| size | file MB | write s | ats predict wall s | peak RSS MB | dense tiles | dense s | dense / ats |"
          + (f" per slide in a batch of {a.batch} (s) | batch peak RSS MB |" if a.batch > 1 else ""))
    print("|---|---|---|---|---|---|---|---|" + ("---|---|" if a.batch > 1 else ""))
    for n in a.sizes:
        slide, wt = slide_for(a, n)
        wall, rss = run_predict(slide, model)
        d, tiles = (float("nan"), 0) if a.no_dense else dense(slide, model)
        mb = slide.stat().st_size / 2**20
        extra = ""
        if a.batch > 1:
            folder = a.out / f"batch_{n}"
            folder.mkdir(exist_ok=True)
            for i in range(a.batch):  # hard links: N inputs, no extra disk
                link = folder / f"s{i:03d}.tif"
                if not link.exists():
                    os.link(slide, link)
            wall_b, rss_b = run_predict(folder, model)
            extra = f" {(wall_b - wall) / (a.batch - 1):.2f} | {rss_b:,.0f} |"
        print(f"| {n:,} | {mb:,.0f} | {wt:.0f} | {wall:.2f} | {rss:,.0f} | {tiles:,} | {d:.1f} | {d / wall:.0f}x |"
              + extra, flush=True)


def slide_for(a, n: int) -> tuple[Path, float]:
    """The benchmark's slide of side ``n`` (written unless it exists) and the seconds writing took."""
    slide = a.out / (f"slide_{n}.tif" if a.slide == "zlib" else f"jpeg_{n}.tif")
    t = time.perf_counter()
    if not slide.exists():
        if a.slide == "zlib":
            write_slide(slide, n)
        else:
            from tests.test_urls import write_pyramid

            write_pyramid(slide, n)
    return slide, time.perf_counter() - t


def _bytes(path: Path) -> int:
    """A file's size, or a store's: the sum of its files'."""
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def url_table(a, model: Path) -> None:
    """``ats predict`` of each slide from its local path and from a URL on 127.0.0.1, each in a
    fresh process (cold: nothing cached), with the bytes the server sent for the URL; with
    ``--omezarr``, the same for the slide's OME-Zarr copy (the same pixels, one chunk per tile)."""
    from tests.httpserve import serve

    print("| format | size | MB on disk | write s | local predict s | URL predict s | URL / local | fetched MB "
          "| fetched / file | requests |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n in a.sizes:
        slide, wt = slide_for(a, n)
        inputs = [("TIFF", slide, wt)]
        if a.omezarr:
            store = slide.with_suffix(".ome.zarr")
            t = time.perf_counter()
            if not store.exists():
                from tests.test_omezarr_urls import write_omezarr_copy

                write_omezarr_copy(slide, store)
            inputs.append(("OME-Zarr", store, time.perf_counter() - t))
        walls = {}
        for kind, path, wt in inputs:
            local, _ = run_predict(path, model)
            walls[kind] = local
            with serve(path.parent) as server:
                remote, _ = run_predict(server.url(path.name), model)  # type: ignore[arg-type]
                sent = sum(v for k, v in server.sent.items() if k == path.name or k.startswith(path.name + "/"))
                requests = server.requests
            size = _bytes(path)
            print(f"| {kind} | {n:,} | {size / 2**20:,.1f} | {wt:.0f} | {local:.2f} | {remote:.2f} | "
                  f"{remote / local:.2f}x | {sent / 2**20:.2f} | {100 * sent / size:.2f}% | {requests} |", flush=True)
        if a.omezarr:
            print(f"OME-Zarr local / TIFF local: {walls['OME-Zarr'] / walls['TIFF']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
