#!/usr/bin/env bash
# Transfer (issue 40): a feature network exported from a run on one Megapixel MNIST task,
# frozen, on another task (another label rule and a noise family it never saw), against the
# same model trained from scratch on the same data, seeds and budget.
#
#   bash benchmarks/transfer.sh OUT [SCRATCH_EPOCHS] [TRANSFER_EPOCHS]
#
# Source: the demo's data and run (majority of 5 digits, `reference` noise, 500x500, 3,000
# training images, seed 0; 4 epochs). Target: `--task max` (the largest digit present),
# `--noise strokes`, seed 11, 3,000 training + 500 test images of 500x500. Prints the test
# accuracy per epoch of both target runs (image labels only in every run).
set -euo pipefail
OUT=${1:?usage: transfer.sh OUT [SCRATCH_EPOCHS] [TRANSFER_EPOCHS]}
SCRATCH=${2:-12}
TRANSFER=${3:-4}
ATS=${ATS:-ats}
TRAIN_FLAGS=${TRAIN_FLAGS:---workers 1}  # 2 CPU cores; on a GPU: TRAIN_FLAGS=""
export ATS_OFFLINE=${ATS_OFFLINE:-1}
curve() {
  python3 - "$1/metrics.jsonl" "$2" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
print(f"{sys.argv[2]}: test_acc per epoch " + ", ".join(f"{100 * r['test_acc']:.1f}" for r in rows) + "%")
PY
}
timed() { local start; start=$(date +%s); "$@" | grep -E "^epoch|^done" || true; echo "  $(( $(date +%s) - start )) s"; }

$ATS make-dataset megapixel-mnist "$OUT/source" --preset small --n-train 3000 --offline | tail -n 1
[ -f "$OUT/source-run/best.pt" ] || timed $ATS train "$OUT/source" --out "$OUT/source-run" --epochs 4 $TRAIN_FLAGS
curve "$OUT/source-run" "source (majority, reference noise)"
$ATS export "$OUT/source-run/best.pt" "$OUT/encoder" --encoder | tail -n 1

$ATS make-dataset megapixel-mnist "$OUT/target" --preset small --n-train 3000 --n-test 500 \
  --task max --noise strokes --seed 11 --offline | tail -n 1
# shellcheck disable=SC2086  # the flags hold several words on purpose
timed $ATS train "$OUT/target" --out "$OUT/transfer" --feature-net "$OUT/encoder" --epochs "$TRANSFER" $TRAIN_FLAGS
curve "$OUT/transfer" "transfer (frozen encoder from the source run)"
# shellcheck disable=SC2086
timed $ATS train "$OUT/target" --out "$OUT/scratch" --epochs "$SCRATCH" $TRAIN_FLAGS
curve "$OUT/scratch" "scratch"
