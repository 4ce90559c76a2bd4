#!/usr/bin/env bash
# Issue 39 in one call: every GPU measurement the issue asks for, on a bare GPU machine.
#
#   bash benchmarks/gpu_session.sh                 # on the GPU machine; results in $OUT/gpu39
#   SMALL=1 bash benchmarks/gpu_session.sh         # dry run anywhere: sizes shrunk, the CPU if no CUDA
#   bash benchmarks/gpu_session.sh --source-hash   # hash of the code it runs (compare with env.txt)
#
# Steps, each printed with its command, time-boxed (`timeout`) inside one overall budget
# (BUDGET_S, default 540 s) and followed by its exit code; a failing step does not stop the next:
#   install    `pip install --no-deps --no-build-isolation -e .` (INSTALL=0 skips it; the steps run
#              from the checkout through PYTHONPATH either way)
#   env        nvidia-smi, driver / nvcc / torch / Python versions, commit (git, else $COMMIT), source hash
#   build+data the native CPU and CUDA patch kernels (csrc/, cached in $ATS_CACHE) beside the making of
#              a paper-spec Megapixel MNIST set (1500x1500, 1280 + 64 images) and its prepared layout
#   pytest     tests/test_native.py tests/test_host_sync.py: the kernels bit for bit against the torch
#              path, the wide uint8 kernel, and a training step under set_sync_debug_mode (CUDA tests)
#   patches    benchmarks/patch_extraction.py on CUDA: the kernel's GB/s and share of the device's copy
#              bandwidth measured in the same run, against torch's gather, the host -> device breakdown
#   bench-b*   `ats benchmark` at the paper spec, batch 1 and 32: ATS-10 against Deep MIL, time and
#              peak memory per sample (forward + backward, from the uint8 image on the host)
#   loader     benchmarks/loader.py: loader samples/s per CPU core and its time split (read, view,
#              patches), source PNGs against the prepared layout, one thread
#   train-*    `ats train` from the prepared layout, 2 epochs, --workers 16: batch 32 and 1, fp32 and
#              --amp bf16; nvidia-smi samples utilization.gpu (the share of time a kernel runs) beside
#   summary    summary.md: tables for benchmarks/gpu.md, the issue's targets checked
#
# Results, 8 files (what the device tool brings back): $OUT/gpu39/{session.log, env.txt, pytest.txt,
# patch_extraction.json, benchmark.json, train.json (with the loader's figures), summary.md, details.tar.gz}.
# Python: $PY, else ./.venv/bin/python, else python3 (on the GPU image: the one with torch). The
# package runs from the checkout (PYTHONPATH; `python -m ats_cli` is `ats`).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
SMALL=${SMALL:-0}
BUDGET_S=${BUDGET_S:-540}
INSTALL=${INSTALL:-1}

if [[ -n "${PY:-}" ]]; then :
elif [[ -x .venv/bin/python ]]; then PY=.venv/bin/python
else PY=python3; fi
PY=$(command -v "$PY") || { echo "no python ($PY)"; exit 1; }
export PATH="$(dirname "$PY"):$PATH"   # ninja and pytest of the same environment
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 ATS_OFFLINE=1
[[ "$SMALL" == 1 ]] && export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
ATS=("$PY" -m ats_cli)                 # = the `ats` command
ME=(bash benchmarks/gpu_session.sh)
if "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    HAS_CUDA=1; DEV=cuda
else
    HAS_CUDA=0; DEV=cpu
fi

# ---- parts run as subcommands of this script, so that `timeout` can box them ----------------
source_hash() {
    find ats_cli csrc benchmarks tests -type f \( -name '*.py' -o -name '*.cpp' -o -name '*.cu' -o -name '*.h' \
        -o -name '*.sh' \) -not -path '*/__pycache__/*' | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-16
}

env_info() {
    echo "commit: $(git rev-parse HEAD 2>/dev/null || echo "${COMMIT:-unknown (no .git here; pass COMMIT=...)}")"
    git status --short 2>/dev/null | head -20
    echo "source hash: $(source_hash)  (bash benchmarks/gpu_session.sh --source-hash)"
    echo "date: $(date -u +%FT%TZ)"
    echo "host: $(uname -srm), $(getconf _NPROCESSORS_ONLN) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
    free -g | head -2
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi
        nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem,power.limit \
            --format=csv
    else
        echo "nvidia-smi: skipped: no CUDA (not found)"
    fi
    if command -v nvcc >/dev/null; then nvcc --version | tail -2; else echo "nvcc: not on PATH"; fi
    echo "ninja: $(command -v ninja || echo 'not on PATH (the native build needs it)')"
    "$PY" - <<'EOF'
import importlib.metadata, platform, torch
print(f"python {platform.python_version()} | torch {torch.__version__} | torch CUDA {torch.version.cuda} | "
      f"cuDNN {torch.backends.cudnn.version()} | threads {torch.get_num_threads()}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"device 0: {p.name}, {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs, "
          f"capability {p.major}.{p.minor}, L2 {getattr(p, 'L2_cache_size', 0) / 2**20:.0f} MiB")
else:
    print("device 0: none (torch.cuda.is_available() is False)")
for name in ("numpy", "typer", "click", "rich", "pillow", "matplotlib", "scikit-image", "tifffile", "pytest",
             "openslide-python", "imagecodecs"):
    try:
        print(f"  {name} {importlib.metadata.version(name)}")
    except importlib.metadata.PackageNotFoundError:
        print(f"  {name}: not installed")
EOF
}

build_kernels() {
    "$PY" -c 'from ats_cli.core import native; native.build(cuda=False); print("CPU kernel:", native.build_dir(False))' &
    local cpu=$! rc=0
    if [[ "$HAS_CUDA" == 1 ]]; then
        "$PY" -c 'from ats_cli.core import native; native.build(cuda=True); print("CUDA kernel:", native.build_dir(True))'
        rc=$?
        echo "CUDA build rc=$rc"
    else
        echo "CUDA kernel: skipped: no CUDA"
    fi
    wait "$cpu"
    local cpu_rc=$?
    echo "CPU build rc=$cpu_rc"
    return $((rc || cpu_rc))
}

make_data() {  # make_data DIR LOG: the dataset, then its prepared layout (what training reads)
    local data=$1 log=$2 rc
    {
        if [[ "$SMALL" == 1 ]]; then
            "${ATS[@]}" make-dataset megapixel-mnist "$data" --preset small --n-train 64 --n-test 8 --offline --workers 2
        else
            "${ATS[@]}" make-dataset megapixel-mnist "$data" --preset paper --n-train 1280 --n-val 0 --n-test 64 --offline
        fi
        rc=$?
        echo "make-dataset rc=$rc"
        ((rc == 0)) && "${ATS[@]}" make-dataset prepare "$data" && echo "prepare rc=0"
    } > "$log" 2>&1
}

case "${1:-}" in
    "") ;;
    --source-hash) source_hash; exit 0 ;;
    --env-info) env_info; exit 0 ;;
    --build-kernels) build_kernels; exit $? ;;
    --make-data) make_data "$2" "$3"; exit $? ;;
    *) echo "usage: [SMALL=1] [OUT=DIR] [BUDGET_S=540] [INSTALL=0] [COMMIT=SHA] bash $0 [--source-hash]" >&2; exit 2 ;;
esac

# ---- the session ------------------------------------------------------------------------------
START=$(date +%s)
DEADLINE=$((START + BUDGET_S))
OUT=${OUT:-/tmp/ats_gpu_session_out}
RES="$OUT/gpu39"                            # what comes back: 8 files
WORK=${WORK:-/tmp/ats_gpu_session_work}     # the rest; its small files go into details.tar.gz
rm -rf "$RES" "$WORK"
mkdir -p "$RES" "$WORK"
exec > >(tee -a "$RES/session.log") 2>&1
TEE=$!

echo "### ats issue 39 GPU session: $(date -u +%FT%TZ), SMALL=$SMALL, budget ${BUDGET_S}s, device $DEV"
echo "### python: $PY; 'ats' below is: ${ATS[*]} (PYTHONPATH=$REPO)"
if [[ "$HAS_CUDA" == 0 ]]; then
    if [[ "$SMALL" == 1 ]]; then
        echo "### no CUDA: GPU-only parts say 'skipped: no CUDA'; the steps run on the CPU at SMALL sizes" \
             "(a dry run, not figures)"
    else
        echo "### no CUDA: the GPU steps say 'skipped: no CUDA' (SMALL=1 runs them on the CPU, shrunk)"
    fi
fi

printf 'step\trc\tseconds\tcommand\n' > "$WORK/steps.tsv"
step() {  # step NAME LIMIT_S CMD...: CMD time-boxed within the budget; prints it and its exit code
    local name=$1 limit=$2
    shift 2
    local left=$((DEADLINE - $(date +%s)))
    if ((left < 15)); then
        echo "=== [$name] skipped: out of the ${BUDGET_S}s budget"
        printf '%s\tskipped\t0\t%s\n' "$name" "$*" >> "$WORK/steps.tsv"
        return 0
    fi
    ((limit > left)) && limit=$left
    echo
    echo "=== [$name] \$ $*"
    echo "=== [$name] (time box ${limit}s, $(($(date +%s) - START))s into the session)"
    local t0 rc secs
    t0=$(date +%s.%N)
    timeout -k 10 "$limit" "$@"
    rc=$?
    secs=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
    if [[ $rc == 124 || $rc == 137 ]]; then echo "=== [$name] TIMED OUT after ${limit}s"; fi
    echo "=== [$name] rc=$rc, ${secs}s"
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$secs" "$*" >> "$WORK/steps.tsv"
    return 0
}
skip() { echo; echo "=== [$1] skipped: no CUDA"; printf '%s\tskipped: no CUDA\t0\t-\n' "$1" >> "$WORK/steps.tsv"; }

if [[ "$INSTALL" == 1 ]]; then
    step install 90 "$PY" -m pip install -q --no-deps --no-build-isolation --no-cache-dir -e .
fi

step env 60 bash -c "set -o pipefail; ${ME[*]} --env-info 2>&1 | tee '$RES/env.txt'"

# the kernels compile while the CPUs also make the dataset: neither waits for the other
DATA="$WORK/mnist_paper"
(timeout -k 10 300 "${ME[@]}" --make-data "$DATA" "$WORK/make_data.log"; echo $? > "$WORK/make_data.rc") &
DATA_PID=$!
step build 300 "${ME[@]}" --build-kernels
echo; echo "=== [data] waiting for the dataset ($(($(date +%s) - START))s into the session)"
wait "$DATA_PID"
cat "$WORK/make_data.log" | tail -5
printf 'data\t%s\t-\t%s\n' "$(cat "$WORK/make_data.rc" 2>/dev/null || echo '?')" \
    "make-dataset megapixel-mnist + make-dataset prepare (beside the build)" >> "$WORK/steps.tsv"

step pytest 150 bash -c "set -o pipefail; '$PY' -m pytest tests/test_native.py tests/test_host_sync.py -q \
-p no:cacheprovider 2>&1 | tee '$RES/pytest.txt'"

if [[ "$HAS_CUDA" == 1 ]]; then
    step patches 90 "$PY" benchmarks/patch_extraction.py --device cuda --repeats 20 \
        --json "$RES/patch_extraction.json"
elif [[ "$SMALL" == 1 ]]; then
    step patches 120 "$PY" benchmarks/patch_extraction.py --device auto --small --repeats 1 \
        --json "$RES/patch_extraction.json"
else
    skip patches
fi

for b in 1 32; do
    if [[ "$HAS_CUDA" == 1 ]]; then
        step "bench-b$b" 90 "${ATS[@]}" benchmark --device cuda --image-size 1500 --methods ats,deepmil \
            --n-patches 10 --repeats 10 --batch-size "$b" --json "$WORK/benchmark_b$b.json"
    elif [[ "$SMALL" == 1 ]]; then
        step "bench-b$b" 120 "${ATS[@]}" benchmark --device cpu --image-size 300 --methods ats,deepmil \
            --n-patches 10 --repeats 1 --threads 1 --batch-size "$((b > 1 ? 2 : 1))" --json "$WORK/benchmark_b$b.json"
    else
        skip "bench-b$b"
    fi
done

if [[ -f "$DATA/dataset.json" ]]; then
    step loader 90 env OMP_NUM_THREADS=1 "$PY" benchmarks/loader.py "$DATA" --images 32 \
        --repeats "$([[ "$SMALL" == 1 ]] && echo 1 || echo 3)" --json "$WORK/loader.json"
else
    echo; echo "=== [loader] skipped: no dataset (see the data step)"
fi

if [[ "$HAS_CUDA" == 1 ]]; then
    TRAIN_ARGS=(--epochs 2 --device cuda --workers 16)
elif [[ "$SMALL" == 1 ]]; then
    TRAIN_ARGS=(--epochs 2 --device cpu --workers 1)
fi
train_variant() {  # train_variant NAME EXTRA_ARGS...: one run, nvidia-smi sampling beside it
    local name=$1 smi=""
    shift
    if [[ "$HAS_CUDA" == 1 ]] && command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader,nounits -lms 500 \
            > "$WORK/util_$name.csv" 2>/dev/null &
        smi=$!
    else
        echo; echo "=== [train-$name] GPU utilisation: skipped: no CUDA"
    fi
    date +%s.%N > "$WORK/start_$name"
    step "train-$name" 100 "${ATS[@]}" train "$DATA" --out "$WORK/run_$name" "${TRAIN_ARGS[@]}" "$@"
    date +%s.%N > "$WORK/end_$name"
    if [[ -n "$smi" ]]; then kill "$smi" 2>/dev/null; wait "$smi" 2>/dev/null; fi
    return 0
}
if [[ -f "$DATA/dataset.json" && ( "$HAS_CUDA" == 1 || "$SMALL" == 1 ) ]]; then
    B32=32; [[ "$SMALL" == 1 ]] && B32=8
    train_variant "b${B32}-fp32" --batch-size "$B32"
    train_variant "b${B32}-bf16" --batch-size "$B32" --amp bf16
    train_variant b1-fp32 --batch-size 1
    train_variant b1-bf16 --batch-size 1 --amp bf16
else
    echo; echo "=== [train] skipped: no dataset, or no CUDA without SMALL=1"
fi

echo
echo "=== [summary] $(($(date +%s) - START))s into the session"
"$PY" benchmarks/gpu_session_summary.py "$RES" "$WORK" || echo "summary failed (rc $?)"
tar -czf "$RES/details.tar.gz" -C "$WORK" --exclude=./mnist_paper --exclude='*.pt' . 2>/dev/null \
    || echo "details.tar.gz: tar failed"
echo "### done in $(($(date +%s) - START))s; results in $RES: $(cd "$RES" && ls | tr '\n' ' ')"
exec >&- 2>&-
wait "$TEE" 2>/dev/null   # session.log complete before the machine hands $OUT back
