"""Test error against training wall time, per method, on one Megapixel MNIST dataset
(thesis Figure 3.2 and Tables 3.1/3.2, on this machine).

Each method is trained with `ats_cli.train.train` one epoch at a time (exact resumption
makes that identical to one run) until its wall-time budget is spent or ``--max-epochs``
is reached; after each epoch the test error and the cumulative *training* time (the
epochs' step time, evaluation excluded, as in the thesis's figure) are recorded.

    ats make-dataset megapixel-mnist /tmp/mm_small --preset small
    python benchmarks/accuracy.py /tmp/mm_small --out benchmarks/accuracy_small \\
        --methods ats,uniform,cnn --budget-s 300

Writes OUT/results.json, OUT/accuracy_vs_time.png and OUT/table.md (and one run
directory per method, OUT/runs/METHOD, usable with `ats predict` / `ats visualize`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ats_cli.recipes import resolve_config
from ats_cli.train import train

LABELS = {"ats": "ATS-10", "uniform": "U-10", "deepmil": "Deep MIL", "cnn": "CNN (ResNet-18, low-res)"}


def run_method(method: str, args: argparse.Namespace) -> dict:
    run = Path(args.out) / "runs" / method
    points, history = [], []
    for epoch in range(1, args.max_epochs + 1):
        cfg = resolve_config(None, data=str(args.data), out=str(run), method=method, epochs=epoch,
                             batch_size=args.batch_size, feature_net=args.feature_net, lr=args.lr,
                             workers=args.workers, seed=args.seed, n_patches=10, device=args.device,
                             min_brightness=args.min_brightness, feature_scale=args.feature_scale,
                             feature_width=args.feature_width)
        history = train(cfg, resume=epoch > 1, log=lambda s, m=method: print(f"[{m}] {s}", flush=True))
        train_s = sum(h["samples"] / h["samples_per_s"] for h in history)
        points.append({"epoch": epoch, "train_time_s": train_s, "test_error": 1 - history[-1]["test_acc"]})
        if train_s >= args.budget_s:
            break
    last = history[-1]
    return {"method": method, "points": points, "epochs": len(points),
            "best_test_error": min(p["test_error"] for p in points), "final_test_error": points[-1]["test_error"],
            "ms_per_sample": sum(h["ms_per_sample"] for h in history) / len(history),
            "peak_mem_mb": max(h["peak_mem_mb"] for h in history), "device": last["device"]}


def plot(results: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        xs = [0.0] + [p["train_time_s"] / 60 for p in r["points"]]
        ys = [0.9] + [p["test_error"] for p in r["points"]]  # 10 balanced classes: chance is 0.9 error
        ax.plot(xs, ys, "o-", label=LABELS.get(r["method"], r["method"]))
    ax.axhline(0.9, color="grey", lw=0.8, ls=":", label="chance")
    ax.set(xlabel="training wall time (min)", ylabel="test error", ylim=(0, 1), title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(results: list[dict]) -> str:
    lines = ["| method | epochs | train time (min) | best test error | final test error | ms / sample (train) "
             "| peak mem (MB) |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {LABELS.get(r['method'], r['method'])} | {r['epochs']} | "
                     f"{r['points'][-1]['train_time_s'] / 60:.1f} | {r['best_test_error']:.3f} | "
                     f"{r['final_test_error']:.3f} | {r['ms_per_sample']:.1f} | {r['peak_mem_mb']:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--methods", default="ats,uniform,deepmil,cnn")
    p.add_argument("--budget-s", type=float, default=300, help="training seconds per method (checked per epoch)")
    p.add_argument("--max-epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--feature-net", default="mnist-features-bn")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--feature-width", type=int, default=32)
    p.add_argument("--feature-scale", type=float, default=1.0, help="see the ats train key feature_scale")
    p.add_argument("--min-brightness", type=float, default=0.05,
                   help="ATS and U-N sample only non-black low-res cells: without it ATS stays on its initial "
                   "plateau for longer than a CPU budget allows (ats_cli.core.model.ATSModel)")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for method in [m.strip() for m in args.methods.split(",") if m.strip()]:
        results.append(run_method(method, args))
        (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")  # partial results survive
        plot(results, args.out / "accuracy_vs_time.png", f"Megapixel MNIST ({args.data.name}), {results[0]['device']}")
        (args.out / "table.md").write_text(table(results))
    print(table(results))


if __name__ == "__main__":
    main()
