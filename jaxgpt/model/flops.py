"""What a token costs to train, in FLOPs, and the fraction of a chip's peak a run reaches (MFU).

    flops_per_token(cfg.model)                      # 6 N + 12 L C T
    mfu(tokens_per_s, flops_per_token(cfg.model), peak_flops)
"""

from __future__ import annotations

from jaxgpt.config import ModelConfig


def matmul_parameters(model: ModelConfig) -> int:
    """Parameters that take part in matmuls: attention, feed-forward, LM head (MTP adapters not counted)."""
    C, H, K, D, F = model.d_model, model.n_heads, model.kv_heads, model.head_size, model.hidden_size
    attention = C * (H + 2 * K) * D + H * D * C  # qkv (grouped kv heads) + output projection
    feed_forward = (3 if model.feed_forward == "swiglu" else 2) * C * F
    # The head is a V x C matmul whether or not its weights are tied to the embedding.
    return model.n_layers * (attention + feed_forward) + model.vocab_size * C


def flops_per_token(model: ModelConfig, seq_len: int | None = None) -> float:
    """Training FLOPs per token (PaLM appendix B / nanoGPT): 6 N + 12 L C T, a block whose heads
    attend in pairs (model.paired_head_layers) counted twice in L: its 2T queries of H/2 heads
    read 2T keys each."""
    T = model.context_length if seq_len is None else seq_len
    attending = model.n_layers + len(model.paired_head_layers)
    return 6.0 * matmul_parameters(model) + 12.0 * attending * model.d_model * T


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved training FLOP/s as a fraction of the hardware peak."""
    if peak_flops <= 0:
        raise ValueError(f"peak_flops must be > 0, got {peak_flops}")
    return tokens_per_s * flops_per_token / peak_flops
