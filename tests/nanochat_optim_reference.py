"""A PyTorch float32 rebuild of nanochat's optimizer (karpathy/nanochat, nanochat/optim.py's
MuonAdamW with the groups of gpt.py's `setup_optimizer`, commit 92d63d4e) on one process, written
from what it computes, for tests/test_nanochat_optim.py.

AdamW (per group lr, betas, eps, weight decay): p *= 1 - lr wd; m, v lerped towards g and g²;
p -= lr / (1 - b1^t) * m / (sqrt(v / (1 - b2^t)) + eps).

Muon (each matrix [out, in] on its own): Nesterov as lerps (buf towards g by 1 - mu, then g
towards buf by mu); MuonEq (each row scaled to the mean row norm); Polar Express (X / (|X| 1.01 +
1e-6), then five (a, b, c) steps, A = X^T X for tall X, X X^T for wide); Muon+ (|X| set to
sqrt(min(out, in))); NorMuon (the mean square over `in` where out >= in, else over `out`, lerped
into a second moment by 1 - beta2, the update scaled by its rsqrt and renormed to its norm before);
cautious weight decay: p -= lr' g + lr' wd p [g p >= 0], lr' = lr sqrt(max(1, out / in)).
"""

from __future__ import annotations

import torch

POLAR_EXPRESS = [(8.156554524902461, -22.48329292557795, 15.878769915207462),
                 (4.042929935166739, -2.808917465908714, 0.5000178451051316),
                 (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
                 (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
                 (2.3465413258596377, -1.7097828382687081, 0.42323551169305323)]


def adamw_step(p, g, state, lr, betas, eps, wd):
    state["t"] = state.get("t", 0) + 1
    m = state.setdefault("m", torch.zeros_like(p))
    v = state.setdefault("v", torch.zeros_like(p))
    p.mul_(1 - lr * wd)
    m.lerp_(g, 1 - betas[0])
    v.lerp_(g.square(), 1 - betas[1])
    denominator = (v / (1 - betas[1] ** state["t"])).sqrt() + eps
    p.add_(m / denominator, alpha=-lr / (1 - betas[0] ** state["t"]))


def muon_step(p, g, state, lr, momentum, beta2, wd, steps=5):
    out_size, in_size = p.shape[-2:]
    buffer = state.setdefault("momentum", torch.zeros_like(p))
    buffer.lerp_(g, 1 - momentum)
    g = g.lerp(buffer, momentum)
    target = g.norm(dim=(-2, -1), keepdim=True) / out_size**0.5
    X = g * (target / g.norm(dim=-1, keepdim=True).clamp_min(1e-6))
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * 1.01 + 1e-6)
    for a, b, c in POLAR_EXPRESS[:steps]:
        if out_size > in_size:
            A = X.mT @ X
            X = a * X + X @ (b * A + c * (A @ A))
        else:
            A = X @ X.mT
            X = a * X + (b * A + c * (A @ A)) @ X
    g = X * (min(out_size, in_size) ** 0.5 / X.norm(dim=(-2, -1), keepdim=True).clamp_min(1e-6))
    reduce = -1 if out_size >= in_size else -2
    v_mean = g.square().mean(dim=reduce, keepdim=True)
    size = g.size(reduce)
    v_norm = (v_mean.sum(dim=(-2, -1), keepdim=True) * size).sqrt()
    second = state.setdefault("second", torch.zeros_like(v_mean))
    second.lerp_(v_mean, 1 - beta2)
    step = second.clamp_min(1e-10).rsqrt()
    v_norm_new = ((v_mean * size) * step.square()).sum(dim=(-2, -1), keepdim=True).sqrt()
    g = g * (step * (v_norm / v_norm_new.clamp_min(1e-10)))
    lr = lr * max(1.0, out_size / in_size) ** 0.5
    # How near each entry came to the cautious mask's edge (g p = 0), over the steps: where float
    # rounding may put another implementation on the other side.
    state["edge"] = torch.minimum(state.get("edge", torch.full_like(p, float("inf"))), (g * p).abs())
    p.sub_(lr * g + lr * wd * p * ((g * p) >= 0))


def groups(names: list[str], model_dim: int, *, unembedding_lr=0.004, embedding_lr=0.2, matrix_lr=0.02,
           weight_decay=0.0, scalar_lr=0.5) -> dict[str, dict]:
    """Each nanochat parameter's group, as `setup_optimizer` builds them."""
    s = (model_dim / 768) ** -0.5
    table = {}
    for name in names:
        if name.startswith("transformer.h."):
            table[name] = dict(kind="muon", lr=matrix_lr, momentum=0.95, beta2=0.9, weight_decay=weight_decay)
        elif name == "lm_head.weight":
            table[name] = dict(kind="adamw", lr=unembedding_lr * s, betas=(0.8, 0.96), eps=1e-10, weight_decay=0.01)
        elif name == "transformer.wte.weight":
            table[name] = dict(kind="adamw", lr=embedding_lr * s, betas=(0.8, 0.995), eps=1e-10, weight_decay=0.001)
        elif name.startswith("value_embeds."):
            table[name] = dict(kind="adamw", lr=embedding_lr * s * 0.5, betas=(0.8, 0.995), eps=1e-10, weight_decay=0.01)
        elif name == "resid_lambdas":
            table[name] = dict(kind="adamw", lr=scalar_lr * 0.01, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.05)
        elif name == "x0_lambdas":
            table[name] = dict(kind="adamw", lr=scalar_lr, betas=(0.96, 0.95), eps=1e-10, weight_decay=0.0)
        else:  # smear_gate, smear_lambda, backout_lambda
            table[name] = dict(kind="adamw", lr=0.2, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.0)
    return table


def step(params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], state: dict, table: dict,
         lr_multiplier: float = 1.0) -> None:
    """One MuonAdamW step, in place, every group's lr times `lr_multiplier` (base_train's schedule)."""
    for name, p in params.items():
        group, slot = table[name], state.setdefault(name, {})
        if group["kind"] == "adamw":
            adamw_step(p, grads[name], slot, group["lr"] * lr_multiplier, group["betas"], group["eps"],
                       group["weight_decay"])
        else:
            muon_step(p, grads[name].clone(), slot, group["lr"] * lr_multiplier, group["momentum"], group["beta2"],
                      group["weight_decay"])
