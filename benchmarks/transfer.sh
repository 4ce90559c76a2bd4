#!/usr/bin/env bash
# Transfer: a feature network exported with `ats export --encoder`, frozen, on another
# Megapixel MNIST task with a noise family it never saw, against the same model trained from
# scratch on the same data, seeds and budget. Prints every run's test accuracy per epoch.
#
#   bash benchmarks/transfer.sh OUT [SCRATCH_EPOCHS] [TRANSFER_EPOCHS]
#   # the paper spec, majority rule, rings (a noise family no encoder saw), the released encoder:
#   TARGETS=maj ENCODERS=released TARGET_FLAGS="--preset paper --noise rings --seed 11" \
#     bash benchmarks/transfer.sh OUT 10 4
#
# Encoders: `demo` = the feature net of the demo's run (majority of 5 digits, `reference`
# noise, 500x500, 3,000 training images, seed 0, 4 epochs, image labels only); `released` =
# that of models/megapixel-mnist-ats.pt (`ats pretrain`: digit boxes). Targets (500x500,
# 3,000 training + 500 test images, `--noise strokes`, seed 11): `maj` (the majority rule)
# and `max` (the largest digit present); TARGETS, ENCODERS and TARGET_FLAGS choose others. A
# target's runs train at the same time. Runs never draw from the network: the bundled digits.
set -euo pipefail
OUT=${1:?usage: transfer.sh OUT [SCRATCH_EPOCHS] [TRANSFER_EPOCHS]}
SCRATCH=${2:-12}
TRANSFER=${3:-4}
ATS=${ATS:-ats}
TRAIN_FLAGS=${TRAIN_FLAGS:---workers 0}
TARGETS=${TARGETS:-maj max}
ENCODERS=${ENCODERS:-demo released}
TARGET_FLAGS=${TARGET_FLAGS:---preset small --n-train 3000 --n-test 500 --noise strokes --seed 11}
export ATS_OFFLINE=${ATS_OFFLINE:-1}
curve() {
  python3 - "$1/metrics.jsonl" "$2" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
print(f"{sys.argv[2]}: test_acc per epoch " + ", ".join(f"{100 * r['test_acc']:.1f}" for r in rows) + "%")
PY
}
train() {  # DATA RUN EPOCHS [flags...]: trains unless RUN already finished
  local data=$1 run=$2 epochs=$3; shift 3
  # shellcheck disable=SC2086  # the flags hold several words on purpose
  [ -f "$run/metrics.jsonl" ] && [ "$(wc -l < "$run/metrics.jsonl")" -ge "$epochs" ] || \
    $ATS train "$data" --out "$run" --epochs "$epochs" --overwrite $TRAIN_FLAGS "$@" > "$run.log" 2>&1
}

if [[ " $ENCODERS " == *" demo "* ]]; then
  $ATS make-dataset megapixel-mnist "$OUT/source" --preset small --n-train 3000 --offline | tail -n 1
  train "$OUT/source" "$OUT/source-run" 4
  curve "$OUT/source-run" "source run (majority, reference noise)"
  $ATS export "$OUT/source-run/best.pt" "$OUT/encoder-demo" --encoder | tail -n 1
fi
[[ " $ENCODERS " == *" released "* ]] && $ATS export models/megapixel-mnist-ats.pt "$OUT/encoder-released" --encoder | tail -n 1

declare -A TASK=([maj]=majority [max]=max)
for t in $TARGETS; do
  # shellcheck disable=SC2086  # the flags hold several words on purpose
  $ATS make-dataset megapixel-mnist "$OUT/target-$t" --task "${TASK[$t]}" --offline $TARGET_FLAGS | tail -n 1
  train "$OUT/target-$t" "$OUT/scratch-$t" "$SCRATCH" &
  for e in $ENCODERS; do
    train "$OUT/target-$t" "$OUT/$e-$t" "$TRANSFER" --feature-net "$OUT/encoder-$e" &
  done
  wait
  curve "$OUT/scratch-$t" "$t, from scratch"
  for e in $ENCODERS; do curve "$OUT/$e-$t" "$t, frozen $e encoder"; done
done
