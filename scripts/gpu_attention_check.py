"""Which attention a config's model runs on this accelerator, and what XLA's would cost instead.

    python scripts/gpu_attention_check.py --config experiments/gpt2_124m.toml

On a GPU in bfloat16, the GPU kernels (`jaxgpt.kernels.gpu`) ask for cuDNN's fused attention;
where cuDNN refuses, the portable kernels are chosen instead. This prints one JSON line naming
the kernels chosen and saying whether the lowered forward pass holds cuDNN's attention call, then
one `jaxgpt bench train`-style record (same fields) of the train step with the portable kernels
(XLA's attention; `model.kernels = "xla"`), to read beside the bench's line of the same dtype
and remat. Run by `scripts/gpu_124m.sh`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp

from jaxgpt.bench import train_record
from jaxgpt.config import load_config
from jaxgpt.kernels import choose_kernels
from jaxgpt.model import forward, init_params


def lowered_forward_uses_cudnn(cfg) -> bool:
    """Lowers (does not compile) the forward pass and looks for cuDNN's attention custom call."""
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    tokens = jax.ShapeDtypeStruct((1, cfg.context_length), jnp.int32)
    kernels = choose_kernels(cfg)
    text = jax.jit(lambda p, t: forward(p, cfg, t, kernels=kernels)).lower(params, tokens).as_text()
    return "cudnn$fmha" in text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if jax.default_backend() == "cpu":
        parser.error("needs a GPU or TPU: on a CPU the model runs the CPU kernels' attention "
                     "(jaxgpt.kernels.cpu)")
    cfg = load_config(args.config, args.set)
    print(json.dumps({"mode": "attention", "backend": jax.default_backend(), "dtype": cfg.model.dtype,
                      "kernels": choose_kernels(cfg.model).name,
                      "cudnn_attention": lowered_forward_uses_cudnn(cfg.model)}), flush=True)
    portable = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, kernels="xla"))
    print(json.dumps({**train_record(portable, args.repeats), "attention": "xla"}), flush=True)


if __name__ == "__main__":
    main()
