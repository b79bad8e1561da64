"""Which attention a config's model runs on this accelerator, and what XLA's would cost instead.

    python scripts/gpu_attention_check.py --config experiments/gpt2_124m.toml

On a GPU in bfloat16, `layers.accelerator_causal_attention` asks for cuDNN's fused kernel and
falls back to XLA's implementation where cuDNN refuses. This prints one JSON line saying
whether the lowered forward pass holds cuDNN's attention call, then one `jaxgpt bench train`-style
record (same fields) of the train step with XLA's attention forced, to read beside the bench's
line of the same dtype and remat. Run by `scripts/gpu_124m.sh`.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from jaxgpt import layers
from jaxgpt.bench import train_record
from jaxgpt.config import load_config
from jaxgpt.model import forward, init_params


def lowered_forward_uses_cudnn(cfg) -> bool:
    """Lowers (does not compile) the forward pass and looks for cuDNN's attention custom call."""
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    tokens = jax.ShapeDtypeStruct((1, cfg.context_length), jnp.int32)
    text = jax.jit(lambda p, t: forward(p, cfg, t)).lower(params, tokens).as_text()
    return "cudnn$fmha" in text


def xla_attention(q_BTHD, k_BTKD, v_BTKD):
    return jax.nn.dot_product_attention(q_BTHD, k_BTKD, v_BTKD, is_causal=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if jax.default_backend() == "cpu":
        parser.error("needs a GPU or TPU: on a CPU the model runs its own attention "
                     "(cpu_attention.blocked_causal_attention, matmul.bf16_causal_attention)")
    cfg = load_config(args.config, args.set)
    print(json.dumps({"mode": "attention", "backend": jax.default_backend(), "dtype": cfg.model.dtype,
                      "cudnn_attention": lowered_forward_uses_cudnn(cfg.model)}), flush=True)

    layers.accelerator_causal_attention = xla_attention  # what the model calls at trace time
    print(json.dumps({**train_record(cfg, args.repeats), "attention": "xla"}), flush=True)


if __name__ == "__main__":
    main()
