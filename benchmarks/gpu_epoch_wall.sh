#!/usr/bin/env bash
# Where a paper-spec epoch's wall time goes on one GPU, by loader workers, in one device call.
#
#   WORKERS="0 4 -1" EPOCHS=3 bash benchmarks/gpu_epoch_wall.sh      # on the GPU machine; -1 = auto
#
# One paper-spec Megapixel MNIST set (5,000 + 1,000 images of 1500x1500, prepared by the first
# run), then `ats train --epochs EPOCHS --device cuda --workers W` for each W: each epoch's wall
# time (between its log lines; epoch 1 includes the start-up and, for the first W, preparing
# the images) beside the samples/s of its training steps that `metrics.jsonl` records; the rest
# of the wall time is the epoch's three loaders' start, batch-norm recalibration, the test pass
# and the checkpoints. Results: $OUT/gpu_epoch_wall/summary.md.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
RES=$OUT/gpu_epoch_wall
WORK=${WORK:-/tmp/ats_gpu_epoch_wall}
WORKERS=${WORKERS:-0 4 -1}
EPOCHS=${EPOCHS:-3}
# shellcheck source=benchmarks/gpu_env.sh
source benchmarks/gpu_env.sh   # PY, ATS, DEVICE, MAKE_FLAGS
mkdir -p "$RES" "$WORK"
# shellcheck disable=SC2086  # MAKE_FLAGS holds several words on purpose
"${ATS[@]}" make-dataset megapixel-mnist "$WORK/data" --task max --n-val 0 --offline $MAKE_FLAGS 2>&1 | tail -n 1
for w in $WORKERS; do
  start=$(date +%s.%N)
  "${ATS[@]}" train "$WORK/data" --out "$WORK/run-w$w" --epochs "$EPOCHS" --device "$DEVICE" --workers "$w" 2>&1 \
    | while IFS= read -r line; do echo "$(date +%s.%N) $line"; done > "$RES/train-w$w.log"
  echo "$start start" >> "$RES/train-w$w.log"
  cp "$WORK/run-w$w/metrics.jsonl" "$RES/metrics-w$w.jsonl" 2>/dev/null
done
"$PY" - "$RES" $WORKERS > "$RES/summary.md" <<'PY'
import json, pathlib, re, sys
res = pathlib.Path(sys.argv[1])
print("| --workers | epoch | wall s | training steps s (samples / samples/s) | rest s |")
print("|---|---:|---:|---:|---:|")
for w in sys.argv[2:]:
    lines = (res / f"train-w{w}.log").read_text().splitlines()
    start = float(next(l.split()[0] for l in lines if l.endswith(" start")))
    ends = [float(l.split()[0]) for l in lines if re.search(r"\bepoch \d+/\d+:", l)]
    mpath = res / f"metrics-w{w}.jsonl"
    rows = [json.loads(l) for l in mpath.read_text().splitlines()] if mpath.exists() else []
    prev = start
    for i, end in enumerate(ends):
        steps = rows[i]["samples"] / rows[i]["samples_per_s"] if i < len(rows) else float("nan")
        print(f"| {w} | {i + 1} | {end - prev:.1f} | {steps:.1f} | {end - prev - steps:.1f} |")
        prev = end
PY
cat "$RES/summary.md"
