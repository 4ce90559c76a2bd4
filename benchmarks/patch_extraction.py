"""Patch extraction: the torch gather vs the native kernels in csrc/ (issues 6 and 22).

    python benchmarks/patch_extraction.py [--repeats 7] [--json out.json] [--quick]
                                          [--device auto|cpu|cuda] [--small] [--no-h2d]

For each case (batch of images, patches per image, patch size, dtype, layout) it times
every available path on every chosen device and prints patches/s and effective GB/s
(bytes read + bytes written = 2 x the patch bytes). On CUDA it also measures the
device's copy bandwidth in the same run (a 1 GiB device-to-device copy, read + write)
and reports each path's share of it, timed with CUDA events; then the issue-22 targets:
the CUDA kernel at >= 50% of the copy bandwidth on the large cases (>= 256 MiB moved)
and never slower than the torch gather. Cases marked GPU-only (32 RGB 4096^2 images) are
too slow for a CPU row and run on CUDA alone.

Host -> device (CUDA, unless --no-h2d): where the time goes when the full-resolution
image stays on the host, as in training and for slides -- the patches gathered on the
CPU one image at a time (``gather_patches`` over ``TensorSource``s, the native CPU
kernel), copied from pageable memory as the model does today, or pinned and copied
with ``non_blocking=True``, then converted to float on the device; with the pinned
host -> device bandwidth of a 256 MiB buffer as that path's ceiling. (Reading the
pixels from a slide file comes before all this: benchmarks/slides.py.)

``--small`` divides every image and patch side by 8 and 4 and caps the batch at 4:
for a dry run on a CPU (benchmarks/gpu_session.sh SMALL=1), not for figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from ats_cli.core import native
from ats_cli.core.patches import extract_patches_torch
from ats_cli.core.source import TensorSource, gather_patches

# (name, B, C, H, W, n patches, patch side, dtype, channels_last, gpu_only)
CASES = [
    ("mnist 1500^2 u8, 10x50^2", 32, 1, 1500, 1500, 10, 50, torch.uint8, False, False),
    ("mnist 1500^2 u8, 100x50^2", 32, 1, 1500, 1500, 100, 50, torch.uint8, False, False),
    ("rgb 4096^2 u8 NCHW, 10x256^2", 8, 3, 4096, 4096, 10, 256, torch.uint8, False, False),
    ("rgb 4096^2 u8 NHWC, 100x256^2", 8, 3, 4096, 4096, 100, 256, torch.uint8, True, False),
    ("rgb 2048^2 f32 NCHW, 50x128^2", 4, 3, 2048, 2048, 50, 128, torch.float32, False, False),
    ("rgb 2048^2 bf16 NHWC, 100x64^2", 4, 3, 2048, 2048, 100, 64, torch.bfloat16, True, False),
    # issue 22's batch of 32 RGB slides' regions: 1.6 GB of images, up to 629 MB of patches
    ("rgb 4096^2 u8 NCHW, 32x10x256^2", 32, 3, 4096, 4096, 10, 256, torch.uint8, False, True),
    ("rgb 4096^2 u8 NCHW, 32x100x256^2", 32, 3, 4096, 4096, 100, 256, torch.uint8, False, True),
    ("rgb 4096^2 u8 NHWC, 32x100x256^2", 32, 3, 4096, 4096, 100, 256, torch.uint8, True, True),
]
# host -> device cases: (name, B, C, H, W, n, patch side); uint8 images on the host
H2D_CASES = [
    ("mnist 1500^2, 32x10x50^2", 32, 1, 1500, 1500, 10, 50),
    ("mnist 1500^2, 32x100x50^2", 32, 1, 1500, 1500, 100, 50),
    ("rgb 4096^2, 8x10x256^2", 8, 3, 4096, 4096, 10, 256),
    ("rgb 4096^2, 8x100x256^2", 8, 3, 4096, 4096, 100, 256),
]
LARGE_BYTES = 256 * 2**20  # a case moving at least this much is "large" for the bandwidth target
TARGET_SHARE = 0.5


def shrink(case: tuple, small: bool) -> tuple:
    """--small: sides / 8, patches / 4, batch <= 4 (dry runs only)."""
    if not small:
        return case
    label, B, C, H, W, n, p, *rest = case
    return (f"{label} [small]", min(B, 4), C, max(H // 8, 8), max(W // 8, 8), n, max(p // 4, 4), *rest)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn`` after one warm-up call (which also builds the kernel):
    CUDA events on a GPU, the wall clock on a CPU."""
    fn()
    sync(device)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def wall(fn, device: torch.device, repeats: int) -> float:
    """Median wall seconds of ``fn`` including a device synchronisation (host-side stages)."""
    fn()
    sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, small: bool = False) -> float:
    """GB/s of a 1 GiB device-to-device copy (read + write), the practical ceiling."""
    src = torch.randint(0, 255, (1 << (24 if small else 30),), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = timed(lambda: dst.copy_(src), device, 10)
    return 2 * src.numel() / t / 1e9


def h2d_bandwidth(device: torch.device, small: bool = False) -> float:
    """GB/s of a 256 MiB pinned host -> device copy (bytes moved once)."""
    src = torch.randint(0, 255, (1 << (22 if small else 28),), dtype=torch.uint8).pin_memory()
    dst = torch.empty(src.shape, dtype=src.dtype, device=device)
    t = timed(lambda: dst.copy_(src, non_blocking=True), device, 10)
    return src.numel() / t / 1e9


def make_inputs(B, C, H, W, n, p, dtype, cl, device):
    """Random uint8 pixels (never zeros: they can run faster than real data) drawn on the
    device itself (1.6 GB for the largest case: seconds on a CPU generator)."""
    g = torch.Generator(device=device).manual_seed(0)
    images = torch.randint(0, 255, (B, C, H, W), generator=g, dtype=torch.uint8, device=device).to(dtype)
    if cl:
        images = images.contiguous(memory_format=torch.channels_last)
    offsets = torch.randint(-p // 2, max(H, W) - p // 2, (B, n, 2), generator=g, device=device)
    return images, offsets


def run_case(case, device: torch.device, name: str, module, ceiling: float | None, repeats: int) -> list[dict]:
    label, B, C, H, W, n, p, dtype, cl, _ = case
    images, offsets = make_inputs(B, C, H, W, n, p, dtype, cl, device)
    paths = {"torch": lambda: extract_patches_torch(images, offsets, (p, p))}
    if module is not None:
        paths["native"] = lambda: module.extract(images, offsets, p, p)
    moved = 2 * B * n * C * p * p * images.element_size()
    rows = []
    for path, fn in paths.items():
        t = timed(fn, device, repeats)
        gbs = moved / t / 1e9
        rows.append({"case": label, "device": name, "path": path, "ms": t * 1e3, "patches_per_s": B * n / t,
                     "gb_per_s": gbs, "bytes_moved": moved, "large": moved >= LARGE_BYTES,
                     "share_of_copy_bw": gbs / ceiling if ceiling else None})
        share = f", {100 * gbs / ceiling:.0f}% of copy bw" if ceiling else ""
        print(f"{name:>10} | {label:<36} | {path:<6} | {t * 1e3:8.3f} ms | {B * n / t:>12,.0f} patches/s"
              f" | {gbs:7.2f} GB/s{share}", flush=True)
    if len(rows) == 2:
        print(f"{'':>10} | {'':<36} | native is {rows[0]['ms'] / rows[1]['ms']:.2f}x the torch path", flush=True)
    return rows


def run_h2d(case, device: torch.device, repeats: int, h2d_ceiling: float) -> dict:
    """Stage times of the host path for one case (see the module docstring)."""
    label, B, C, H, W, n, p = case
    images, offsets = make_inputs(B, C, H, W, n, p, torch.uint8, False, torch.device("cpu"))
    sources = [TensorSource(img) for img in images]
    patches = gather_patches(sources, offsets, (p, p))
    pinned = patches.pin_memory()
    on_device = pinned.to(device)
    nbytes = patches.numel()
    stages = {
        "cpu gather (per image, native CPU kernel)": wall(lambda: gather_patches(sources, offsets, (p, p)),
                                                          device, repeats),
        "pageable .to(cuda) (today's path)": wall(lambda: patches.to(device), device, repeats),
        "pin_memory()": wall(lambda: patches.pin_memory(), device, repeats),
        "pinned .to(cuda, non_blocking)": wall(lambda: pinned.to(device, non_blocking=True), device, repeats),
        "uint8 -> float / 255 on the device": timed(lambda: on_device.float() / 255.0, device, repeats),
        "model path: gather + pageable copy": wall(lambda: gather_patches(sources, offsets, (p, p)).to(device),
                                                   device, repeats),
    }
    print(f"h2d | {label} | {nbytes / 2**20:.1f} MiB of uint8 patches | pinned h2d ceiling {h2d_ceiling:.1f} GB/s",
          flush=True)
    for stage, t in stages.items():
        rate = f" | {nbytes / t / 1e9:6.2f} GB/s" if "to(cuda" in stage else ""
        print(f"h2d |   {stage:<44} | {t * 1e3:8.3f} ms{rate}", flush=True)
    return {"case": label, "bytes": nbytes, "h2d_pinned_ceiling_gb_per_s": h2d_ceiling,
            "stages_ms": {k: v * 1e3 for k, v in stages.items()}}


def summary(rows: list[dict], ceiling: float | None, name: str) -> dict:
    """The issue-22 targets per case on CUDA; the speed-up table on a CPU."""
    by_case: dict[str, dict[str, dict]] = {}
    for r in rows:
        if r["device"] == name:
            by_case.setdefault(r["case"], {})[r["path"]] = r
    print(f"\nsummary ({name}" + (f", copy bandwidth {ceiling:.0f} GB/s" if ceiling else "") + "):")
    print("| case | torch ms | native ms | native / torch speed-up | native GB/s | % of copy bw | large |")
    print("|---|---:|---:|---:|---:|---:|---|")
    checks = {"never_slower_than_torch": True, "large_at_50pct_of_copy_bw": True}
    for case, paths in by_case.items():
        t, k = paths.get("torch"), paths.get("native")
        if k is None:
            print(f"| {case} | {t['ms']:.3f} | - | - | - | - | {'yes' if t['large'] else 'no'} |")
            checks = {key: None for key in checks}
            continue
        share = k["share_of_copy_bw"]
        print(f"| {case} | {t['ms']:.3f} | {k['ms']:.3f} | {t['ms'] / k['ms']:.2f}x | {k['gb_per_s']:.1f} | "
              f"{'-' if share is None else f'{100 * share:.0f}%'} | {'yes' if k['large'] else 'no'} |")
        if checks["never_slower_than_torch"] is not None:
            checks["never_slower_than_torch"] &= k["ms"] <= t["ms"]
            if k["large"] and share is not None:
                checks["large_at_50pct_of_copy_bw"] &= share >= TARGET_SHARE
    if ceiling:
        print(f"targets: native never slower than torch: {checks['never_slower_than_torch']}; "
              f"native >= {100 * TARGET_SHARE:.0f}% of copy bw on the large cases: "
              f"{checks['large_at_50pct_of_copy_bw']}")
    return checks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="the first two cases only")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="auto: the CPU, and CUDA when there is one")
    parser.add_argument("--small", action="store_true", help="shrink every case (a dry run, not figures)")
    parser.add_argument("--no-h2d", action="store_true", help="skip the host -> device breakdown")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    has_cuda = torch.cuda.is_available()
    if args.device == "cuda" and not has_cuda:
        print("skipped: no CUDA (torch.cuda.is_available() is False)")
        devices = []
    elif args.device == "cpu":
        devices = [torch.device("cpu")]
    elif args.device == "cuda":
        devices = [torch.device("cuda")]
    else:
        devices = [torch.device("cpu")] + ([torch.device("cuda")] if has_cuda else [])
    meta = {"torch": torch.__version__, "cuda": torch.version.cuda, "threads": torch.get_num_threads(),
            "load_avg": os.getloadavg()[0], "python": platform.python_version(), "small": args.small,
            "repeats": args.repeats}
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), threads {torch.get_num_threads()}, "
          f"load {os.getloadavg()[0]:.2f}", flush=True)
    rows: list[dict] = []
    h2d: list[dict] = []
    checks: dict[str, dict] = {}
    for device in devices:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        ceiling = copy_bandwidth(device, args.small) if device.type == "cuda" else None
        if ceiling:
            meta["device"], meta["copy_bw_gb_per_s"] = name, ceiling
            print(f"{name}: device copy bandwidth {ceiling:.0f} GB/s (read + write)", flush=True)
        try:
            module = native.build(cuda=device.type == "cuda")
        except Exception as exc:  # noqa: BLE001 - report and time the torch path alone
            print(f"{name}: native kernel unavailable ({type(exc).__name__}: {exc})")
            module = None
        cases = [c for c in CASES if device.type == "cuda" or not c[-1]]
        for case in cases[:2] if args.quick else cases:
            rows += run_case(shrink(case, args.small), device, name, module, ceiling, args.repeats)
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the case's tensors are gone: give the next one room
        checks[name] = summary(rows, ceiling, name)
    if has_cuda and not args.no_h2d and args.device != "cpu":
        device = torch.device("cuda")
        h2d_ceiling = h2d_bandwidth(device, args.small)
        meta["h2d_pinned_gb_per_s"] = h2d_ceiling
        print(f"\nhost -> device (pinned {h2d_ceiling:.1f} GB/s, 256 MiB buffer):", flush=True)
        for case in H2D_CASES[:2] if args.quick else H2D_CASES:
            h2d.append(run_h2d(shrink(case, args.small), device, args.repeats, h2d_ceiling))
    elif not args.no_h2d:
        print("host -> device: skipped: no CUDA")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows, "h2d": h2d, "targets": checks}, f, indent=1)


if __name__ == "__main__":
    main()
