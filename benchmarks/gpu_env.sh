# Sourced by the one-call GPU measurement scripts (gpu_ips.sh, gpu_nested.sh, gpu_epoch_wall.sh), from the
# repository root: the Python ($PY, else ./.venv's, else python3: on the GPU image the one
# with torch), `ats` run from the checkout, the device (dry run on a CPU: DEVICE=cpu
# MAKE_FLAGS="--preset small --n-train 64 --n-test 16") and extra make-dataset flags.
if [[ -z "${PY:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 ATS_OFFLINE=1
ATS=("$PY" -m ats_cli)
DEVICE=${DEVICE:-cuda}
MAKE_FLAGS=${MAKE_FLAGS:-}

# describe_env FILE WHAT: the commit, the GPU, the CPU count and WHAT (the run's settings) in
# FILE, echoed.
describe_env() {
  { echo "commit: ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
    echo "CPUs: $(getconf _NPROCESSORS_ONLN); $2"; } > "$1"
  cat "$1"
}

# train_boxed NAME SECONDS DATA [ats train flags...]: `ats train DATA --out $WORK/run-NAME` on
# $DEVICE, stopped after SECONDS; its log in $RES/train-NAME.log (with the exit status and
# the time taken) and its per-epoch figures copied to $RES/metrics-NAME.jsonl.
train_boxed() {
  local name=$1 seconds=$2 data=$3 start
  shift 3
  start=$(date +%s)
  timeout "$seconds" "${ATS[@]}" train "$data" --out "$WORK/run-$name" --device "$DEVICE" "$@" \
    > "$RES/train-$name.log" 2>&1
  echo "rc $? after $(( $(date +%s) - start )) s" >> "$RES/train-$name.log"
  cp "$WORK/run-$name/metrics.jsonl" "$RES/metrics-$name.jsonl" 2>/dev/null
}

# wait_sampling FILE: wait for this shell's background jobs, sampling the GPU's utilization
# and memory into FILE every 20 s meanwhile.
wait_sampling() {
  while [[ -n "$(jobs -r)" ]]; do
    sleep 20
    nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader >> "$1" 2>/dev/null
  done
  wait
}
