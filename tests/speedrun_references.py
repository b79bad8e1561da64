"""PyTorch float32 rebuilds of the two reference decoders the speedrun switches come from, written
from what their code computes, for the parity tests (tests/test_speedrun_parity.py).

`ModdedGPT`: modded-nanogpt's model of January 2025 (KellerJordan/modded-nanogpt, the code that
opens records/track_1_short/2025-01-04_SoftCap/31d6c427-f1f7-4d8a-91be-a67b5dcd13fd.txt), at any
even depth: embedding RMS-normed into x0; per block x = l0 * x + l1 * x0, then attention (values
l0 * v + l1 * ve where a value table feeds the block, l0 * v elsewhere; QK RMS-norm, then the
half-truncated rotary with 1 / 1024 as its lowest frequency) and a ReLU² MLP, both on RMS-normed
inputs without gains; U-net: the first half's outputs are pushed, and each block of the second
half first adds the last one popped times its skip weight; value tables 0..N-1 feed the first
N blocks and again the last N; untied head, logits 15 * tanh(z / 15). Its flex attention's
document mask: `forward(tokens, eot)` counts end-of-text tokens along each row (the token opens
the next document) and a query reads only its own document's keys; without `eot`, plain causal.
With `bigram_rows`, the bigram hash embedding of the record of 2026-01-19
(records/track_1_short/2026-01-19_BigramHashEmbedding): a zero-initialised table of that many
rows read at (36313 * token XOR 27191 * previous token) mod (rows - 1), the last row at each
row's first position, added in every block after the x0 mix times that block's lambda (0.1 at
init). The record hashes a document's first token with the last of the document before it; the
rebuild, as jaxgpt, gives it the last row too, so that packed documents stay apart. With `xsa`,
the learnable exclusive self-attention of the record of 2026-04-29
(records/track_1_short/2026-04-29_XSAGatedLayers): per block and head a learned alpha (0 at
init); each head's attention output y becomes y - tanh(alpha) (y . vn) vn, vn the token's own
value (after the value table's mix) normalised with F.normalize's eps 1e-4, before c_proj; the
record runs it in six of its eleven blocks, the rebuild in every one. With `paired`, the
paired-head attention of the record of 2026-01-07 (records/track_1_short/2026-01-07_PairedHeadAttention)
in those blocks: q, k and v [B, T, H, D] viewed as [B, 2T, H/2, D] (the record's view: each step's
first H/2 heads at 2t, the other H/2 at 2t + 1, so head h pairs with h + H/2), then the rotary and
one causal attention over the 2T steps, documents doubled, and the output viewed back. The record's
code rotates head h at 2t + (h mod 2) where its README says each head at its own interleaved
step; the rebuild rotates at the step, as jaxgpt does (the two agree where H/2 is odd for pairs
whose first head is even).
Its sliding window is plain causal on inputs shorter than the window, the inputs these tests use;
block 7's missing attention only exists at 12 layers, deeper than these tests go.

`NanochatGPT`: nanochat's `GPT` (karpathy/nanochat, nanochat/gpt.py at commit 92d63d4e): the
embedding RMS-normed, then its smear (each position adds the previous one's embedding times
smear_lambda * sigmoid(gate)), then per block x = resid_lambda * x + x0_lambda * x0; attention
with gated value embeddings on alternating layers (the last always), rotary by -theta with base
100,000, then QK RMS-norm and both times 1.2, causal within each layer's window (pattern of
S = a quarter of the context rounded up to 128, L = all of it, the last layer L); a ReLU² MLP;
after the stack it subtracts backout_lambda times the middle block's output, RMS-norms, and caps
untied logits at 15.

`multi_token_loss` and `multi_token_weights`: the training loss of the record of 2025-12-22
(records/track_1_short/2025-12-22_MultiTokenPrediction): one stream's logits scored against the
targets 1, 2, 3 ahead, each at its weight, terms past the stream's end zeroed, summed; the
weights by the share x of the scheduled steps done: [1, .5, .25 (1 - 3x)] in the first third,
[1, .5 (1 - (3x - 1))] in the second, [1] in the last.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.size(-1),))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Both references' rotary: halves (x1, x2) to (x1 cos + x2 sin, -x1 sin + x2 cos)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos + x2 * sin, -x1 * sin + x2 * cos], dim=-1)


def causal_attention(q, k, v, window: int | None = None, docs: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, T, H, D], k and v [B, T, K, D]; each query reads the keys at most `window` - 1 back,
    and with `docs` [B, T] only those of its own document."""
    T, group = q.size(1), q.size(2) // k.size(2)
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    i = torch.arange(T)
    allowed = (i[:, None] >= i[None, :])
    if window is not None:
        allowed &= (i[:, None] - i[None, :]) < window
    if docs is not None:
        allowed = allowed & (docs[:, None, :, None] == docs[:, None, None, :])
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=allowed)
    return out.transpose(1, 2)


class ModdedGPT(nn.Module):
    def __init__(self, vocab_size: int, n_layers: int, n_heads: int, dim: int, n_value_tables: int,
                 bigram_rows: int = 0, xsa: bool = False, paired: tuple[int, ...] = ()):
        super().__init__()
        assert n_layers % 2 == 0 and 2 * n_value_tables <= n_layers
        self.n_heads, self.n_layers, self.n_value_tables = n_heads, n_layers, n_value_tables
        self.paired = paired
        self.embed = nn.Embedding(vocab_size, dim)
        if bigram_rows:
            self.bigram_embed = nn.Embedding(bigram_rows, dim)
            nn.init.zeros_(self.bigram_embed.weight)
            self.bigram_lambdas = nn.Parameter(0.1 * torch.ones(n_layers))
        if xsa:
            self.xsa_alphas = nn.Parameter(torch.zeros(n_layers, n_heads))
        self.value_embeds = nn.ModuleList(nn.Embedding(vocab_size, dim) for _ in range(n_value_tables))
        self.c_q, self.c_k, self.c_v, self.c_proj = (
            nn.ModuleList(nn.Linear(dim, dim, bias=False) for _ in range(n_layers)) for _ in range(4))
        self.c_fc = nn.ModuleList(nn.Linear(dim, 4 * dim, bias=False) for _ in range(n_layers))
        self.mlp_proj = nn.ModuleList(nn.Linear(4 * dim, dim, bias=False) for _ in range(n_layers))
        self.attn_lambdas = nn.Parameter(torch.tensor([[0.5, 0.5]] * n_layers))
        self.block_lambdas = nn.Parameter(torch.tensor([[1.0, 0.0]] * n_layers))
        self.skip_weights = nn.Parameter(torch.ones(n_layers - n_layers // 2))
        self.lm_head = nn.Linear(dim, vocab_size, bias=False)

    def rotary(self, T: int, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        freq = (1 / 1024) ** torch.linspace(0, 1, steps=head_size // 4, dtype=torch.float32)
        freq = torch.cat([freq, freq.new_zeros(head_size // 4)])
        theta = torch.outer(torch.arange(T, dtype=torch.float32), freq)
        return theta.cos()[None, :, None, :], theta.sin()[None, :, None, :]

    def attention(self, i: int, x: torch.Tensor, ve: torch.Tensor | None, docs=None) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (proj[i](x).view(B, T, self.n_heads, -1) for proj in (self.c_q, self.c_k, self.c_v))
        lambdas = self.attn_lambdas[i]
        v = lambdas[0] * v + lambdas[1] * ve.view_as(v) if ve is not None else lambdas[0] * v
        q, k = rms_norm(q), rms_norm(k)
        if i in self.paired:  # the record's interleave: each step's heads in two halves, one step each
            H, D = self.n_heads, q.size(-1)
            q, k = (z.reshape(B, 2 * T, H // 2, D) for z in (q, k))
            rotary = self.rotary(2 * T, D)
            q, k = rotate(q, *rotary), rotate(k, *rotary)
            docs = None if docs is None else docs.repeat_interleave(2, dim=1)
            y = causal_attention(q, k, v.reshape(B, 2 * T, H // 2, D), docs=docs).reshape(B, T, H, D)
        else:
            rotary = self.rotary(T, q.size(-1))
            q, k = rotate(q, *rotary), rotate(k, *rotary)
            y = causal_attention(q, k, v, docs=docs)
        if hasattr(self, "xsa_alphas"):
            vn = F.normalize(v, dim=-1, eps=1e-4)
            y = y - torch.tanh(self.xsa_alphas[i]).view(1, 1, -1, 1) * (y * vn).sum(-1, keepdim=True) * vn
        return self.c_proj[i](y.reshape(B, T, C))

    def bigram_hash(self, tokens: torch.Tensor, docs: torch.Tensor | None) -> torch.Tensor:
        mod = self.bigram_embed.num_embeddings - 1
        x = tokens.to(torch.int32)
        hashed = torch.full_like(x, mod)
        hashed[:, 1:] = torch.bitwise_xor(36313 * x[:, 1:], 27191 * x[:, :-1]) % mod
        if docs is not None:  # a document's first token has none before it
            hashed[:, 1:] = torch.where(docs[:, 1:] != docs[:, :-1], mod, hashed[:, 1:])
        return hashed

    def block(self, i: int, x, ve, x0, docs=None, bigram=None):
        x = self.block_lambdas[i][0] * x + self.block_lambdas[i][1] * x0
        if bigram is not None:
            x = x + self.bigram_lambdas[i] * bigram
        x = x + self.attention(i, rms_norm(x), ve, docs)
        return x + self.mlp_proj[i](F.relu(self.c_fc[i](rms_norm(x))).square())

    def forward(self, tokens: torch.Tensor, eot: int | None = None) -> torch.Tensor:
        n, half = self.n_layers, self.n_layers // 2
        docs = None if eot is None else (tokens == eot).cumsum(1)
        x = x0 = rms_norm(self.embed(tokens))
        tables = [table(tokens) for table in self.value_embeds]
        ve = tables + [None] * (n - 2 * len(tables)) + tables
        bigram = self.bigram_embed(self.bigram_hash(tokens, docs)) if hasattr(self, "bigram_embed") else None
        skips = []
        for i in range(half):
            x = self.block(i, x, ve[i], x0, docs, bigram)
            skips.append(x)
        for i in range(n - half):
            x = x + self.skip_weights[i] * skips.pop()
            x = self.block(half + i, x, ve[half + i], x0, docs, bigram)
        logits = self.lm_head(rms_norm(x))
        return 15 * torch.tanh(logits / 15)


class NanochatAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, has_value: bool):
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        head_size = dim // n_heads
        self.c_q = nn.Linear(dim, n_heads * head_size, bias=False)
        self.c_k = nn.Linear(dim, n_kv_heads * head_size, bias=False)
        self.c_v = nn.Linear(dim, n_kv_heads * head_size, bias=False)
        self.c_proj = nn.Linear(dim, dim, bias=False)
        self.ve_gate = nn.Linear(12, n_kv_heads, bias=False) if has_value else None

    def forward(self, x, ve, rotary, window: int):
        B, T, C = x.shape
        q = self.c_q(x).view(B, T, self.n_heads, -1)
        k, v = (proj(x).view(B, T, self.n_kv_heads, -1) for proj in (self.c_k, self.c_v))
        if ve is not None:
            v = v + 3 * torch.sigmoid(self.ve_gate(x[..., :12])).unsqueeze(-1) * ve.view_as(v)
        q, k = rotate(q, *rotary), rotate(k, *rotary)
        q, k = rms_norm(q) * 1.2, rms_norm(k) * 1.2
        # FA3's window (left, 0) reads the query's own key and `left` before it.
        return self.c_proj(causal_attention(q, k, v, window=window + 1).reshape(B, T, C))


class NanochatBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, has_value: bool):
        super().__init__()
        self.attn = NanochatAttention(dim, n_heads, n_kv_heads, has_value)
        self.mlp = nn.Module()
        self.mlp.c_fc = nn.Linear(dim, 4 * dim, bias=False)
        self.mlp.c_proj = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x, ve, rotary, window: int):
        x = x + self.attn(rms_norm(x), ve, rotary, window)
        return x + self.mlp.c_proj(F.relu(self.mlp.c_fc(rms_norm(x))).square())


class NanochatGPT(nn.Module):
    """Its modules named as nanochat's, so that its state dict is one nanochat saves. The tables
    hold the vocabulary padded to a multiple of 64 and the logits are cropped to `vocab_size`.
    `short_window`: the S layers' window (FA3's left size); None, nanochat's rule for
    `sequence_len`."""

    def __init__(self, vocab_size: int, sequence_len: int, n_layers: int, n_heads: int, n_kv_heads: int, dim: int,
                 window_pattern: str = "SSSL", short_window: int | None = None):
        super().__init__()
        self.vocab_size, self.n_layers = vocab_size, n_layers
        padded = -(-vocab_size // 64) * 64
        head_size = dim // n_heads
        self.has_value = [i % 2 == (n_layers - 1) % 2 for i in range(n_layers)]
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(padded, dim),
            "h": nn.ModuleList(NanochatBlock(dim, n_heads, n_kv_heads, self.has_value[i]) for i in range(n_layers))})
        self.lm_head = nn.Linear(dim, padded, bias=False)
        self.resid_lambdas = nn.Parameter(torch.ones(n_layers))
        self.x0_lambdas = nn.Parameter(torch.zeros(n_layers))
        self.smear_gate = nn.Linear(24, 1, bias=False)
        self.smear_lambda = nn.Parameter(torch.zeros(1))
        self.backout_lambda = nn.Parameter(0.2 * torch.ones(1))
        self.value_embeds = nn.ModuleDict({str(i): nn.Embedding(padded, n_kv_heads * head_size)
                                           for i in range(n_layers) if self.has_value[i]})
        short = -(-sequence_len // 4 // 128) * 128 if short_window is None else short_window
        self.windows = [sequence_len if window_pattern[i % len(window_pattern)] == "L" else short
                        for i in range(n_layers)]
        self.windows[-1] = sequence_len

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        T = tokens.size(1)
        head_size = self.transformer.h[0].attn.c_q.out_features // self.transformer.h[0].attn.n_heads
        inv_freq = 1.0 / (100000 ** (torch.arange(0, head_size, 2, dtype=torch.float32) / head_size))
        theta = torch.outer(torch.arange(T, dtype=torch.float32), inv_freq)
        rotary = theta.cos()[None, :, None, :], theta.sin()[None, :, None, :]
        x = rms_norm(self.transformer.wte(tokens))
        gate = self.smear_lambda * torch.sigmoid(self.smear_gate(x[:, 1:, :24]))
        x = torch.cat([x[:, :1], x[:, 1:] + gate * x[:, :-1]], dim=1)
        x0, backout = x, None
        for i, block in enumerate(self.transformer.h):
            x = self.resid_lambdas[i] * x + self.x0_lambdas[i] * x0
            ve = self.value_embeds[str(i)](tokens) if self.has_value[i] else None
            x = block(x, ve, rotary, self.windows[i])
            if i == self.n_layers // 2:
                backout = x
        x = x - self.backout_lambda * backout
        logits = self.lm_head(rms_norm(x))[..., :self.vocab_size]
        return 15 * torch.tanh(logits / 15)


def multi_token_weights(x: float) -> list[float]:
    if x < 1 / 3:
        return [1.0, 0.5, 0.25 * (1 - 3 * x)]
    if x < 2 / 3:
        return [1.0, 0.5 * (1 - (3 * x - 1))]
    return [1.0]


def multi_token_loss(logits_TV: torch.Tensor, targets_T: torch.Tensor, weights: list[float]) -> torch.Tensor:
    n = len(weights)
    ahead_Tn = F.pad(targets_T, (0, n - 1)).unfold(0, n, 1)  # row t: the targets t, t + 1, .., t + n - 1
    losses_Tn = torch.logsumexp(logits_TV, dim=-1)[:, None] - logits_TV.gather(1, ahead_Tn)
    for k in range(1, n):
        losses_Tn[-k:, k] = 0
    return (losses_Tn * torch.tensor(weights)).sum()
