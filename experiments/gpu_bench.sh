#!/usr/bin/env bash
# One-shot GPU benchmark of ragged-fsdp on one GPU (about 8 minutes on an H200).
#
#   bash experiments/gpu_bench.sh        # results: experiments/results/gpu_*.md and gpu_*.json
#
# Stages, each under its own `timeout` and each writing its own files, so one failure costs only its
# own slot: gpu_check (the CUDA/NCCL paths); torch fully_shard training a ~1B llama (llama3.2-1b shapes,
# bf16, NCCL at world size 1) with AdamW, 8-bit Adam and Muon; the same on JAX; fully_shard vs FSDP2 and
# JAX vs GSPMD where those benchmarks take GPU flags; then one summary (gpu_bench.md/.json) of whatever
# finished. Without a GPU it says so and exits with status 2, writing nothing.
set -u
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
RESULTS=${RESULTS:-experiments/results}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 2)" 2>/dev/null; then
    echo "gpu_bench: no GPU here (torch sees no CUDA device); nothing measured, nothing written." >&2
    exit 2
fi
mkdir -p "$RESULTS"
LOG="$RESULTS/gpu_bench.log"
: > "$LOG"
MODEL=(--model llama3.2-1b --dtype bf16 --batch 4 --seq-len 2048 --no-progress)

stage() {  # stage NAME SECONDS CMD...: run CMD under a timeout, log it, never stop the script
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s): $*" | tee -a "$LOG"
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >> "$LOG" 2>&1
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - start))s" | tee -a "$LOG"
    echo "$name $rc $((SECONDS - start))" >> "$RESULTS/gpu_bench_stages.txt"
}
: > "$RESULTS/gpu_bench_stages.txt"

stage gpu_check 90 bash -c "set -o pipefail; $PYTHON -m experiments.gpu_check | tee $RESULTS/gpu_check.txt"

for opt in adamw adam8bit muon; do
    stage "torch_$opt" 75 "$PYTHON" -m experiments.train --stack torch "${MODEL[@]}" --optimizer "$opt" \
        --steps 12 --summary "$RESULTS/gpu_train_torch_$opt.json"
done
stage jax_adamw 120 "$PYTHON" -m experiments.train --stack jax "${MODEL[@]}" --steps 12 \
    --summary "$RESULTS/gpu_train_jax_adamw.json"

# fully_shard vs FSDP2 at world size 1 on NCCL: experiments/torch_vs_fsdp2.py with GPU flags.
if "$PYTHON" -m experiments.torch_vs_fsdp2 --help 2>/dev/null | grep -q -- "--device"; then
    stage torch_vs_fsdp2 120 "$PYTHON" -m experiments.torch_vs_fsdp2 --device cuda --world 1 \
        --model llama3.2-1b --dtype bf16 --out "$RESULTS/gpu_torch_vs_fsdp2"
else
    echo "torch_vs_fsdp2 skipped: experiments/torch_vs_fsdp2.py has no --device flag yet" | tee -a "$LOG"
fi
# JAX backend vs GSPMD on the same GPU: experiments/jax_vs_gspmd.py with GPU flags.
if "$PYTHON" -m experiments.jax_vs_gspmd --help 2>/dev/null | grep -q -- "--platform"; then
    stage jax_vs_gspmd 120 "$PYTHON" -m experiments.jax_vs_gspmd --platform gpu --devices 1 \
        --out "$RESULTS/gpu_jax_vs_gspmd"
else
    echo "jax_vs_gspmd skipped: experiments/jax_vs_gspmd.py has no --platform flag yet" | tee -a "$LOG"
fi
# ---- 8-bit Adam and Muon benchmarks of their own (issues 13 and 14): their authors set the flags ----
if [ -f experiments/muon_bench.py ]; then  # [muon_bench]
    stage muon_bench 60 "$PYTHON" -m experiments.muon_bench
fi
if [ -f experiments/adam8bit_quality.py ]; then  # [adam8bit_quality]
    stage adam8bit_quality 60 "$PYTHON" -m experiments.adam8bit_quality
fi

"$PYTHON" -m experiments._train.gpu_report "$RESULTS" | tee -a "$LOG"
