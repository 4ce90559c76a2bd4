"""A training step with a frozen pretrained encoder against the same step with it trainable.

    OMP_NUM_THREADS=2 PYTHONPATH=. python benchmarks/frozen_encoder.py [--repeats 2] [--steps 2]
        [--net timm:resnet18] [--device cpu] [--json OUT.json]

The model is what ``ats train --feature-net timm:resnet18`` builds (randomly initialised:
nothing is downloaded; weights do not change the cost), 16 patches of 64x64 px per image
resized on the device to the encoder's 224 px input, batch 8 of 512x512 RGB images; the
step is ats train's (forward, loss, backward, Adam step), with ``--feature-train none`` or
``all``. Each measurement runs in a fresh process, frozen and trainable alternating
(A B A B...), so that both see the same machine load.

Peak memory: on CPU, tracemalloc sees none of torch's allocations, so it is the growth of
the process's resident set over its size before the first step (``ru_maxrss`` after the
step minus the RSS before it: the gradients, Adam's state and the activations kept for
backward, whatever the allocator returned or not). On CUDA, ``torch.cuda.max_memory_allocated``
over the same step. Time: the median of ``--steps`` steps after the first.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def child(mode: str, net: str, steps: int, device_name: str) -> dict:
    import torch

    from ats_cli.core.source import low_res_view
    from ats_cli.models import create_model, model_spec
    from ats_cli.nets.encoders import apply_feature_train
    from ats_cli.recipes import resolve_config
    from ats_cli.train import _optimizer, train_mode

    device = torch.device(device_name)
    torch.manual_seed(0)
    cfg = resolve_config(None, data="-", out="-", feature_net=net, feature_weights="none", feature_train=mode,
                         n_patches=16, patch_size=64, scale=0.125, batch_size=8, entropy=0.01, eval_n_patches=0)
    spec = model_spec(cfg, n_classes=2, channels=3)
    model = create_model(spec).to(device)
    apply_feature_train(model.feature_net, mode)
    opt = _optimizer(cfg, model)
    train_mode(model)
    images = torch.randint(0, 256, (8, 3, 512, 512), dtype=torch.uint8, device=device)
    low = low_res_view(images, cfg.scale)
    labels = torch.tensor([0, 1] * 4, device=device)
    gen = torch.Generator(device=device)

    def step(i: int) -> float:
        gen.manual_seed(i)
        t = time.perf_counter()
        out = model(low, images, generator=gen)
        loss = model.loss(out, labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t

    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated() / 2**20
        torch.cuda.reset_peak_memory_stats()
    else:
        before = _rss_mb()
        assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 < before + 64, "building peaked above"
    first = step(0)
    peak = (torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024) - before
    times = [step(i) for i in range(1, steps + 1)]
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"mode": mode, "peak_mb": peak, "step_s": statistics.median(times), "first_step_s": first,
            "trainable_params": trainable, "optimizer_states": len(opt.state), "threads": torch.get_num_threads()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--net", default="timm:resnet18")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.net, a.steps, a.device)))
        return
    rows = []
    for r in range(a.repeats):
        for mode in ("none", "all"):  # A B A B: the same load for both
            out = subprocess.run([sys.executable, __file__, "--child", mode, "--net", a.net, "--steps", str(a.steps),
                                  "--device", a.device], capture_output=True, text=True, check=True)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(f"repeat {r + 1} {mode:4s}: peak +{row['peak_mb']:.0f} MB, step {row['step_s']:.2f} s "
                  f"(first {row['first_step_s']:.2f} s), {row['trainable_params']:,} trainable parameters, "
                  f"{row['optimizer_states']} optimizer states", flush=True)

    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in rows if r["mode"] == mode)

    mem, time_ = med("none", "peak_mb") / med("all", "peak_mb"), med("none", "step_s") / med("all", "step_s")
    print(f"frozen / trainable: peak memory {mem:.2f}x, step time {time_:.2f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"net": a.net, "device": a.device, "rows": rows, "memory_ratio": mem, "time_ratio": time_}, f,
                      indent=1)


if __name__ == "__main__":
    main()
