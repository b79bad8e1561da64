#!/usr/bin/env bash
# GPT-2 124M (experiments/gpt2_124m.toml) on one accelerator: step time,
# tokens/s and MFU against the chip's nominal bfloat16 peak (jaxgpt/bench.py, NOMINAL_BF16_PEAK),
# with and without remat, bfloat16 and float32, plus compiled memory; then whether the model's
# attention is cuDNN's fused kernel, and the bfloat16 step with XLA's attention instead
# (scripts/gpu_attention_check.py). One run of a few minutes.
# Usage: scripts/gpu_124m.sh [RECORDS.jsonl]   (needs jax for the accelerator, and jaxgpt's
# dependencies; run from the repository root, installed or not)
set -euo pipefail
records=${1:-/dev/null}
export PYTHONUNBUFFERED=1
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
if command -v nvidia-smi > /dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
fi
PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} python3 -m jaxgpt bench train \
  --config experiments/gpt2_124m.toml --repeats "${REPEATS:-5}" "${@:2}" | tee "$records"
PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} python3 scripts/gpu_attention_check.py \
  --config experiments/gpt2_124m.toml --repeats "${REPEATS:-5}" | tee -a "$records"
