"""Generation's KV cache: the name a model's forward takes it under (`cache_kwarg`), a cache written
in place (`kv_cache`), in the autocast dtype under autocast, and attention at a decode step without
copies of K and V for grouped-query attention (`packed_gqa`).
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager

import torch
import torch.nn.functional as F
import transformers
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from support.parallel import hf_module


def cache_kwarg(model) -> str:
    """The name under which the model's forward and `generate` take the KV cache, and its output
    holds it: `cache` from transformers 5.24 (which deprecates `past_key_values`: gone from forward
    in 5.40, from generate in 6.0), `past_key_values` before it (where a forward given `cache=`
    would silently run without the cache). Read from the model's own forward (remote code too)."""
    if "cache" in inspect.signature(hf_module(model).forward).parameters:
        return "cache"
    return "past_key_values"


class _KVCache(transformers.DynamicCache):
    """HF's DynamicCache written into storage allocated once for the call's longest sequence: each
    layer's attention reads views of the filled part, the same K and V in the same shapes, so the
    same numbers, without the copy of the whole cache that DynamicCache's concatenation makes at
    every token. The prompt's pass keeps HF's prompt-length K and V; a layer's storage is made at
    its first decode step, the prompt's part copied in, so the prompt pass's activations never sit
    beside the whole cache (bench/memory_plan.py's generation term). A layer that is not a plain
    DynamicLayer (a sliding window) keeps HF's update. `dtype` (autocast): K and V are stored in
    it. Under autocast the residual stream is float32, so RoPE'd keys (before transformers 5.24 the
    values too) would be kept in float32; attention casts them to the autocast dtype anyway, so
    storing them in it changes no number and halves the cache."""

    def __init__(self, length: int, dtype: torch.dtype | None, **kwargs):
        super().__init__(**kwargs)
        self.length = length  # prompt + new tokens: the most any layer holds
        self.dtype = dtype
        self.storage = {}  # layer index -> (keys, values), (B, H, length, D) each

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self.dtype is not None:
            key_states, value_states = key_states.to(self.dtype), value_states.to(self.dtype)
        new = key_states.shape[-2]
        if layer_idx not in self.storage and not self._allocate(layer_idx, new):
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        layer = self.layers[layer_idx]
        held = layer.keys.shape[-2]
        if held + new > self.length:  # longer than planned: HF's concatenation from here on
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        keys, values = self.storage[layer_idx]
        keys[:, :, held : held + new] = key_states
        values[:, :, held : held + new] = value_states
        layer.keys, layer.values = keys[:, :, : held + new], values[:, :, : held + new]
        return layer.keys, layer.values

    def _allocate(self, layer_idx: int, new: int) -> bool:
        """The layer's storage, its K and V so far copied in, when the layer already holds the
        prompt's (the first decode step) as a plain DynamicLayer and `length` fits them."""
        layer = self.layers[layer_idx]  # (made with the cache, from the model's config)
        if not layer.is_initialized:
            return False  # the prompt's pass: HF's prompt-length tensors
        held = layer.keys.shape[-2]
        if type(layer) is not transformers.DynamicLayer or held + new > self.length:
            return False
        k, v = layer.keys, layer.values  # (B, H, held, D)
        keys = k.new_empty(*k.shape[:2], self.length, k.shape[3])
        values = v.new_empty(*v.shape[:2], self.length, v.shape[3])
        keys[:, :, :held] = k
        values[:, :, :held] = v
        self.storage[layer_idx] = (keys, values)
        layer.keys, layer.values = keys[:, :, :held], values[:, :, :held]
        return True


def kv_cache(model, length: int, static: bool = False) -> dict:
    """`generate`'s KV-cache argument for sequences of up to `length` tokens: a `_KVCache` (K and V
    in the autocast dtype under autocast, else as the model computes them), or with `static`
    (rollout.static_cache) transformers' own StaticCache, with which it compiles the decode step
    on a GPU."""
    if static:
        return {"cache_implementation": "static"}
    device = next(model.parameters()).device.type
    dtype = None
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
    return {cache_kwarg(model): _KVCache(length, dtype, config=model.config)}


@contextmanager
def packed_gqa(on: bool = True):
    """While inside (and `on`), a decode step's sdpa attention runs on the KV heads: the G query
    heads that share a KV head become G query rows of it, so K and V are read as cached, never
    expanded. transformers before 5.24 expands them (`repeat_kv`: a copy of the whole cache, G
    times over, per layer and token) whenever a padding mask is given, and every version does
    inside a compiled step; at Qwen2.5-1.5B's shape (bf16) that copy is ~18 GB a step at 128 rows
    and ~800 tokens. Other steps (the prompt's, the training passes) keep transformers' sdpa."""
    if not on:
        yield
        return
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                  is_causal=None, **kwargs):
        G = getattr(module, "num_key_value_groups", 1)
        B, H, q_len, D = query.shape
        mask_per_head = attention_mask is not None and attention_mask.shape[1] != 1
        if G == 1 or q_len != 1 or mask_per_head or kwargs.get("position_bias") is not None:
            return sdpa(module, query, key, value, attention_mask, dropout=dropout,
                        scaling=scaling, is_causal=is_causal, **kwargs)
        q = query.reshape(B, H // G, G, D)  # (B, H_kv, G, D): head h reads KV head h // G
        out = F.scaled_dot_product_attention(q, key, value, attn_mask=attention_mask,
                                             dropout_p=dropout, scale=scaling)  # (B, H_kv, G, D)
        return out.reshape(B, 1, H, D), None  # (B, 1, H, D): query length 1, no transpose

    ALL_ATTENTION_FUNCTIONS["sdpa"] = attention
    try:
        yield
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa
