"""Benchmark: virtual slides (``.vslide.json``) cost what is read, not the slide's size.

For each side N (default 25k, 100k, 200k) a spec of the synthetic-slides task is written
(the same seed, 1 nest and 7 decoys) and, each in a fresh process (so that the peak RSS
is that step's, Python and numpy included):

* ``open + thumbnail + patches``: open the spec, read the 1024-pixel thumbnail (from
  the level within 2x of it) and ``--patches`` random 256x256 patches at level 0
  (``read_patches``, as the model reads them); time of each and the peak RSS;
* ``view 1/32``: the low-res view a one-level model at scale 1/32 needs (the released
  synthetic-slides model's): it grows with N², the nested model's reason to exist.

Then a cold ``ats predict`` (a fresh process: Python, torch and the model loaded, the slide
opened, its view made, the attention net run over it, patches read) of each spec with the
released one-level model (``models/synthetic-slides-ats.pt``, scale 1/32), and of a real
pyramidal TIFF of side ``--tiff`` written from a virtual slide (:func:`write_virtual_tiff`,
lossless).

Usage: python benchmarks/virtual_slides.py --out /tmp/vbench
Prints Markdown rows for benchmarks/slides.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's ats_cli, not an installed one

CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
import numpy as np, torch
from ats_cli.data.slides import open_image
t1 = time.perf_counter()
path, what, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
out = {"import_s": t1 - t0}
rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t = time.perf_counter(); slide = open_image(path); out["open_s"] = time.perf_counter() - t
if what == "patches":
    t = time.perf_counter(); thumb = slide.thumbnail(1024); out["thumb_s"] = time.perf_counter() - t
    H, W = slide.dimensions
    rng = np.random.default_rng(0)
    offsets = torch.from_numpy(np.stack([rng.integers(0, H - 256, n), rng.integers(0, W - 256, n)], 1))
    t = time.perf_counter(); p = slide.read_patches(offsets, (256, 256)); out["patches_s"] = time.perf_counter() - t
    assert p.shape == (n, 3, 256, 256)
else:
    t = time.perf_counter(); view = slide.low_res_view(1 / 32); out["view_s"] = time.perf_counter() - t
    out["view"] = list(view.shape[1:])
out["rss_after_imports_mb"] = rss0 / 1024
out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps(out))
"""


def child(path: Path, what: str, n: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-c", CHILD, str(path), what, str(n)], capture_output=True, text=True,
                         env=env, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def cold_predict(path: Path, model: Path) -> tuple[float, float, str]:
    """Wall time and peak RSS of ``ats predict PATH`` in a fresh process (a wrapper that
    reports its child's RUSAGE_CHILDREN: only that command's peak)."""
    wrapper = ("import resource, subprocess, sys, time; t = time.perf_counter(); "
               "r = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
               "print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024); "
               "print(r.stdout[-2000:] + r.stderr[-2000:], file=sys.stderr); sys.exit(r.returncode)")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-c", wrapper, sys.executable, "-m", "ats_cli", "predict", str(path),
                          "--model", str(model)], capture_output=True, text=True, env=env)
    if res.returncode:
        raise SystemExit(f"ats predict {path} failed:\n{res.stderr}")
    seconds, rss = (float(v) for v in res.stdout.split())
    line = next((ln for ln in res.stderr.splitlines() if path.name in ln), "")
    return seconds, rss, line.strip()


def main() -> None:
    from ats_cli.data.virtual_slides import VirtualSlideSpec, default_downsamples, write_spec, write_virtual_tiff

    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[25_000, 100_000, 200_000])
    ap.add_argument("--patches", type=int, default=64)
    ap.add_argument("--tiff", type=int, default=8192, help="side of the real TIFF for the cold predict (0: none)")
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "synthetic-slides-ats.pt")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    def spec(n: int) -> Path:
        path = args.out / f"s{n}.vslide.json"
        write_spec(path, VirtualSlideSpec(width=n, height=n, seed=20261126, nests=1, decoys=7,
                                          downsamples=tuple(default_downsamples(n, n))))
        return path

    print(f"| side | open (s) | thumbnail 1024 (s) | {args.patches} patches 256² (s) | peak RSS (MB; after imports) | "
          "view 1/32 | view (s) | peak RSS with view (MB) |")
    print("|---|---:|---:|---:|---:|---|---:|---:|")
    for n in args.sizes:
        path = spec(n)
        a, b = child(path, "patches", args.patches), child(path, "view", 0)
        rss = f"{a['peak_rss_mb']:.0f} ({a['rss_after_imports_mb']:.0f})"
        print(f"| {n:,}² | {a['open_s']:.3f} | {a['thumb_s']:.2f} | {a['patches_s']:.2f} | {rss} | "
              f"{b['view'][1]:,}x{b['view'][0]:,} | {b['view_s']:.1f} | {b['peak_rss_mb']:.0f} |", flush=True)
    print("\n| side | cold `ats predict`, one-level model at 1/32 (s) | peak RSS (MB) | output |")
    print("|---|---:|---:|---|")
    for n in args.sizes:
        seconds, rss, line = cold_predict(spec(n), args.model)
        print(f"| {n:,}² | {seconds:.1f} | {rss:.0f} | {' '.join(line.split())} |", flush=True)
    if args.tiff:
        small = spec(args.tiff)
        tif = args.out / f"s{args.tiff}.tif"
        t = time.perf_counter()
        write_virtual_tiff(small, tif)
        written = time.perf_counter() - t
        seconds, rss, line = cold_predict(tif, args.model)
        print(f"cold `ats predict` {tif.name} (a real {args.tiff:,}² pyramidal TIFF, "
              f"{tif.stat().st_size / 1e6:.0f} MB, written in {written:.0f} s): {seconds:.1f} s, "
              f"peak RSS {rss:.0f} MB; {line}")


if __name__ == "__main__":
    main()
