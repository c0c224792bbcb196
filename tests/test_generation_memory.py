"""bench/generation.py at a small size: the peak of live tensor bytes of one generation phase with
the KV cache written in place (support.kvcache.kv_cache, the `default` arm) against HF's
DynamicCache (`dynamic`), and what --count sees each arm take away.

  python -m pytest -q tests/test_generation_memory.py        # ~1 min on 2 CPU cores
"""

import json

import pytest
import torch

from bench import cli, generation
from data.build_tiny_model import build_tokenizer
from rollout import RolloutConfig

pytestmark = pytest.mark.usefixtures("one_thread")

ROWS, LAYERS, NEW = 4, 2, 256
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
    tok = build_tokenizer()
    prompts = generation.random_prompts(len(tok), ROWS, 8, False)
    cfg = RolloutConfig(group_size=1, max_new_tokens=NEW, gen_batch_size=ROWS)
    runs = {}
    with cli.one_process(torch.device("cpu")):
        model = generation.shard(generation.qwen_like("1.5b", LAYERS, 512, "cpu"), torch.bfloat16)
        for arm in ("dynamic", "default"):
            runs[arm] = generation.one(model, tok, prompts, cfg, [], arm, "memory")
    before, after = runs["dynamic"]["peak"], runs["default"]["peak"]
    assert after["bytes"] <= before["bytes"] + POSITION, (after, before)
    assert after["phase"].startswith("decode step"), after
    assert runs["dynamic"]["tokens_sha"] == runs["default"]["tokens_sha"]
    assert runs["default"]["tokens"] == ROWS * NEW  # (no end token: every row runs all of them)


def test_each_arm_counts_what_it_takes_away(tmp_path):
    """bench/generation.py --measure step --count through its entry, arm beside arm: FSDP's
    forward hooks run during generation only in `hooks_on`; HF's DynamicCache copies K and V at
    every token (`cat`), the in-place cache does not; packed GQA never copies K and V per query
    head (`clone`; transformers before 5.24 did with a padding mask); the arms that only move
    memory sample the same tokens; each arm's figures are in --json (written as each arm ends)."""
    out = tmp_path / "gen.json"
    argv = ["--measure", "step", "--arms", "hooks_on,dynamic,default,packed", "--vocab", "512",
            "--rows", "2", "--prompt-tokens", "8", "--tokens", "2,6", "--repeats", "1", "--count",
            "--threads", "1", "--json", str(out)]
    assert generation.main(argv) == 0
    arms = json.loads(out.read_text())["arms"]
    assert arms["hooks_on"]["hooks_per_step"] > 0 == arms["default"]["hooks_per_step"]
    assert arms["default"]["cat_mb_per_step"] < arms["dynamic"]["cat_mb_per_step"]
    assert arms["packed"]["clone_mb_per_step"] < 0.01  # (transformers 5.24 copies none either)
    assert len({arm["tokens_sha"] for arm in arms.values()}) == 1
    assert all(arm["tokens_per_s"] > 0 for arm in arms.values())
