"""The train step with the backend's kernels, with the portable ones, and as plain Flax: step times.

    .venv/bin/python scripts/bench_kernels.py
    .venv/bin/python scripts/bench_kernels.py --shapes day1 --set model.dtype=bfloat16

At the Day 1 config (experiments/day1.toml: 2 layers x 128, T 128, B 32) and at 6 layers x 384
(T 256, B 16), prints one JSON line per step: `tuned` (`jaxgpt.kernels.choose_kernels`),
`portable` (`model.kernels = "xla"`), and `plain_flax`, the same model written here the way a
Flax user would write it (nn.Embed, nn.LayerNorm, nn.Dense, nn.dot_product_attention with a
causal mask, the embedding's attend as the tied head, optax adamw), then the tuned/plain and
portable/plain step-time ratios. Each step is timed by `jaxgpt.tools.bench.median_time`, the three
interleaved over `--rounds` rounds so that a neighbour's load falls on all of them.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from jaxgpt.config import ModelConfig, RunConfig, load_config
from jaxgpt.kernels import choose_kernels
from jaxgpt.tools.bench import median_time
from jaxgpt.train.step import compile_steps, init_state, window_length

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {
    "day1": [],
    "6x384": ["model.n_layers=6", "model.d_model=384", "model.n_heads=6", "model.context_length=256",
              "train.batch_size=16"],
}


class PlainBlock(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x):
        cfg, dtype = self.cfg, jnp.dtype(self.cfg.dtype)
        B, T, C = x.shape
        H, D = cfg.n_heads, cfg.head_size
        dense = lambda features: nn.Dense(features, use_bias=cfg.bias, dtype=dtype,
                                          kernel_init=nn.initializers.normal(cfg.init_std))
        h = nn.LayerNorm(epsilon=cfg.norm_eps, use_bias=True, dtype=dtype)(x)
        q, k, v = jnp.split(dense(3 * C)(h).reshape(B, T, 3 * H, D), 3, axis=2)
        attended = nn.dot_product_attention(q, k, v, mask=nn.make_causal_mask(jnp.ones((B, T))), dtype=dtype)
        x = x + dense(C)(attended.reshape(B, T, C))
        h = nn.LayerNorm(epsilon=cfg.norm_eps, use_bias=True, dtype=dtype)(x)
        return x + dense(C)(nn.gelu(dense(cfg.hidden_size)(h), approximate=True))


class PlainGPT(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, tokens):
        cfg = self.cfg
        embed = nn.Embed(cfg.vocab_size, cfg.d_model, embedding_init=nn.initializers.normal(cfg.init_std))
        positions = nn.Embed(cfg.context_length, cfg.d_model, embedding_init=nn.initializers.normal(cfg.init_std))
        x = (embed(tokens) + positions(jnp.arange(tokens.shape[1]))).astype(jnp.dtype(cfg.dtype))
        for _ in range(cfg.n_layers):
            x = PlainBlock(cfg)(x)
        x = nn.LayerNorm(epsilon=cfg.norm_eps, dtype=jnp.dtype(cfg.dtype))(x)
        return embed.attend(x.astype(jnp.float32))


def plain_step(cfg: RunConfig):
    """(jitted step, its first state) for the plain Flax model: AdamW after global-norm clipping."""
    model, train = PlainGPT(cfg.model), cfg.train
    optimizer = optax.chain(optax.clip_by_global_norm(train.clip_norm),
                            optax.adamw(train.lr, train.beta1, train.beta2, weight_decay=train.weight_decay))
    params = model.init(jax.random.key(0), jnp.zeros((1, cfg.model.context_length), jnp.int32))
    T = cfg.model.context_length

    def loss(params, batch):
        logits = model.apply(params, batch[:, :T])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:T + 1]).mean()

    @jax.jit
    def step(state, batch):
        params, opt_state = state
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), value

    return step, (params, optimizer.init(params))


def timed_steps(cfg: RunConfig) -> dict[str, callable]:
    """name -> a call of one train step (state threaded through), compiled and warmed up."""
    batch = jax.random.randint(jax.random.key(1), (cfg.train.batch_size, window_length(cfg.model)), 0,
                               cfg.model.vocab_size, jnp.int32)
    calls = {}
    for name, run in (("tuned", cfg), ("portable", _with_kernels(cfg, "xla"))):
        step = compile_steps(run)[0]
        holder = [init_state(run, jax.random.key(0))]

        def call(step=step, holder=holder):
            holder[0], metrics = step(holder[0], batch)
            return metrics["loss"]
        calls[name] = call
    step, state = plain_step(cfg)
    holder = [state]

    def plain_call():
        holder[0], value = step(holder[0], batch)
        return value
    calls["plain_flax"] = plain_call
    for call in calls.values():
        jax.block_until_ready(call())
    return calls


def _with_kernels(cfg: RunConfig, kernels: str) -> RunConfig:
    return cfg.replace("model", kernels=kernels)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="day1,6x384", help="comma-separated: day1, 6x384")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per round")
    args = parser.parse_args()
    for shape in args.shapes.split(","):
        cfg = load_config(str(ROOT / "experiments/day1.toml"), SHAPES[shape] + args.set)
        calls = timed_steps(cfg)
        seconds: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(args.rounds):
            for name, call in calls.items():
                seconds[name].append(median_time(call, args.repeats))
        ms = {name: statistics.median(s) * 1e3 for name, s in seconds.items()}
        m = cfg.model
        print(json.dumps({"shape": shape, "layers": m.n_layers, "d_model": m.d_model, "context": m.context_length,
                          "batch": cfg.train.batch_size, "dtype": m.dtype, "kernels": choose_kernels(m).name,
                          **{f"{name}_ms": round(v, 1) for name, v in ms.items()},
                          "tuned/plain": round(ms["tuned"] / ms["plain_flax"], 3),
                          "portable/plain": round(ms["portable"] / ms["plain_flax"], 3)}), flush=True)


if __name__ == "__main__":
    main()
