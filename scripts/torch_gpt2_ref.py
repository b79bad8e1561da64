"""The PyTorch reference for the GPU benchmark: nanoGPT's GPT-2 trained the way nanoGPT trains it.

    python scripts/torch_gpt2_ref.py                          # GPT-2 124M, batch 32 x 1,024, on CUDA
    python scripts/torch_gpt2_ref.py --batch 64 --steps 30
    python scripts/torch_gpt2_ref.py --layers 2 --width 64 --heads 4 --vocab 256 --context 32 --no-compile

The model is GPT-2's layout as experiments/gpt2_124m.toml has it (learned positions, pre-LayerNorm,
tanh GELU, biases, tied head, vocabulary 50,304); the step is nanoGPT's on one GPU: bfloat16
autocast, `torch.compile`, flash scaled-dot-product attention, fused AdamW (lr 6e-4, betas 0.9 and
0.95, weight decay 0.1 on matrices), global-norm clipping at 1.0, TF32 matmuls, random tokens.
Each step is timed with CUDA events after the warm-up steps (which hold the compile); prints one
JSON record: step_ms (median), tokens_per_s, mfu against the nominal bf16 peak (same FLOP count
as `jaxgpt.model.flops.flops_per_token`), compile_s (the first step), peak memory. On a CPU it runs
float32 eagerly (for checking the script, not for figures).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

NOMINAL_BF16_PEAK = {"h100": 989e12, "h200": 989e12, "a100": 312e12}


class Block(nn.Module):
    def __init__(self, C: int, H: int):
        super().__init__()
        self.H = H
        self.ln_1, self.ln_2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.c_attn, self.c_proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.c_fc, self.mlp_proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (z.view(B, T, self.H, C // self.H).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.c_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, V: int, T: int, C: int, L: int, H: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, C), nn.Embedding(T, C)
        self.h = nn.ModuleList(Block(C, H) for _ in range(L))
        self.ln_f = nn.LayerNorm(C)
        self.lm_head = nn.Linear(C, V, bias=False)
        self.lm_head.weight = self.wte.weight
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


def flops_per_token(L: int, C: int, T: int, V: int) -> float:
    """6 N + 12 L C T with N the matmul weights (attention, MLP, head), as `jaxgpt.model.flops.flops_per_token`."""
    return 6 * (L * 12 * C * C + V * C) + 12 * L * C * T


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--steps", type=int, default=20, help="timed steps, after --warmup")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    B, T, V = args.batch, args.context, args.vocab
    model = GPT(V, T, args.width, args.layers, args.heads).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=6e-4, betas=(0.9, 0.95), fused=cuda)
    run = model if args.no_compile else torch.compile(model)
    x = torch.randint(0, V, (B, T), device=device)
    y = torch.randint(0, V, (B, T), device=device)

    def step():
        with torch.autocast(device, dtype=torch.bfloat16, enabled=cuda):
            loss = run(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    def sync():
        if cuda:
            torch.cuda.synchronize()

    start = time.perf_counter()
    step()
    sync()
    compile_s = time.perf_counter() - start
    for _ in range(max(0, args.warmup - 1)):
        step()
    sync()
    times = []
    for _ in range(args.steps):
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            step()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) / 1e3)
        else:
            begin_s = time.perf_counter()
            step()
            times.append(time.perf_counter() - begin_s)
    seconds = statistics.median(times)
    name = torch.cuda.get_device_name() if cuda else "cpu"
    peak = next((p for key, p in NOMINAL_BF16_PEAK.items() if key in name.lower()), None)
    fpt = flops_per_token(args.layers, args.width, T, V)
    print(json.dumps({
        "mode": "train", "variant": "torch.compile" if not args.no_compile else "torch eager",
        "framework": f"torch {torch.__version__}", "device": name, "dtype": "bfloat16" if cuda else "float32",
        "batch": B, "context": T, "parameters": n_params, "step_ms": seconds * 1e3,
        "tokens_per_s": B * T / seconds, "flops_per_token": fpt,
        "mfu": B * T * fpt / seconds / peak if peak else None, "compile_s": compile_s,
        "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
    }), flush=True)


if __name__ == "__main__":
    main()
