"""The decoder: pure `init_params` / `forward` from Flax modules, a scanned block stack, a KV cache.

    decoder.py    the model: blocks scanned, tied or untied head, MTP adapters
    layers.py     norms, positions (learned, RoPE), attention (grouped KV heads), feed-forward
    cache.py      the KV cache: whole-context, ring and long-short layouts, their writes and reads
    dtypes.py     the compute and activation dtypes
    knobs.py      muP's knobs: the multipliers and init scales a sweep may trace per member
    read_dtypes.py  params cast once to the dtype the model reads them in (for decode loops)
    token_ids.py  token ids checked against the vocabulary
    flops.py      the FLOPs a token costs, and MFU

May import the foundation and `jaxgpt.kernels` (the seam where a backend's kernels come in);
nothing about data, training or files.
"""

from jaxgpt.model.cache import Cache, init_cache
from jaxgpt.model.decoder import (
                                  Decoder,
                                  Params,
                                  count_params,
                                  forward,
                                  forward_cached,
                                  head_inputs,
                                  head_weight,
                                  init_params,
                                  stack_blocks,
                                  unstack_blocks,
)

__all__ = ["Cache", "Decoder", "Params", "count_params", "forward", "forward_cached", "head_inputs", "head_weight",
           "init_cache", "init_params", "stack_blocks", "unstack_blocks"]
