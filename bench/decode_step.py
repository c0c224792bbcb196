"""Host time of one decode step, side by side: `rollout.generate`'s step at a Qwen2.5-0.5B-like
shape with few layers (hidden 896, 14 heads, 2 KV heads, MLP 4864, vocabulary 151,936), float32,
on this machine, in the three ways a run generates with the HF engine:

  plain        one process, no FSDP (the module as loaded)
  fsdp_hooks   FSDP2 at world size 1 with its forward hooks on during generation (before)
  fsdp         FSDP2 at world size 1 as `parallel.generation` runs it now (hooks off)

  python bench/decode_step.py                  # 2 layers, 8 rows, 16 and 48 new tokens, 5 repeats
  python bench/decode_step.py --layers 4 --rows 32 --json bench/results/decode_step.json

A decode step's time is (time for T2 new tokens - time for T1) / (T2 - T1), so the prompt's pass
cancels; the arms alternate within each repeat and the median is reported. "ops/step" counts the
aten operators dispatched per decode step (a TorchDispatchMode, each kernel launch on a GPU one
of them), "hooks/step" the FSDP forward-hook events (torch's profiler). On a CPU the step's
compute is real work too, so the difference between arms is the host overhead removed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, Qwen2Config

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from data.build_tiny_model import build_tokenizer
from rollout import RolloutConfig, generate
from support import parallel

ARMS = ("plain", "fsdp_hooks", "fsdp")


class CountOps(TorchDispatchMode):
    """Counts the aten operators dispatched inside it."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def qwen05_like(layers: int, seed: int = 0) -> torch.nn.Module:
    """Qwen2.5-0.5B's shape with `layers` decoder layers, randomly initialised, tied head."""
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                      num_hidden_layers=layers, num_attention_heads=14, num_key_value_heads=2,
                      max_position_embeddings=4096, tie_word_embeddings=True)
    return AutoModelForCausalLM.from_config(cfg).eval()


def shard(model: torch.nn.Module) -> torch.nn.Module:
    """FSDP2 as support/models.py shards it: a unit per decoder layer, then the root."""
    for unit in model.modules():
        if type(unit).__name__ in model._no_split_modules:
            fully_shard(unit)
    fully_shard(model)
    return model


def keep_hooks_on(module) -> dict:
    """`parallel._forward_hooks_off` that takes nothing off: generation as it ran before."""
    return {}


def one(model, tok, prompts: list, new_tokens: int, arm: str, count: bool) -> tuple:
    """(seconds, aten ops, FSDP forward-hook events) of one `generate` of `new_tokens`."""
    cfg = RolloutConfig(group_size=1, max_new_tokens=new_tokens, gen_batch_size=len(prompts))
    real = parallel._forward_hooks_off
    if arm == "fsdp_hooks":
        parallel._forward_hooks_off = keep_hooks_on
    ops, hooks = CountOps(), 0
    try:
        torch.manual_seed(0)
        with parallel.generation(model, parallel.nullcontext()):
            if not count:
                t0 = time.perf_counter()
                generate(model, tok, prompts, cfg, [])
                return time.perf_counter() - t0, 0, 0
            activities = [torch.profiler.ProfilerActivity.CPU]
            with torch.profiler.profile(activities=activities) as prof, ops:
                generate(model, tok, prompts, cfg, [])
            for event in prof.events():
                hooks += event.name.startswith("FSDP::") and "forward" in event.name
    finally:
        parallel._forward_hooks_off = real
    return 0.0, ops.n, hooks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", default="16,48", help="T1,T2 new tokens")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default="", help="also write the figures here")
    a = ap.parse_args(argv)
    t1, t2 = map(int, a.tokens.split(","))
    torch.set_num_threads(a.threads)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    store = tempfile.NamedTemporaryFile(prefix="decode_step_")
    dist.init_process_group("gloo", init_method=f"file://{store.name}", rank=0, world_size=1)
    tok = build_tokenizer()
    prompts = [tok(f"{i} + {i * 7} - {i * 3} =")["input_ids"] for i in range(a.rows)]
    models = {"plain": qwen05_like(a.layers), "fsdp": shard(qwen05_like(a.layers))}
    models["fsdp_hooks"] = models["fsdp"]
    step = {arm: [] for arm in ARMS}
    for arm in ARMS:  # warm-up
        one(models[arm], tok, prompts, t1, arm, False)
    for _ in range(a.repeats):
        for arm in ARMS:
            short = one(models[arm], tok, prompts, t1, arm, False)[0]
            long = one(models[arm], tok, prompts, t2, arm, False)[0]
            step[arm].append((long - short) / (t2 - t1))
    result = {"shape": f"Qwen2.5-0.5B-like, {a.layers} layers, float32", "rows": a.rows,
              "tokens": [t1, t2], "threads": a.threads, "torch": torch.__version__,
              "transformers": sys.modules["transformers"].__version__, "arms": {}}
    print(f"{result['shape']}, {a.rows} rows, torch {torch.__version__}, "
          f"transformers {result['transformers']}, {a.threads} threads, {a.repeats} repeats")
    print(f"{'arm':<11} {'ms/step':>8} {'range':>15} {'ops/step':>9} {'hooks/step':>11}")
    for arm in ARMS:
        _, ops1, hooks1 = one(models[arm], tok, prompts, t1, arm, True)
        _, ops2, hooks2 = one(models[arm], tok, prompts, t2, arm, True)
        ms = [1000 * s for s in step[arm]]
        row = {"ms_per_step": statistics.median(ms), "min": min(ms), "max": max(ms),
               "ops_per_step": (ops2 - ops1) / (t2 - t1),
               "hooks_per_step": (hooks2 - hooks1) / (t2 - t1)}
        result["arms"][arm] = row
        print(f"{arm:<11} {row['ms_per_step']:8.2f} {row['min']:7.2f}-{row['max']:<7.2f} "
              f"{row['ops_per_step']:9.1f} {row['hooks_per_step']:11.1f}")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
