#!/usr/bin/env bash
# The engine race and speedrun, timed side by side: the plain-PyTorch nanoGPT run, then
# jaxgpt on nanoGPT's settings (experiments/shakespeare_char.toml), the same with bfloat16 compute
# (matmul operands only, on a CPU: jaxgpt/kernels/cpu_matmul.py; nanoGPT runs float32 there), then the speedrun config
# (experiments/shakespeare_speedrun.toml) once per seed, one after the other on this machine.
# Each line: the whole command's wall time, its final val loss, and its ratio to PyTorch's
# (figures: docs/performance.md).
# Usage: scripts/shakespeare_race.sh TINYSHAKESPEARE.txt TORCH_SCRIPT.py [SEEDS (default "0 1 2")]
# (TORCH_SCRIPT prints val_loss=... and needs `pip install torch==2.13.0`.)
set -euo pipefail
# The malloc setting the `jaxgpt` command gives itself (jaxgpt/cli/main.py, hugepage_malloc_env), for
# every run here, PyTorch's included.
export GLIBC_TUNABLES=${GLIBC_TUNABLES-glibc.malloc.hugetlb=1}
data=${1:?path to tinyshakespeare.txt}
torch_script=${2:?path to the PyTorch script}
seeds=${3:-0 1 2}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

timed() {  # timed NAME COMMAND...: runs it, prints "NAME wall_s val_loss"
  local name=$1; shift
  local start end
  start=$(date +%s.%N)
  "$@" > "$out/$name.log" 2>&1 || { cat "$out/$name.log" >&2; return 1; }
  end=$(date +%s.%N)
  local loss
  loss=$(grep -Eo 'val_loss(=|": )[0-9.]+' "$out/$name.log" | tail -n 1 | grep -Eo '[0-9.]+$')
  echo "$name $(python3 -c "print(round($end - $start, 1))") $loss"
}

torch_line=$(timed pytorch "${TORCH_PYTHON:-.venv/bin/python}" "$torch_script" "$data")
torch_s=$(echo "$torch_line" | cut -d' ' -f2)
report() { python3 -c "import sys; n, s, l = sys.argv[1].split(); print(f'{n:18s} wall {float(s):6.1f} s  val {float(l):.4f}  {float(s) / $torch_s:.2f}x PyTorch')" "$1"; }
report "$torch_line"
report "$(timed race .venv/bin/jaxgpt train --config experiments/shakespeare_char.toml --data "$data" \
  --out "$out/race" --no-progress --set train.sample_tokens=0)"
report "$(timed race-bf16 .venv/bin/jaxgpt train --config experiments/shakespeare_char.toml --data "$data" \
  --out "$out/race-bf16" --no-progress --set train.sample_tokens=0 --set model.dtype=bfloat16)"
for seed in $seeds; do
  report "$(timed "speedrun-seed$seed" .venv/bin/jaxgpt train --config experiments/shakespeare_speedrun.toml \
    --data "$data" --out "$out/speedrun$seed" --no-progress --set train.seed="$seed")"
done
