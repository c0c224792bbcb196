"""bench/generation_memory.py at a small size: the peak of live tensor bytes of one generation
phase with the KV cache written in place (support.kvcache.kv_cache) against HF's DynamicCache.

  python -m pytest -q tests/test_generation_memory.py        # ~30 s on 2 CPU cores
"""

import pytest

from bench.generation_memory import measure

pytestmark = pytest.mark.usefixtures("one_thread")

ROWS, LAYERS = 4, 2
# K and V of one position in every row and layer: 2 KV heads of 128 (Qwen2.5-1.5B's), bf16
POSITION = ROWS * LAYERS * 2 * 2 * 128 * 2


def test_in_place_cache_adds_nothing_to_the_generation_peak():
    """Here the prompt pass's activations (the last layer's MLP over 4 rows of 8 tokens) are
    smaller than what the cache grows in the 255 decode steps (2.0 MiB), so the peak is the last
    decode step's. Both arms hold one float32 copy of the bf16 output layer for the whole rollout
    (3.0 MiB: support.logprobs.float32_head). A cache that takes its full length in the prompt's
    pass (support.logprobs before 061eefa) holds it beside those activations: its peak is the
    prompt pass's, over HF's cache. The in-place cache is one position longer than HF's at the
    end: its length is the prompt's + the new tokens, yet the last token sampled is never fed
    back. (With prompts of 16 and 192 new tokens the prompt pass, beside the float32 output layer,
    is the peak of both arms: that size cannot tell the two caches apart by phase.)"""
    result = measure(layers=LAYERS, vocab=512, rows=ROWS, prompt_tokens=8, new_tokens=256)
    before, after = result["peaks"]["before"], result["peaks"]["after"]
    assert after.bytes <= before.bytes + POSITION, (after, before)
    assert after.phase.startswith("decode step"), after
    assert result["same_tokens"]
