#!/usr/bin/env bash
# nanoGPT's CPU Shakespeare run in jaxgpt, then the same run in plain PyTorch, one after the other
# on the same machine. Usage: scripts/shakespeare_vs_torch.sh TINYSHAKESPEARE.txt TORCH_SCRIPT.py
# (TORCH_SCRIPT: a plain-PyTorch re-implementation of the run that prints val_loss and wall_s;
# it needs `pip install torch==2.13.0`).
set -euo pipefail
data=${1:?path to tinyshakespeare.txt}
torch_script=${2:?path to the PyTorch script}
out=${OUT:-runs/shakespeare}
rm -rf "$out"
start=$(date +%s.%N)
.venv/bin/jaxgpt train --config experiments/shakespeare_char.toml --data "$data" --out "$out" --no-progress \
  | tail -n 1 > "$out.summary.json"
end=$(date +%s.%N)
echo "jaxgpt: $(python3 -c "import json,sys; s=json.load(open('$out.summary.json')); print(f\"val_loss={s['val_loss']:.4f} loop_s={s['wall_s']}\")") wall_s=$(python3 -c "print(round($end - $start, 1))")"
.venv/bin/jaxgpt eval --run "$out" --batches 500
${TORCH_PYTHON:-.venv/bin/python} "$torch_script" "$data"
