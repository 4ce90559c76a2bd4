# Sourced by the one-call GPU measurement scripts (gpu_ips.sh, gpu_epoch_wall.sh), from the
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
