"""A whole rollout, side by side: `rollout.generate` as a run calls it, HF generate in calls of
--slots rows (`default`) against support/decode.py's loop with --slots slots refilled as rows end
(`refill`, rollout.refill), at a real model's shape with random weights, where rows end at random
lengths: a random model samples near-uniformly, so a stop set of vocab / --mean-len token ids ends
a row with probability 1 / --mean-len at each token (capped at --max-new).

HF generate runs each call until its longest row ends, the finished rows still computed; refill
gives a finished row's slot to the next row. Per arm (alternating, median over --repeats): seconds
a rollout, useful tokens/s (completion tokens sampled), row-steps (rows computed at each decode
step, summed: the work done) per useful token, and host syncs (aten's _local_scalar_dense: .item(),
bool() of a tensor) per useful token. The arms sample other draws (torch.multinomial / Gumbel-max):
their lengths differ by chance, so the per-token figures are the comparison.

  python bench/rollout_refill.py                             # 0.5b shape, 2 layers, this CPU
  python bench/rollout_refill.py --shape 1.5b --layers 0 --rows 256 --slots 128 --max-new 1024 \\
      --prompt-tokens 512 --dtype bfloat16 --device cuda --json out.json             # a GPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import rollout
from bench.decode_step import SHAPES, CountOps, qwen_like, random_prompts, sync
from data.build_tiny_model import build_tokenizer
from rollout import RolloutConfig

ARMS = ("default", "refill")


def one(model, tok, prompts: list, cfg: RolloutConfig, stop: list[int], count: bool) -> dict:
    """A rollout's seconds, useful tokens, row-steps and (if `count`) host syncs."""
    seen = []

    def rows_in(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and ids.shape[1] == 1:  # a decode step (prompt passes aside)
            seen.append(ids.shape[0])

    hook = model.register_forward_pre_hook(rows_in, with_kwargs=True)
    ops = CountOps()
    device = next(model.parameters()).device
    torch.manual_seed(0)
    try:
        sync(device)
        t0 = time.perf_counter()
        if count:
            with ops:
                out, _ = rollout.generate(model, tok, prompts, cfg, stop)
        else:
            out, _ = rollout.generate(model, tok, prompts, cfg, stop)
        sync(device)
        seconds = time.perf_counter() - t0
    finally:
        hook.remove()
    return {"seconds": seconds, "tokens": int(out.completion_len.sum()), "row_steps": sum(seen),
            "syncs": ops.calls.get("_local_scalar_dense", 0)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="0.5b", choices=list(SHAPES))
    ap.add_argument("--layers", type=int, default=2, help="decoder layers (0: the model's all)")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=64, help="rows a rollout (prompts × group)")
    ap.add_argument("--group", type=int, default=8, help="rows per prompt")
    ap.add_argument("--slots", type=int, default=16, help="rollout.gen_batch_size of both arms")
    ap.add_argument("--sync-every", type=int, default=8, help="rollout.sync_every (refill)")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--max-new", type=int, default=192)
    ap.add_argument("--mean-len", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default="", help="also write the figures here")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    tok = build_tokenizer()
    model = qwen_like(a.shape, a.layers, a.vocab, a.device).to(getattr(torch, a.dtype))
    prompts = random_prompts(len(tok), a.rows // a.group, a.prompt_tokens, ragged=True)
    stop = list(range(4, 4 + max(1, a.vocab // a.mean_len)))
    cfgs = {arm: RolloutConfig(group_size=a.group, batch_size=a.rows, max_new_tokens=a.max_new,
                               gen_batch_size=a.slots, refill=arm == "refill",
                               sync_every=a.sync_every) for arm in ARMS}
    for arm in ARMS:  # warm-up
        one(model, tok, prompts, cfgs[arm], stop, count=False)
    runs = {arm: [] for arm in ARMS}
    for _ in range(a.repeats):
        for arm in ARMS:
            runs[arm].append(one(model, tok, prompts, cfgs[arm], stop, count=False))
    layers = model.config.num_hidden_layers
    shape = f"Qwen2.5-{a.shape}-like, {layers} layers, vocabulary {a.vocab}, {a.dtype}"
    result = {"shape": shape, "rows": a.rows, "group": a.group, "slots": a.slots,
              "sync_every": a.sync_every, "prompt_tokens": a.prompt_tokens,
              "max_new": a.max_new, "mean_len": a.mean_len, "device": a.device,
              "threads": a.threads, "torch": torch.__version__,
              "transformers": sys.modules["transformers"].__version__, "repeats": a.repeats,
              "arms": {}}
    print(f"{shape}, {a.rows} rows ({a.group} a prompt), {a.slots} slots, up to {a.max_new} new "
          f"tokens (mean {a.mean_len}), {a.device}, torch {torch.__version__}, transformers "
          f"{result['transformers']}, {a.repeats} repeats")
    print(f"{'arm':<8} {'s/rollout':>10} {'tokens':>7} {'tokens/s':>9} {'row-steps/token':>16} "
          f"{'syncs/token':>12}")
    for arm in ARMS:
        counted = one(model, tok, prompts, cfgs[arm], stop, count=True)
        seconds = statistics.median(r["seconds"] for r in runs[arm])
        tokens = statistics.median(r["tokens"] for r in runs[arm])
        row = {"seconds": seconds, "tokens": tokens,
               "tokens_per_s": statistics.median(r["tokens"] / r["seconds"] for r in runs[arm]),
               "row_steps_per_token": statistics.median(r["row_steps"] / r["tokens"]
                                                        for r in runs[arm]),
               "syncs_per_token": counted["syncs"] / counted["tokens"]}
        result["arms"][arm] = row
        print(f"{arm:<8} {seconds:10.2f} {tokens:7.0f} {row['tokens_per_s']:9.0f} "
              f"{row['row_steps_per_token']:16.2f} {row['syncs_per_token']:12.3f}")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
