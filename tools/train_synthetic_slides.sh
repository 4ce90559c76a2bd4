#!/usr/bin/env bash
# One command for models/synthetic-slides-ats.pt: the data, training from scratch with
# `ats train`'s defaults (no curriculum, no init checkpoint, no flags but the run's place), the
# release, and the accuracy on a fresh test set the model never saw (another seed).
#
#   tools/train_synthetic_slides.sh OUT_DIR
#
# Call it again with the same OUT_DIR to continue: make-dataset resumes its directories,
# the run resumes where it stopped (ats train --resume).
#
# Environment (all optional):
#   WORK=/tmp/slides   data and run;  WORKERS=1  DataLoader and generator workers
#   NFRESH=200 FRESH_SEED=777   the fresh test set (the training data uses seed 0)
#   SMOKE=1           a tiny end-to-end check of this script (8 + 8 slides of 512 px, 1 epoch)
#   ATS=".venv/bin/ats"
set -euo pipefail
OUT_DIR=${1:?usage: $0 OUT_DIR}
WORK=${WORK:-/tmp/slides}; WORKERS=${WORKERS:-1}; NFRESH=${NFRESH:-200}; FRESH_SEED=${FRESH_SEED:-777}
ATS=${ATS:-.venv/bin/ats}
DATA="$WORK/data"; FRESH="$WORK/fresh-$FRESH_SEED"; RUN="$WORK/run"
SIZES=(); EPOCHS=()
if [ -n "${SMOKE:-}" ]; then SIZES=(--size 512 --n-spots 2 --max-targets 1); EPOCHS=(--epochs 1); fi
TRAIN_N=(); [ -n "${SMOKE:-}" ] && TRAIN_N=(--n-train 8 --n-test 8) && NFRESH=8
export PYTHONUNBUFFERED=1
mkdir -p "$OUT_DIR" "$WORK"
log() { echo "[$(date -u +%H:%M:%S)] $*"; }

log "training data: synthetic slides at the generator's defaults (240 + 80 slides of 3072x3072, seed 0)"
$ATS make-dataset synthetic-slides "$DATA" --workers "$WORKERS" "${SIZES[@]}" "${TRAIN_N[@]}"
log "fresh test set: $NFRESH slides, seed $FRESH_SEED"
$ATS make-dataset synthetic-slides "$FRESH" --n-train 1 --n-test "$NFRESH" --seed "$FRESH_SEED" --workers "$WORKERS" "${SIZES[@]}"

# --batch-size 32: what auto gave 240 training slides when the model was made; auto now gives a
# dataset this small at least 16 steps an epoch (15 a step), which would make another model
if [ -f "$RUN/last.pt" ]; then WHAT=(--resume "$RUN"); else WHAT=("$DATA" --out "$RUN" --batch-size 32); fi
log "training with the defaults (${WHAT[*]})"
$ATS train "${WHAT[@]}" --workers "$WORKERS" "${EPOCHS[@]}"

$ATS export "$RUN/best.pt" "$OUT_DIR/synthetic-slides-ats.pt"
cp "$RUN/metrics.jsonl" "$OUT_DIR/metrics.jsonl"
log "accuracy on the fresh test set (default ats predict)"
$ATS predict "$FRESH/test.csv" --model "$OUT_DIR/synthetic-slides-ats.pt" --out "$OUT_DIR/fresh-predictions.csv" \
  | tee "$OUT_DIR/fresh-accuracy.txt"
log "done: $OUT_DIR"
