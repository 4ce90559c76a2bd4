#!/usr/bin/env bash
# IPS's four Megapixel MNIST tasks at the paper spec on one GPU, in one device call (<= 600 s).
#
#   EPOCHS=40 TASKS="max top multilabel" BUDGET_S=520 bash benchmarks/gpu_ips.sh    # on the GPU machine
#
# The same datasets and flags as benchmarks/ips_tasks.sh (5,000 + 1,000 val + 1,000 images of 1500x1500,
# reference noise, seed 0, the bundled digits; image labels only; each task with the defaults: max and
# top get their pooling and patches from their dataset.json hints),
# but the tasks train at the same time on the one GPU (a run keeps the device ~busy only a few
# percent of the time: benchmarks/gpu.md "On a GPU"), each with the auto loader workers.
# Every run is time-boxed so that the call returns within BUDGET_S; a run cut short keeps
# its per-epoch figures (marked "cut" in the summary: its cosine schedule did not end).
# Results in $OUT/gpu_ips (default ./out): summary.md, each run's metrics.jsonl and log.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
RES=$OUT/gpu_ips
WORK=${WORK:-/tmp/ats_gpu_ips}
EPOCHS=${EPOCHS:-40}
TASKS=${TASKS:-max top multilabel}
BUDGET_S=${BUDGET_S:-520}
# shellcheck source=benchmarks/gpu_env.sh
source benchmarks/gpu_env.sh   # PY, ATS, DEVICE, MAKE_FLAGS
mkdir -p "$RES" "$WORK"
T0=$(date +%s)
left() { echo $(( BUDGET_S - ($(date +%s) - T0) )); }

describe_env "$RES/env.txt" "epochs: $EPOCHS; tasks: $TASKS; budget: $BUDGET_S s"

# shellcheck disable=SC2086  # MAKE_FLAGS holds several words on purpose
# The datasets, in parallel (a task's images are the same; only the labels differ).
for task in $TASKS; do
  "${ATS[@]}" make-dataset megapixel-mnist "$WORK/data-$task" --task "$task" --offline $MAKE_FLAGS \
    > "$RES/make-$task.log" 2>&1 &
done
wait
echo "datasets: $(( $(date +%s) - T0 )) s"

# The runs, at the same time, each boxed to what is left of the budget.
for task in $TASKS; do
  train_boxed "$task" "$(left)" "$WORK/data-$task" --epochs "$EPOCHS" &
done
wait_sampling "$RES/nvidia-smi.txt"

"$PY" - "$RES" "$EPOCHS" $TASKS > "$RES/summary.md" <<'PY'
import json, pathlib, sys
res, epochs, tasks = pathlib.Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
print("| task | epochs run | best | last | per-epoch test figure | training log's last line |")
print("|---|---:|---:|---:|---|---|")
for task in tasks:
    path = res / f"metrics-{task}.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    key = "test_macro_f1" if task == "multilabel" else "test_acc"
    vals = [r[key] for r in rows if key in r]
    fmt = (lambda v: f"{v:.3f}") if task == "multilabel" else (lambda v: f"{100 * v:.1f}%")
    log = (res / f"train-{task}.log").read_text().strip().splitlines()
    cut = "" if len(vals) == epochs else " (cut)"
    extra = ""
    if task == "multilabel" and rows:
        best = max(rows, key=lambda r: r.get(key, 0))
        extra = f", exact match {100 * best.get('test_acc', 0):.1f}% at the best"
    print(f"| {task} | {len(vals)}{cut} | {fmt(max(vals)) if vals else '-'}{extra} | "
          f"{fmt(vals[-1]) if vals else '-'} | {', '.join(fmt(v) for v in vals)} | {log[-1] if log else ''} |")
PY
cat "$RES/summary.md"
echo "total: $(( $(date +%s) - T0 )) s"
