#!/usr/bin/env bash
# Transfer: a feature network exported with `ats export --encoder`, frozen, on another
# Megapixel MNIST task, against the same model trained from scratch on the same data, seeds
# and budget. Prints every run's test accuracy per epoch.
#
#   bash benchmarks/transfer.sh OUT [SCRATCH_EPOCHS] [TRANSFER_EPOCHS]
#   # the paper spec, majority rule, rings (a noise family no encoder saw), the released encoder:
#   TARGETS=maj ENCODERS=released TARGET_FLAGS="--preset paper --noise rings --seed 11" \
#     bash benchmarks/transfer.sh OUT 10 4
#   # the paper spec, majority rule, from a run on the multilabel rule (its encoder; with
#   # INIT=1 also its attention, `--init`, the encoder still frozen):
#   TARGETS=maj ENCODERS=multilabel INIT=1 TARGET_FLAGS="--preset paper" bash benchmarks/transfer.sh OUT 8 3
#
# Encoders: `demo` = the feature net of the demo's run (majority of 5 digits, `reference`
# noise, 500x500, 3,000 training images, seed 0, 4 epochs, image labels only); `released` =
# that of models/megapixel-mnist-ats.pt (`ats pretrain`: digit boxes); `multilabel` = that of
# a run on IPS's multilabel rule (the paper spec, `reference` noise, seed 0: the images of
# `--preset paper`'s targets with another label; SOURCE_EPOCHS epochs, default 16, image
# labels only; SOURCE_FLAGS, more make-dataset flags). Targets (500x500, 3,000 training + 500 test images, `--noise strokes`, seed
# 11): `maj` (the majority rule) and `max` (the largest digit present); TARGETS, ENCODERS
# and TARGET_FLAGS choose others. INIT=1 adds, for `demo` and `multilabel`, a run that
# starts from the whole source run (`--init`, `--feature-lr 0`: the encoder frozen, the
# attention trained on). A target's runs train at the same time. Runs never draw from the
# network: the bundled digits.
set -euo pipefail
OUT=${1:?usage: transfer.sh OUT [SCRATCH_EPOCHS] [TRANSFER_EPOCHS]}
SCRATCH=${2:-12}
TRANSFER=${3:-4}
ATS=${ATS:-ats}
TRAIN_FLAGS=${TRAIN_FLAGS:---workers 0}
TARGETS=${TARGETS:-maj max}
ENCODERS=${ENCODERS:-demo released}
TARGET_FLAGS=${TARGET_FLAGS:---preset small --n-train 3000 --n-test 500 --noise strokes --seed 11}
SOURCE_EPOCHS=${SOURCE_EPOCHS:-16}
SOURCE_FLAGS=${SOURCE_FLAGS:-}
INIT=${INIT:-0}
export ATS_OFFLINE=${ATS_OFFLINE:-1}
curve() {
  python3 - "$1/metrics.jsonl" "$2" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
key = "test_macro_f1" if "test_macro_f1" in rows[0] else "test_acc"  # multi-label: macro-F1
print(f"{sys.argv[2]}: {key} per epoch " + ", ".join(f"{100 * r[key]:.1f}" for r in rows) + "%")
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
if [[ " $ENCODERS " == *" multilabel "* ]]; then
  # shellcheck disable=SC2086  # the flags hold several words on purpose
  $ATS make-dataset megapixel-mnist "$OUT/source-multilabel" --task multilabel --n-val 0 --offline $SOURCE_FLAGS | tail -n 1
  train "$OUT/source-multilabel" "$OUT/source-run-multilabel" "$SOURCE_EPOCHS"
  curve "$OUT/source-run-multilabel" "source run (multilabel, reference noise)"
  $ATS export "$OUT/source-run-multilabel/best.pt" "$OUT/encoder-multilabel" --encoder | tail -n 1
fi
declare -A SOURCE=([demo]=source-run [multilabel]=source-run-multilabel)
[[ " $ENCODERS " == *" released "* ]] && $ATS export models/megapixel-mnist-ats.pt "$OUT/encoder-released" --encoder | tail -n 1

declare -A TASK=([maj]=majority [max]=max)
for t in $TARGETS; do
  # shellcheck disable=SC2086  # the flags hold several words on purpose
  $ATS make-dataset megapixel-mnist "$OUT/target-$t" --task "${TASK[$t]}" --n-val 0 --offline $TARGET_FLAGS | tail -n 1
  train "$OUT/target-$t" "$OUT/scratch-$t" "$SCRATCH" &
  for e in $ENCODERS; do
    train "$OUT/target-$t" "$OUT/$e-$t" "$TRANSFER" --feature-net "$OUT/encoder-$e" &
    if [ "$INIT" = 1 ] && [ -n "${SOURCE[$e]:-}" ]; then
      train "$OUT/target-$t" "$OUT/init-$e-$t" "$TRANSFER" --set "init=\"$OUT/${SOURCE[$e]}/best.pt\"" --set feature_lr=0 &
    fi
  done
  wait
  curve "$OUT/scratch-$t" "$t, from scratch"
  for e in $ENCODERS; do
    curve "$OUT/$e-$t" "$t, frozen $e encoder"
    if [ -f "$OUT/init-$e-$t/metrics.jsonl" ]; then curve "$OUT/init-$e-$t" "$t, --init the $e run, encoder frozen"; fi
  done
done
