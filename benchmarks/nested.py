"""Benchmark: step time and peak RSS of two-level (nested) vs one-level models across slide sizes.

For each slide (pyramidal TIFFs written here at ``--sizes``, as benchmarks/slides.py writes
them; any other slide file given with ``--slides``, e.g. a virtual slide spec once the
reader opens them), and for each model (random weights; only the cost is measured):

* **train step**: a fresh process opens the slide (its view and tissue mask) and runs
  ``--steps`` training steps on it (forward, loss, backward, Adam step; batch of 1), and
  reports the median step time, wall and CPU (the first step excluded), and its own peak
  RSS;
* **predict**: ``python -m ats_cli predict SLIDE -m MODEL`` in a fresh process, cold: its
  wall and CPU time and peak RSS (start-up included, as a user sees it).

Models: ``two-level`` (``--levels 2``: regions of ``--region`` pixels, k = ``--regions``,
``--n`` patches per region, region views at ``--fine-scale``) and ``one-level`` at
``--scale`` (its view grows with the slide: that is the comparison).

Usage: OMP_NUM_THREADS=1 python benchmarks/nested.py --sizes 10000 25000 --out /tmp/nestedbench
Prints a Markdown table; copy it into benchmarks/slides.md with `uptime` and the commit.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from slides import ROOT, measure, write_slide  # noqa: E402  (benchmarks/slides.py: one writer, one timer)

PATCH = 64


def make_models(out: Path, a: argparse.Namespace) -> dict[str, Path]:
    from ats_cli.checkpoint import save_checkpoint
    from ats_cli.config import TrainConfig
    from ats_cli.models import create_model, model_spec

    common = dict(patch_size=PATCH, feature_width=32, attention_width=8, eval_n_patches=0, tissue_mask="on",
                  patch_gain="off", rarity_prior=0.0, min_brightness=0.0)
    configs = {
        "two-level": TrainConfig(**common, levels=2, regions=a.regions, region_size=a.region, n_patches=a.n,
                                 scale=a.fine_scale, coarse_px=a.coarse_px),
        "one-level": TrainConfig(**common, n_patches=a.regions * a.n, scale=a.scale),
    }
    paths = {}
    for name, cfg in configs.items():
        torch.manual_seed(0)
        spec = model_spec(cfg.validate(), n_classes=2, channels=3)
        paths[name] = out / f"{name}.pt"
        save_checkpoint(paths[name], spec=spec, classes=["a", "b"], model=create_model(spec))
    return paths


def train_steps(slide: str, model: str, steps: int) -> None:
    """(child process) open ``slide``, run ``steps`` training steps, print JSON."""
    from ats_cli.checkpoint import load_model
    from ats_cli.data.inputs import open_input

    net, _ = load_model(model)
    net.train()
    opt = torch.optim.Adam(net.parameters(), lr=1e-4)
    t = time.perf_counter()
    opened = open_input(slide, channels=3, scale=net.scale, patch_size=net.patch_size, tissue=True)
    open_s = time.perf_counter() - t
    low = opened.low[None]
    mask = None if opened.support is None else opened.support[None]
    gen = torch.Generator().manual_seed(0)
    times, cpu = [], []
    for _ in range(steps):
        t, c = time.perf_counter(), time.process_time()
        out = net(low, [opened.source], generator=gen, support_mask=mask)
        loss = net.loss(out, torch.tensor([0]))
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"open_s": open_s, "step_s": statistics.median(times[1:] or times),
                      "step_cpu_s": statistics.median(cpu[1:] or cpu), "rss_mb": rss,
                      "view": list(low.shape[-2:])}))


def run_train(slide: Path, model: Path, steps: int) -> dict:
    r = subprocess.run([sys.executable, __file__, "--child", str(slide), str(model), str(steps)], capture_output=True,
                       text=True, cwd=ROOT)
    if r.returncode:
        return {"error": (r.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        train_steps(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="*", default=[10_000, 25_000])
    ap.add_argument("--slides", type=Path, nargs="*", default=[], help="other slide files (e.g. virtual slides)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/nestedbench"))
    ap.add_argument("--region", type=int, default=4096)
    ap.add_argument("--regions", type=int, default=4)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--fine-scale", type=float, default=1 / 32)
    ap.add_argument("--coarse-px", type=int, default=4, help="the two-level model's coarse pixels per region side")
    ap.add_argument("--scale", type=float, default=1 / 32, help="the one-level model's view scale")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--models", nargs="+", default=["two-level", "one-level"])
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    models = make_models(a.out, a)
    slides = []
    for n in a.sizes:
        path = a.out / f"slide_{n}.tif"
        if not path.exists():
            write_slide(path, n)
        slides.append(path)
    slides += a.slides
    print(f"two-level: regions of {a.region} px, k = {a.regions}, n = {a.n} per region, region views at "
          f"{a.fine_scale:g}, coarse view {a.coarse_px} px per region; one-level: {a.regions * a.n} patches, "
          f"view at {a.scale:g}")
    print("| slide | model | view (h, w) | train step wall s | train step CPU s | train peak RSS MB | predict wall s "
          "| predict CPU s | predict peak RSS MB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for slide in slides:
        for name in a.models:
            tr = run_train(slide, models[name], a.steps)
            try:
                wall, rss, used = measure(["-m", "ats_cli", "predict", str(slide), "-m", str(models[name]),
                                           "--device", "cpu"], cpu=True)
                pred = f"{wall:.2f} | {used:.2f} | {rss:,.0f}"
            except subprocess.CalledProcessError:
                pred = "failed | - | -"
            train = (f"{tr['view'][0]}x{tr['view'][1]} | {tr['step_s']:.3f} | {tr['step_cpu_s']:.3f} | "
                     f"{tr['rss_mb']:,.0f}" if "error" not in tr else f"- | failed: {tr['error'][:80]} | - | -")
            print(f"| {slide.name} | {name} | {train} | {pred} |", flush=True)


if __name__ == "__main__":
    main()
