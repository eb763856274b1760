#!/usr/bin/env bash
# The device check on one GPU (experiments/gpu_check.py says what each stage checks).
#
#   bash experiments/gpu_check.sh RESULTS_DIR      # with the image's python3 and PYTHONPATH=., no install
#
# Stages in order, each in its own process under `timeout` at its budget (330 s in all, under 6 minutes
# with start-up), each appending its checks to RESULTS_DIR/checks.jsonl as it goes, so a stage that fails
# or runs out of time costs only itself. One line per stage is printed and kept in RESULTS_DIR/summary.txt;
# everything the stages print goes to RESULTS_DIR/log.txt; calibrate writes RESULTS_DIR/calibration.json.
# Without a GPU it says so at once and exits with status 2, writing nothing. Exit status: 0 when every
# stage passed, 1 otherwise.
set -u
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if (( $# != 1 )); then
    echo "usage: bash experiments/gpu_check.sh RESULTS_DIR" >&2
    exit 64
fi
OUT=$1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # JAX takes only what it uses of the GPU

if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 2)" 2>/dev/null; then
    echo "gpu_check: no GPU here (torch from $PYTHON sees no CUDA device); nothing measured, nothing written." >&2
    exit 2
fi
mkdir -p "$OUT"
: > "$OUT/summary.txt"
: > "$OUT/log.txt"
status=0
while read -r stage budget; do
    start=$SECONDS
    timeout --kill-after=5 "$budget" "$PYTHON" -m experiments.gpu_check "$stage" --out "$OUT" >> "$OUT/log.txt" 2>&1
    rc=$?
    (( rc == 0 )) || status=1
    "$PYTHON" -m experiments.gpu_check summary --out "$OUT" --of "$stage" "$rc" "$((SECONDS - start))" \
        | tee -a "$OUT/summary.txt"
done < <("$PYTHON" -m experiments.gpu_check plan)
exit $status
