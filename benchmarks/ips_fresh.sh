#!/usr/bin/env bash
# A trained IPS-task model on fresh Megapixel MNIST test sets: for each seed, 1,000 test images
# with their own layouts and their own noise pattern set (never seen in training, never used
# for a choice), then `ats predict` on them. Prints one line per seed (accuracy; multilabel:
# macro-F1 and exact match) and the mean. benchmarks/accuracy.md holds the figures.
#
#   MNIST=data/mnist bash benchmarks/ips_fresh.sh RUN/best.pt TASK OUT [SEEDS...]   (default seeds: 11 13 17)
#   e.g. MNIST=data/mnist bash benchmarks/ips_fresh.sh out/ips/run-max/best.pt max out/fresh 11 13 17 19 23
#
# The fresh sets are written once under OUT/TASK-SEED and reused by later calls (make-dataset
# skips the images already complete). MNIST=DIR: the full MNIST (ats make-dataset fetch-mnist DIR);
# without it the bundled digits, which are not like for like with a full-MNIST run.
set -euo pipefail
MODEL=${1:?usage: ips_fresh.sh MODEL TASK OUT [SEEDS...]}
TASK=${2:?usage: ips_fresh.sh MODEL TASK OUT [SEEDS...]}
OUT=${3:?usage: ips_fresh.sh MODEL TASK OUT [SEEDS...]}
shift 3
SEEDS=("$@")
if [ ${#SEEDS[@]} -eq 0 ]; then SEEDS=(11 13 17); fi
ATS=${ATS:-ats}
export ATS_OFFLINE=${ATS_OFFLINE:-1}
DIGITS=(--offline)
if [ -n "${MNIST:-}" ]; then DIGITS=(--mnist "$MNIST"); fi
figures=()
for seed in "${SEEDS[@]}"; do
  data="$OUT/$TASK-$seed"
  $ATS make-dataset megapixel-mnist "$data" --task "$TASK" --seed "$seed" --n-train 1 --n-val 0 --n-test 1000 \
    "${DIGITS[@]}" > "$data.log" 2>&1 || { cat "$data.log"; exit 1; }
  $ATS predict "$data/test.csv" --model "$MODEL" --out "$OUT/$TASK-$seed-predictions.csv" --overwrite \
    > "$data-predict.log" 2>&1 || { cat "$data-predict.log"; exit 1; }
  line=$(grep -E "^(accuracy|macro-F1) " "$data-predict.log" | head -n 1)
  echo "seed $seed: $line"
  figures+=("$(echo "$line" | grep -oE '^(accuracy|macro-F1) [0-9.]+' | grep -oE '[0-9.]+$')")
done
python3 - "${figures[@]}" <<'PY'
import sys
xs = [float(x) for x in sys.argv[1:]]
print(f"mean over {len(xs)} seeds: {sum(xs) / len(xs):.3f} (min {min(xs):.3f}, max {max(xs):.3f})")
PY
