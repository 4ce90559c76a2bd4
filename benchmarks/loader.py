"""The loader's cost per sample, from source files and from prepared ones (issue 39).

    PYTHONPATH=. python benchmarks/loader.py DATA [--images 32] [--repeats 3] [--epoch] [--json out.json]

DATA: an ats dataset of ordinary images (e.g. ``ats make-dataset megapixel-mnist DATA
--n-train 320 --n-test 64``: the paper spec, 1500x1500, scale 0.12, ten 50x50 patches).

Loader (one process, one thread: samples/s per CPU core): for the first ``--images``
training images, what one sample costs, split into read / view / patches, for

- ``source``: today's path without preparing: decode the PNG (read), resize it (view),
  cut ten patches from the decoded image (patches);
- ``tiles``: the prepared layout of :mod:`ats_cli.data.prepared`: stat the source and
  read the entry's header (read), the stored view (view), the ten patches from their
  zlib tiles (patches); and the same with the view inflated from zlib instead (``tiles,
  zlib view``), the first choice, for what that costs;
- ``raw``: the alternative measured against it: the decoded image as an uncompressed
  ``.npy`` memory-mapped at read time, and the view as another ``.npy``;

and the whole sample as the training loader makes it (``ImageDataset[i]``, then the
patches read from the source it hands over), with the disk each layout takes against
the source files. The patches are checked equal in every layout, and the views too.

``--epoch``: a whole training epoch, ``ats train DATA --epochs 1 --workers 2 --seed 0``,
with ``--no-prepare`` and then after ``ats make-dataset prepare`` (timed apart: a
once-per-dataset cost), wall time of each command and their metrics.jsonl, which must
agree. Prepared entries go to a temporary ``ATS_PREPARED`` folder, so DATA is left as it was.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np
import torch

from ats_cli.config import TrainConfig
from ats_cli.core.source import TensorSource
from ats_cli.data.dataset import load_dataset
from ats_cli.data.images import read_image
from ats_cli.data.inputs import ImageDataset, low_res_view
from ats_cli.data.prepared import PreparedStore, _sparse, entry_source, entry_view, file_stamp, prepare, read_entry

ROOT = Path(__file__).resolve().parents[1]


def _du(paths) -> int:
    return sum(os.path.getsize(p) for p in paths)


def raw_patches(image: np.ndarray, offsets: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """Patches [n, C, h, w] of a (memory-mapped) uint8 [C, H, W] array, zeros outside."""
    C, H, W = image.shape
    h, w = size
    out = np.zeros((len(offsets), C, h, w), np.uint8)
    for k, (r0, c0) in enumerate(offsets.tolist()):
        y0, y1, x0, x1 = max(r0, 0), min(r0 + h, H), max(c0, 0), min(c0 + w, W)
        if y0 < y1 and x0 < x1:
            out[k, :, y0 - r0:y1 - r0, x0 - c0:x1 - c0] = image[:, y0:y1, x0:x1]
    return out


def bench_loader(data, args, folder: Path) -> dict:
    cfg = TrainConfig(scale=args.scale, n_patches=args.patches, patch_size=args.patch_size)
    cfg.from_data(data.hints)
    channels, scale, ps, n = int(data.hints.get("channels", 1)), cfg.scale, cfg.patch_size, cfg.n_patches
    records = data["train"][:args.images]
    paths = [r.path for r in records]
    rng = np.random.default_rng(0)
    offsets = {}
    for p in paths:
        H, W = read_image(p, channels).shape[1:]
        offsets[p] = torch.from_numpy(rng.integers(0, [H - ps + 1, W - ps + 1], size=(n, 2)))

    # preparing: the tiles (ats_cli.data.prepared) and the raw alternative
    store = PreparedStore(folder / "tiles", data.root, channels=channels, scale=scale)
    t = time.perf_counter()
    report = prepare(store, paths, log=lambda s: None)
    tiles_prepare_s = time.perf_counter() - t
    assert report.prepared == len(paths), report.line()
    (folder / "raw").mkdir()
    raw = {}
    for i, p in enumerate(paths):
        image = read_image(p, channels)
        np.save(folder / "raw" / f"{i}.npy", image.numpy())
        np.save(folder / "raw" / f"{i}.view.npy", low_res_view(image, scale).numpy())
        raw[p] = (folder / "raw" / f"{i}.npy", folder / "raw" / f"{i}.view.npy")

    def source_sample(p):
        t0 = time.perf_counter()
        image = read_image(p, channels)
        t1 = time.perf_counter()
        low = low_res_view(image, scale)
        t2 = time.perf_counter()
        patches = TensorSource(image).read_patches(offsets[p], (ps, ps))
        return (t1 - t0, t2 - t1, time.perf_counter() - t2), low, patches

    def tiles_sample(p):
        t0 = time.perf_counter()
        entry = store.entry_path(p)
        stamp = file_stamp(p)
        header, fd, st = read_entry(entry)
        assert store._matches(header, stamp)
        t1 = time.perf_counter()
        low = entry_view(entry, header, fd)
        os.close(fd)
        t2 = time.perf_counter()
        patches = entry_source(entry, header, st).read_patches(offsets[p], (ps, ps))
        return (t1 - t0, t2 - t1, time.perf_counter() - t2), low, patches

    reference = {p: source_sample(p)[1:] for p in paths}
    zlib_views = {p: zlib.compress(reference[p][0].numpy().tobytes(), 1) for p in paths}

    def tiles_zlib_view_sample(p):  # the tiles, with the view inflated from zlib instead of its bit mask
        times, low, patches = tiles_sample(p)
        t0 = time.perf_counter()
        view = torch.from_numpy(np.frombuffer(zlib.decompress(zlib_views[p]), np.float32).reshape(low.shape).copy())
        return (times[0], time.perf_counter() - t0, times[2]), view, patches

    def raw_sample(p):
        t0 = time.perf_counter()
        image = np.load(raw[p][0], mmap_mode="r")
        t1 = time.perf_counter()
        low = torch.from_numpy(np.load(raw[p][1]))
        t2 = time.perf_counter()
        patches = torch.from_numpy(raw_patches(image, offsets[p].numpy(), (ps, ps)))
        return (t1 - t0, t2 - t1, time.perf_counter() - t2), low, patches

    plain_set = ImageDataset(records, channels=channels, scale=scale, patch_size=(ps, ps))
    fast_set = ImageDataset(records, channels=channels, scale=scale, patch_size=(ps, ps), prepared=store)

    def whole(dataset):
        def sample(p):
            i = paths.index(p)
            t0 = time.perf_counter()
            low, source, *_ = dataset[i]
            patches = source.read_patches(offsets[p], (ps, ps))
            return (time.perf_counter() - t0, 0.0, 0.0), low, patches
        return sample

    layouts = {"source": source_sample, "tiles": tiles_sample, "tiles, zlib view": tiles_zlib_view_sample,
               "raw": raw_sample,
               "ImageDataset, source": whole(plain_set), "ImageDataset, tiles": whole(fast_set)}
    rows = {}
    for name, fn in layouts.items():
        runs = []
        for _ in range(args.repeats):
            parts = np.zeros(3)
            for p in paths:
                times, low, patches = fn(p)
                parts += times
                assert torch.equal(low, reference[p][0]) and torch.equal(patches, reference[p][1]), (name, p)
            runs.append(parts / len(paths))
        best = min(runs, key=lambda r: r.sum())  # the least disturbed repeat on a shared machine
        rows[name] = {"read_ms": 1e3 * best[0], "view_ms": 1e3 * best[1], "patches_ms": 1e3 * best[2],
                      "total_ms": 1e3 * best.sum(), "samples_per_s": 1 / best.sum(),
                      "median_total_ms": 1e3 * statistics.median(r.sum() for r in runs)}
    src_bytes = _du(paths)
    disk = {"source_bytes": src_bytes,
            "tiles_bytes": _du(store.entry_path(p) for p in paths),
            "raw_bytes": _du(f for p in paths for f in raw[p])}
    # the same entries with the zlib view in place of the bit-mask one
    disk["tiles_zlib_view_bytes"] = disk["tiles_bytes"] + sum(
        len(zlib_views[p]) - len(_sparse(reference[p][0].numpy())) for p in paths)
    disk["tiles_zlib_view_ratio"] = disk["tiles_zlib_view_bytes"] / src_bytes
    disk["tiles_ratio"] = disk["tiles_bytes"] / src_bytes
    disk["raw_ratio"] = disk["raw_bytes"] / src_bytes
    return {"images": len(paths), "channels": channels, "scale": scale, "patch_size": ps, "n_patches": n,
            "tiles_prepare_ms_per_image_1_process": 1e3 * tiles_prepare_s / len(paths), "rows": rows, "disk": disk}


def _train(data: Path, out: Path, flag: str, env: dict, workers: int) -> tuple[float, list[dict]]:
    cmd = [sys.executable, "-m", "ats_cli", "train", str(data), "--out", str(out), "--epochs", "1", "--workers",
           str(workers), "--seed", "0", flag]
    t = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t
    return wall, [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def bench_epoch(data_dir: Path, folder: Path, workers: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ATS_PREPARED": str(folder / "epoch-store")}
    before_s, before = _train(data_dir, folder / "run-off", "--no-prepare", env, workers)
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "ats_cli", "make-dataset", "prepare", str(data_dir), "--workers",
                    str(workers)], env=env, check=True, stdout=subprocess.DEVNULL)
    prepare_s = time.perf_counter() - t
    after_s, after = _train(data_dir, folder / "run-auto", "--prepare", env, workers)
    keys = ("train_loss", "train_acc", "test_loss", "test_acc", "entropy")
    same = [[r[k] for k in keys] for r in before] == [[r[k] for k in keys] for r in after]
    return {"workers": workers, "before_wall_s": before_s, "prepare_wall_s": prepare_s, "after_wall_s": after_s,
            "speedup": before_s / after_s, "same_metrics": same,
            "before": {k: before[-1][k] for k in keys + ("samples_per_s",)},
            "after": {k: after[-1][k] for k in keys + ("samples_per_s",)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("data", type=Path)
    ap.add_argument("--images", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--scale", type=float, default=0.0)
    ap.add_argument("--patches", type=int, default=0)
    ap.add_argument("--patch-size", type=int, default=0)
    ap.add_argument("--epoch", action="store_true", help="also time a whole training epoch before/after")
    ap.add_argument("--workers", type=int, default=2, help="--workers of the epoch's ats train")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    data = load_dataset(args.data)
    with tempfile.TemporaryDirectory(prefix="ats-loader-") as tmp:
        folder = Path(tmp)
        result = {"device": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
                  "load_before": os.getloadavg(), "loader": bench_loader(data, args, folder)}
        if args.epoch:
            result["epoch"] = bench_epoch(data.root, folder, args.workers)
        result["load_after"] = os.getloadavg()
        shutil.rmtree(folder / "raw", ignore_errors=True)
    loader = result["loader"]
    print(f"loader, one thread, {loader['images']} images, channels {loader['channels']}, scale {loader['scale']}, "
          f"{loader['n_patches']} patches of {loader['patch_size']}:")
    print(f"{'layout':24s} {'read ms':>8s} {'view ms':>8s} {'patches':>8s} {'total ms':>9s} {'samples/s':>10s}")
    for name, r in loader["rows"].items():
        print(f"{name:24s} {r['read_ms']:8.3f} {r['view_ms']:8.3f} {r['patches_ms']:8.3f} {r['total_ms']:9.3f} "
              f"{r['samples_per_s']:10.0f}")
    d = loader["disk"]
    print(f"disk: sources {d['source_bytes'] / 2**20:.2f} MiB, tiles {d['tiles_ratio']:.2f}x "
          f"({d['tiles_zlib_view_ratio']:.2f}x with the zlib view), "
          f"raw {d['raw_ratio']:.1f}x;"
          f" preparing {loader['tiles_prepare_ms_per_image_1_process']:.1f} ms/image (one process)")
    if "epoch" in result:
        e = result["epoch"]
        print(f"epoch, --workers {e['workers']}: {e['before_wall_s']:.1f} s unprepared, {e['after_wall_s']:.1f} s "
              f"prepared ({e['speedup']:.2f}x; preparing {e['prepare_wall_s']:.1f} s once); same metrics: "
              f"{e['same_metrics']}")
    print(f"load average before {result['load_before'][0]:.2f}, after {result['load_after'][0]:.2f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
