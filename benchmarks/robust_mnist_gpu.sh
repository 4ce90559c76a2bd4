#!/usr/bin/env bash
# Issue 19 on a GPU machine, in one call: stage 1 + 1b of the robust Megapixel MNIST recipe
# (ats pretrain, keeping its "none" row: --none-class on, the default) at a scale a
# 2-core CPU cannot reach, and the robustness table of the checkpoint it writes, read four
# ways by ats export (the release recipe first: counts, none logit at the object prior
# 50/55, floor 0.02; then without the prior, without the floor, as votes: benchmarks/accuracy.md, "Votes and
# counts"), on fresh sets of every noise family (MNIST's test digits).
#
#   MNIST=.mnist/mnist.npz bash benchmarks/robust_mnist_gpu.sh      # results in $OUT/robust
#   SMALL=1 MNIST=... bash benchmarks/robust_mnist_gpu.sh           # dry run anywhere, tiny sizes
#
# MNIST: the full MNIST (ats make-dataset fetch-mnist DIR, or an .npz in Keras' layout; the
# device tool carries an ignored folder, e.g. .mnist/). Each step is time-boxed inside
# BUDGET_S (default 400 s) so that what finished comes back. Environment (optional):
# NTRAIN=12000 (training images, all used by stage 1) EPOCHS=4 ATT_EPOCHS=8 NFRESH=1000
# JOBS=8 (sets predicted at once) TRAIN_NOISE=reference,strokes,fragments,grid,glyphs
# (blobs, rings and waves are held out: only the table sees them) PY=python3. Files back (at most 8): log.txt, stage1.log,
# robustness_{prior-f0.02,counts-none-f0.02,counts-none,votes-none}.json (each table is
# in log.txt), models.tar (the checkpoint and the releases).
set -uo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s); BUDGET_S=${BUDGET_S:-400}
SMALL=${SMALL:-0}
if [[ "$SMALL" == 1 ]]; then
  NTRAIN=${NTRAIN:-40}; EPOCHS=${EPOCHS:-1}; ATT_EPOCHS=${ATT_EPOCHS:-1}; NFRESH=${NFRESH:-4}; SIZE=(--width 500 --height 500)
else
  NTRAIN=${NTRAIN:-12000}; EPOCHS=${EPOCHS:-4}; ATT_EPOCHS=${ATT_EPOCHS:-8}; NFRESH=${NFRESH:-1000}; SIZE=()
fi
JOBS=${JOBS:-8}; TRAIN_NOISE=${TRAIN_NOISE:-reference,strokes,fragments,grid,glyphs}
PY=${PY:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3 )}
MNIST=${MNIST:?MNIST=path to the full MNIST (ats make-dataset fetch-mnist DIR)}
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/ats_robust_out}; RES="$OUT/robust"; W=${WORK:-/tmp/ats_robust_work}
rm -rf "$RES" "$W"; mkdir -p "$RES" "$W"
exec > >(tee -a "$RES/log.txt") 2>&1
ATS=("$PY" -m ats_cli)
NETS=(--attention-net block-attention --attention-width 32 --scale 0.2)
CPUS=$(getconf _NPROCESSORS_ONLN)

boxed() {  # boxed NAME CMD...: CMD under `timeout` with what is left of the budget
  local name=$1 left=$((START + BUDGET_S - $(date +%s))); shift
  if ((left < 10)); then echo "=== [$name] skipped: budget spent"; return 1; fi
  echo "=== [$name] $(($(date +%s) - START))s in, box ${left}s: $*"
  timeout -k 5 "$left" "$@"; local rc=$?
  echo "=== [$name] rc=$rc at $(($(date +%s) - START))s"; return $rc
}

echo "### robust_mnist_gpu: $(date -u +%FT%TZ) NTRAIN=$NTRAIN EPOCHS=$EPOCHS ATT_EPOCHS=$ATT_EPOCHS NFRESH=$NFRESH" \
     "JOBS=$JOBS CPUS=$CPUS source $(bash benchmarks/gpu_session.sh --source-hash)"
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available() and torch.cuda.get_device_name(0))'

boxed data "${ATS[@]}" make-dataset megapixel-mnist "$W/data" --n-train "$NTRAIN" --n-val 0 --n-test 300 \
  --noise "$TRAIN_NOISE" --seed 0 --mnist "$MNIST" "${SIZE[@]}" >/dev/null

boxed stage1 "${ATS[@]}" pretrain "$W/data" --out "$W/stage1.pt" --images "$NTRAIN" \
  --epochs "$EPOCHS" --attention-epochs "$ATT_EPOCHS" "${NETS[@]}" --workers "$CPUS" \
  --pooling counts --none-class on 2>&1 | tee "$RES/stage1.log"

# the same checkpoint read four ways, the most promising first (the budget may end the list)
for way in "prior-f0.02 --pooling counts --count-floor 0.02 --none-prior 50/55" \
           "counts-none-f0.02 --pooling counts --count-floor 0.02" "counts-none --pooling counts" \
           "votes-none --pooling votes"; do
  read -r name flags <<< "$way"
  [[ -f "$W/stage1.pt" ]] || break
  "${ATS[@]}" export "$W/stage1.pt" "$W/stage1-$name.pt" --eval-n-patches 80 $flags
  boxed "robustness-$name" "$PY" benchmarks/noise_robustness.py --model "$W/stage1-$name.pt" --n "$NFRESH" \
    --families all --mnist "$MNIST" --work "$W/fresh" --jobs "$JOBS" --json "$RES/robustness_$name.json" \
    "${SIZE[@]}"
done
tar -cf "$RES/models.tar" -C "$W" $(cd "$W" && ls stage1*.pt 2>/dev/null) 2>/dev/null
echo "### done in $(($(date +%s) - START))s: $(ls "$RES" | tr '\n' ' ')"
