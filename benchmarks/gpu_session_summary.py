"""The summary of a benchmarks/gpu_session.sh run: summary.md (tables for benchmarks/gpu.md,
the issue-39 targets checked), benchmark.json and train.json, from the files the session left.

    python benchmarks/gpu_session_summary.py RESULTS_DIR WORK_DIR

RESULTS_DIR holds env.txt, pytest.txt, patch_extraction.json (each only if its step ran);
WORK_DIR holds steps.tsv, `ats benchmark`'s rows per batch size (benchmark_bN.json, merged
into RESULTS_DIR/benchmark.json), the loader's figures (loader.json, copied into train.json),
the training runs (run_NAME/), their start/end times (start_NAME, end_NAME) and nvidia-smi's
samples (util_NAME.csv: timestamp, utilization.gpu %, memory.used MiB, two a second).
"""

from __future__ import annotations

import csv
import json
import sys
from datetime import datetime
from pathlib import Path

ENV_KEYS = ("commit", "source hash", "python ", "device 0", "date", "host", "| NVIDIA-SMI", "nvcc", "Cuda compilation",
            "Build cuda")


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def steps_table(work: Path) -> list[str]:
    lines = ["Steps (rc 124/137 = timed out):", "", "| step | rc | s | command |", "|---|---|---:|---|"]
    path = work / "steps.tsv"
    if path.exists():
        for row in list(csv.reader(path.open(), delimiter="\t"))[1:]:
            if len(row) >= 4:
                command = row[3].replace("|", "\\|")  # a pipe inside a table cell
                lines.append(f"| {row[0]} | {row[1]} | {row[2]} | `{command}` |")
    return lines


def patches_section(path: Path) -> list[str]:
    d = json.loads(path.read_text())
    m = d["meta"]
    out = ["", "## Patch extraction (`benchmarks/patch_extraction.py`)", "",
           f"{m.get('device', 'cpu')}, torch {m['torch']}, copy bandwidth "
           f"{fmt(m.get('copy_bw_gb_per_s'), '.0f')} GB/s (1 GiB device-to-device, read + write), pinned "
           f"host -> device {fmt(m.get('h2d_pinned_gb_per_s'), '.1f')} GB/s; median of {m['repeats']}"
           f"{' [SMALL sizes: a dry run, not figures]' if m['small'] else ''}", "",
           "| device | case | torch ms | native ms | native / torch | native GB/s | % of copy bw | large |",
           "|---|---|---:|---:|---:|---:|---:|---|"]
    rows: dict[tuple[str, str], dict[str, dict]] = {}
    for r in d["rows"]:
        rows.setdefault((r["device"], r["case"]), {})[r["path"]] = r
    for (dev, case), paths in rows.items():
        t, k = paths.get("torch"), paths.get("native")
        if k is None:
            out.append(f"| {dev} | {case} | {t['ms']:.3f} | - | - | - | - | - |")
            continue
        share = k.get("share_of_copy_bw")
        out.append(f"| {dev} | {case} | {t['ms']:.3f} | {k['ms']:.3f} | {t['ms'] / k['ms']:.2f}x | "
                   f"{k['gb_per_s']:.1f} | {'-' if share is None else f'{100 * share:.0f}%'} | "
                   f"{'yes' if k['large'] else 'no'} |")
    out += ["", f"targets (native never slower than torch; >= 50% of copy bw on the large cases): "
                f"{json.dumps(d.get('targets'))}"]
    if d.get("h2d"):
        stages = list(d["h2d"][0]["stages_ms"])
        out += ["", "Host -> device, ms per batch of uint8 patches (image on the host):", "",
                "| case | MiB | " + " | ".join(stages) + " |", "|---|---:|" + "---:|" * len(stages)]
        for h in d["h2d"]:
            out.append(f"| {h['case']} | {h['bytes'] / 2**20:.1f} | "
                       + " | ".join(f"{h['stages_ms'][s]:.3f}" for s in stages) + " |")
    return out


def benchmark_section(path: Path) -> list[str]:
    rows = json.loads(path.read_text())
    if not rows:
        return ["", "## `ats benchmark`: no rows"]
    out = []
    for batch in sorted({r.get("batch_size", 1) for r in rows}):
        out += benchmark_rows([r for r in rows if r.get("batch_size", 1) == batch], batch)
    return out


def benchmark_rows(rows: list[dict], batch: int) -> list[str]:
    ok = [r for r in rows if r.get("time_ms_per_sample") is not None]
    ref = next((r for r in ok if r["method"] == "ats" and r["n_patches"] == 10), None)
    size = rows[0]["image_size"]
    out = ["", f"## `ats benchmark` ({rows[0]['device']}, {size[0]}x{size[1]}, batch {batch}, forward + backward, "
               "per sample)", "",
           "| method | time (ms) | peak mem (MB) | time / ATS-10 | mem / ATS-10 |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        name = r["method"] + (f"-{r['n_patches']}" if r["n_patches"] else "")
        if r.get("time_ms_per_sample") is None:
            out.append(f"| {name} | failed: {str(r.get('error', ''))[:80]} | | | |")
            continue
        rt = f"{r['time_ms_per_sample'] / ref['time_ms_per_sample']:.2f}x" if ref else "-"
        rm = f"{r['peak_mem_mb_per_sample'] / max(ref['peak_mem_mb_per_sample'], 1e-9):.2f}x" if ref else "-"
        out.append(f"| {name} | {r['time_ms_per_sample']:.2f} | {r['peak_mem_mb_per_sample']:.1f} | {rt} | {rm} |")
    mil = next((r for r in ok if r["method"] == "deepmil"), None)
    if ref and mil:
        ft = mil["time_ms_per_sample"] / ref["time_ms_per_sample"]
        fm = mil["peak_mem_mb_per_sample"] / max(ref["peak_mem_mb_per_sample"], 1e-9)
        out += ["", f"ATS-10 against Deep MIL at batch {batch}: {ft:.1f}x faster (target >= 50x: {ft >= 50}), "
                    f"{fm:.1f}x less peak memory (target >= 30x: {fm >= 30})"]
    return out


def loader_section(data: dict) -> list[str]:
    loader = data["loader"]
    out = ["", f"## Loader (`benchmarks/loader.py`, {data.get('device', '?')}, one thread, {loader['images']} images, "
               f"{loader['n_patches']} patches of {loader['patch_size']}, best repeat)", "",
           "| layout | read ms | view ms | patches ms | ms / sample | samples/s per core |",
           "|---|---:|---:|---:|---:|---:|"]
    for name, r in loader["rows"].items():
        out.append(f"| {name} | {r['read_ms']:.3f} | {r['view_ms']:.3f} | {r['patches_ms']:.3f} | "
                   f"{r['total_ms']:.3f} | {r['samples_per_s']:,.0f} |")
    best = loader["rows"].get("ImageDataset, tiles", {}).get("samples_per_s")
    if best is not None:
        out += ["", f"prepared layout through ImageDataset: {best:,.0f} samples/s per core (target >= 2,000: "
                    f"{best >= 2000})"]
    return out


def _rows(path: Path) -> list[dict]:
    try:
        return json.loads(path.read_text())
    except ValueError:
        return []


def read_util(path: Path) -> list[tuple[float, float, float]]:
    """nvidia-smi's samples as (unix time, utilization %, memory MiB); unreadable lines are skipped."""
    samples = []
    for row in csv.reader(path.open()):
        try:
            when = datetime.strptime(row[0].strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()  # local time, as date
            samples.append((when, float(row[1]), float(row[2])))
        except (ValueError, IndexError):
            continue
    return samples


def mtime(path: Path) -> float | None:
    return path.stat().st_mtime if path.exists() else None


def train_runs(work: Path) -> dict[str, dict]:
    runs = {}
    for start in sorted(work.glob("start_*"), key=lambda path: float(path.read_text())):  # in run order
        name = start.name[len("start_"):]
        run, end = work / f"run_{name}", work / f"end_{name}"
        metrics_file = run / "metrics.jsonl"
        metrics = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()] \
            if metrics_file.exists() else []
        t0 = float(start.read_text())
        entry: dict = {"wall_s": (float(end.read_text()) - t0) if end.exists() else None, "epochs": metrics}
        util = work / f"util_{name}.csv"
        if util.exists():
            samples = read_util(util)
            # epoch 2's window: epoch 1's checkpoint to epoch 2's (its steps and its evaluation)
            w0, w1 = mtime(run / "epochs" / "epoch_001.pt"), mtime(run / "epochs" / "epoch_002.pt")
            window = [s[1] for s in samples if w0 is not None and w1 is not None and w0 <= s[0] <= w1]
            entry["gpu_util"] = {
                "samples": len(samples),
                "mean_whole_run": sum(s[1] for s in samples) / len(samples) if samples else None,
                "epoch2_samples": len(window),
                "mean_epoch2": sum(window) / len(window) if window else None,
                "max": max((s[1] for s in samples), default=None),
                "max_memory_used_mib": max((s[2] for s in samples), default=None),
            }
        runs[name] = entry
    return runs


def train_section(runs: dict[str, dict]) -> list[str]:
    out = ["", "## `ats train` (prepared layout, default recipe, 2 epochs, flags in the steps table; epoch 2's "
               "figures: epoch 1 includes the start-up)", "",
           "| run | epoch 2 samples/s | ms / sample | peak mem (MB) | GPU util, epoch 2 (mean %) | "
           "GPU util, whole run (mean %) | wall s |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name, e in runs.items():
        last = e["epochs"][-1] if e["epochs"] else {}
        u = e.get("gpu_util") or {}
        out.append(f"| {name} | {fmt(last.get('samples_per_s'), '.1f')} | {fmt(last.get('ms_per_sample'), '.2f')} | "
                   f"{fmt(last.get('peak_mem_mb'), '.0f')} | {fmt(u.get('mean_epoch2'), '.0f')} | "
                   f"{fmt(u.get('mean_whole_run'), '.0f')} | {fmt(e['wall_s'], '.0f')} |")
    best = max(runs.items(), key=lambda kv: (kv[1]["epochs"][-1].get("samples_per_s", 0) if kv[1]["epochs"] else 0))
    last = best[1]["epochs"][-1] if best[1]["epochs"] else {}
    util = (best[1].get("gpu_util") or {}).get("mean_epoch2")
    if last:
        out += ["", f"fastest run {best[0]}: {last['samples_per_s']:,.0f} samples/s (target >= 3,000: "
                    f"{last['samples_per_s'] >= 3000}), GPU busy {fmt(util, '.0f')}% (target >= 60%: "
                    f"{util is not None and util >= 60})"]
    return out


def main(res: Path, work: Path) -> str:
    out = ["# Issue 39 GPU session: summary", ""]
    env = res / "env.txt"
    if env.exists():
        keep = [line for line in env.read_text().splitlines() if line.lstrip().startswith(ENV_KEYS)]
        out += ["```", *keep, "```", ""]
        if "device 0: none" in env.read_text():
            out += ["**No CUDA device: a dry run (SMALL sizes, on the CPU), not figures; the targets below "
                    "do not apply.**", ""]
    out += steps_table(work)
    pytest_out = res / "pytest.txt"
    if pytest_out.exists():
        lines = [line for line in pytest_out.read_text().splitlines() if line.strip()]
        out += ["", f"**pytest tests/test_native.py tests/test_host_sync.py**: `{lines[-1] if lines else 'no output'}`"]
    benches = [row for path in sorted(work.glob("benchmark_b*.json")) for row in _rows(path)]
    if benches:
        (res / "benchmark.json").write_text(json.dumps(benches, indent=2) + "\n")
    sections = [(res / "patch_extraction.json", patches_section), (res / "benchmark.json", benchmark_section)]
    for path, section in sections:
        if path.exists():
            try:
                out += section(path)
            except (ValueError, KeyError, TypeError) as e:  # a partial file: say so, keep the rest
                out += ["", f"{path.name}: unreadable ({type(e).__name__}: {e})"]
    loader = None
    if (work / "loader.json").exists():
        try:
            loader = json.loads((work / "loader.json").read_text())
            out += loader_section(loader)
        except (ValueError, KeyError, TypeError) as e:
            out += ["", f"loader.json: unreadable ({type(e).__name__}: {e})"]
    runs = train_runs(work)
    if runs or loader:
        (res / "train.json").write_text(json.dumps({"runs": runs, "loader": loader}, indent=1) + "\n")
    if runs:
        out += train_section(runs)
    text = "\n".join(out) + "\n"
    (res / "summary.md").write_text(text)
    return text


if __name__ == "__main__":
    print(main(Path(sys.argv[1]), Path(sys.argv[2])))
