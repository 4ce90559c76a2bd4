"""Where a CPU training epoch's time goes: ``ats train`` run in this process with a timer
around each part of the loop.

    PYTHONPATH=. python benchmarks/epoch_parts.py DATA [--epochs 2] [--workers 0] [--json out.json]

The parts: the training steps' forward pass (the model and its loss), backward pass,
optimizer step (and the rest of the step: learning rate, seeding, the metrics' sums) and
the wait for the loader's next batch; the batch-norm recalibration (its loader included),
the evaluation (its loader included), the checkpoints and the curves figure. Each is
timed on the wall clock by wrapping the function that does it, so nothing runs
differently; the figures are of the last epoch (the first one also pays for one-time
imports and warm-up). ``other`` is what the epoch spent outside every timed part.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch

import ats_cli.train as train_module
from ats_cli.config import TrainConfig
from ats_cli.core.model import ATSModel

PARTS = ("step: forward + loss", "step: backward", "step: optimizer", "step: loader wait", "step: rest",
         "batch-norm recalibration", "evaluation", "checkpoints", "curves figure", "other")


class Clock:
    """Wall time per part, exclusive: a part nested in another is taken out of it. The
    step's parts count only inside the training steps; the model's forward pass inside
    the recalibration or the evaluation stays theirs."""

    def __init__(self):
        self.spent: dict[str, float] = defaultdict(float)
        self.stack: list[list] = []  # [name, start, time spent in nested parts]

    @contextmanager
    def part(self, name: str):
        if name.startswith("step:") and (not self.stack or self.stack[-1][0] != "training steps"):
            yield  # a forward pass of the recalibration, say: its enclosing part's
            return
        self.stack.append([name, time.perf_counter(), 0.0])
        try:
            yield
        finally:
            _, start, nested = self.stack.pop()
            took = time.perf_counter() - start
            self.spent[name] += took - nested
            if self.stack:
                self.stack[-1][2] += took

    def wrap(self, owner, attr: str, name: str) -> None:
        fn = getattr(owner, attr)

        def timed(*a, **k):
            with self.part(name):
                return fn(*a, **k)

        setattr(owner, attr, timed)


def instrument(clock: Clock) -> None:
    clock.wrap(train_module, "recalibrate_batch_norm", "batch-norm recalibration")
    clock.wrap(train_module, "evaluate", "evaluation")
    clock.wrap(train_module, "save_checkpoint", "checkpoints")
    clock.wrap(train_module, "_plot_curves", "curves figure")
    forward, loss = ATSModel.forward, ATSModel.loss

    def timed_forward(self, *a, **k):
        with clock.part("step: forward + loss"):
            return forward(self, *a, **k)

    def timed_loss(self, *a, **k):
        with clock.part("step: forward + loss"):
            return loss(self, *a, **k)

    ATSModel.forward, ATSModel.loss = timed_forward, timed_loss
    backward = torch.Tensor.backward

    def timed_backward(self, *a, **k):
        with clock.part("step: backward"):
            return backward(self, *a, **k)

    torch.Tensor.backward = timed_backward
    readable = train_module.readable

    def timed_readable(loader):
        it = iter(readable(loader))
        while True:
            with clock.part("step: loader wait"):
                try:
                    batch = next(it)
                except StopIteration:
                    return
            yield batch

    train_module.readable = timed_readable
    one_epoch = train_module.train_one_epoch

    def timed_epoch(cfg, ctx, device, net, opt, *a, **k):
        step = opt.step

        def timed_step(*sa, **sk):
            with clock.part("step: optimizer"):
                return step(*sa, **sk)

        opt.step = timed_step
        with clock.part("training steps"):
            return one_epoch(cfg, ctx, device, net, opt, *a, **k)

    train_module.train_one_epoch = timed_epoch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data", type=Path)
    ap.add_argument("--out", type=Path, required=True, help="the run directory (a new one)")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    clock = Clock()
    instrument(clock)
    marks, snapshots = [], []

    def log(line: str) -> None:
        if line.startswith("epoch "):
            marks.append(time.perf_counter())
            snapshots.append(dict(clock.spent))

    cfg = TrainConfig(data=str(args.data), out=str(args.out), epochs=args.epochs, workers=args.workers, seed=0)
    start = time.perf_counter()
    train_module.train(cfg, log=log)
    if len(marks) < 2:
        raise SystemExit("need --epochs >= 2: the last epoch is timed between two epochs' ends")
    before, after = snapshots[-2], snapshots[-1]
    spent = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in set(after) | set(before)}
    total = marks[-1] - marks[-2]
    table = {p: spent.get(p, 0.0) for p in PARTS}
    table["step: rest"] = spent.get("training steps", 0.0)
    table["other"] = total - sum(table.values())
    print(f"last epoch: {total:.2f} s (run {marks[-1] - start:.1f} s)\n| part | s | share |\n|---|---:|---:|")
    for part, s in table.items():
        print(f"| {part} | {s:.2f} | {100 * s / total:.0f}% |")
    if args.json:
        args.json.write_text(json.dumps({"epoch_s": total, "parts_s": table}, indent=1) + "\n")


if __name__ == "__main__":
    main()
