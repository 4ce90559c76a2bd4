"""Patch extraction: the torch gather vs the native kernels in csrc/ (issue 6).

    python benchmarks/patch_extraction.py [--repeats 7] [--json out.json] [--quick]

For each case (batch of images, patches per image, patch size, dtype, layout) it times
every available path on every available device and prints patches/s and effective GB/s
(bytes read + bytes written = 2 x the patch bytes). On CUDA it also measures the
device's copy bandwidth (a 1 GiB device-to-device copy, read + write) and reports the
kernel's share of it: the issue's target is >= 50%.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from ats_cli.core import native
from ats_cli.core.patches import extract_patches_torch

# (name, B, C, H, W, n patches, patch side, dtype, channels_last)
CASES = [
    ("mnist 1500^2 u8, 10x50^2", 32, 1, 1500, 1500, 10, 50, torch.uint8, False),
    ("mnist 1500^2 u8, 100x50^2", 32, 1, 1500, 1500, 100, 50, torch.uint8, False),
    ("rgb 4096^2 u8 NCHW, 10x256^2", 8, 3, 4096, 4096, 10, 256, torch.uint8, False),
    ("rgb 4096^2 u8 NHWC, 100x256^2", 8, 3, 4096, 4096, 100, 256, torch.uint8, True),
    ("rgb 2048^2 f32 NCHW, 50x128^2", 4, 3, 2048, 2048, 50, 128, torch.float32, False),
    ("rgb 2048^2 bf16 NHWC, 100x64^2", 4, 3, 2048, 2048, 100, 64, torch.bfloat16, True),
]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int) -> float:
    fn()  # warm-up (and lazy build)
    sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(device: torch.device) -> float:
    """GB/s of a 1 GiB device-to-device copy (read + write), the practical ceiling."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = timed(lambda: dst.copy_(src), device, 10)
    return 2 * src.numel() / t / 1e9


def run_case(case, device: torch.device, name: str, module, ceiling: float | None, repeats: int) -> list[dict]:
    label, B, C, H, W, n, p, dtype, cl = case
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 255, (B, C, H, W), generator=g, dtype=torch.uint8).to(device=device, dtype=dtype)
    if cl:
        images = images.contiguous(memory_format=torch.channels_last)
    offsets = torch.randint(-p // 2, max(H, W) - p // 2, (B, n, 2), generator=g).to(device)
    paths = {"torch": lambda: extract_patches_torch(images, offsets, (p, p))}
    if module is not None:
        paths["native"] = lambda: module.extract(images, offsets, p, p)
    rows = []
    for path, fn in paths.items():
        t = timed(fn, device, repeats)
        gbs = 2 * B * n * C * p * p * images.element_size() / t / 1e9
        rows.append({"case": label, "device": name, "path": path, "ms": t * 1e3, "patches_per_s": B * n / t,
                     "gb_per_s": gbs, "share_of_copy_bw": gbs / ceiling if ceiling else None})
        share = f", {100 * gbs / ceiling:.0f}% of copy bw" if ceiling else ""
        print(f"{name:>10} | {label:<32} | {path:<6} | {t * 1e3:8.2f} ms | {B * n / t:>12,.0f} patches/s"
              f" | {gbs:6.2f} GB/s{share}")
    if len(rows) == 2:
        print(f"{'':>10} | {'':<32} | native is {rows[0]['ms'] / rows[1]['ms']:.2f}x the torch path")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="the first two cases only")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    rows = []
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.2f}")
    for device in devices:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        ceiling = copy_bandwidth(device) if device.type == "cuda" else None
        if ceiling:
            print(f"{name}: device copy bandwidth {ceiling:.0f} GB/s")
        try:
            module = native.build(cuda=device.type == "cuda")
        except Exception as exc:  # noqa: BLE001 - report and time the torch path alone
            print(f"{name}: native kernel unavailable ({type(exc).__name__}: {exc})")
            module = None
        for case in CASES[:2] if args.quick else CASES:
            rows += run_case(case, device, name, module, ceiling, args.repeats)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
