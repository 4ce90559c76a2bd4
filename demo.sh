#!/usr/bin/env bash
# The demo: prove the estimator, make a small Megapixel MNIST dataset from the bundled
# real digits, train briefly, predict and draw the attention -- CPU only, no download.
# Usage: bash demo.sh [OUT_DIR]   (default: demo/)
set -euo pipefail
cd "$(dirname "$0")"
ATS=${ATS:-.venv/bin/ats}
OUT=${1:-demo}
EPOCHS=${DEMO_EPOCHS:-4}
export ATS_OFFLINE=1

echo "== 1/5 self-check of the sampler and the estimator"
$ATS selfcheck --draws 30000
echo "== 2/5 a small Megapixel MNIST dataset (500x500 images) in $OUT/data"
$ATS make-dataset megapixel-mnist "$OUT/data" --preset small --n-train 3000 --offline
echo "== 3/5 train for $EPOCHS epochs (about 3 minutes on a 2-core CPU) into $OUT/run"
rm -rf "$OUT/run"
# Only the defaults (docs/training.md says what they are and why); --workers 1 suits 2 cores.
$ATS train "$OUT/data" --out "$OUT/run" --epochs "$EPOCHS" --workers 1
echo "== 4/5 predict the test split"
$ATS predict "$OUT/data" --model "$OUT/run/best.pt" --out "$OUT/predictions.csv" | tail -n 25
echo "== 5/5 attention heatmap and its evolution over the epochs"
IMG="$OUT/data/test/00003.png"
$ATS visualize "$IMG" --model "$OUT/run/best.pt" --out "$OUT/attention.png"
$ATS visualize "$OUT/run" --image "$IMG" --out "$OUT/evolution.png"
echo "done: $OUT/predictions.csv, $OUT/attention.png, $OUT/evolution.png, $OUT/run/curves.png"
echo "released models (models/README.md), e.g.:"
echo "  $ATS predict sample_data/megapixel-mnist/test.csv --model models/megapixel-mnist-ats.pt"
echo "  $ATS predict sample_data/synthetic-slides/test.csv --model models/synthetic-slides-ats.pt"
