"""A whole rollout, side by side: `rollout.generate` as a run calls it, at a real model's shape
with random weights, where rows end at random lengths (a random model samples near-uniformly, so
a stop set of vocab / --mean-len token ids ends a row with probability 1 / --mean-len at each
token, capped at --max-new). Arms, each with gen_batch_size --slots:

  default        HF generate in calls of --slots rows (today's path)
  static         the same with rollout.static_cache and rollout.pack_gqa (transformers compiles
                 the decode step on a GPU: CUDA graphs)
  refill         rollout.refill: support/decode.py's --slots slots, a row that ends freeing its
                 slot for the next, the host reading the device every --sync-every steps
  refill_static  refill with rollout.static_cache and rollout.pack_gqa: its step compiled (CUDA
                 graphs on a GPU)

HF generate runs each call until its longest row ends, the finished rows still computed; refill
gives a finished row's slot to the next row, so with more rows than slots its steps follow the
total tokens. Per arm (alternating, median over --repeats; a compiled arm first compiles in an
untimed rollout of --slots rows): seconds a rollout, useful tokens/s (completion tokens sampled),
row-steps (rows computed at each decode step, summed: the work done) per useful token and, unless
--no-count, host syncs (aten's _local_scalar_dense: .item(), bool() of a tensor) per useful
token, counted eagerly. The arms draw differently (torch.multinomial / Gumbel-max): their lengths
differ by chance, so the per-token figures are the comparison.

  python bench/rollout_refill.py --arms default,refill           # 0.5b shape, 2 layers, a CPU
  python bench/rollout_refill.py --shape 1.5b --layers 0 --rows 512 --slots 128 --max-new 1024 \
      --mean-len 256 --prompt-tokens 512 --dtype bfloat16 --device cuda --repeats 1 --no-count \
      --arms static,refill_static --json out.json                                   # a GPU
"""

from __future__ import annotations

import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import rollout
from bench import cli
from bench.decode_step import SHAPES, CountOps, compiled_everywhere, qwen_like, random_prompts, sync
from data.build_tiny_model import build_tokenizer
from rollout import RolloutConfig
from support import decode

ARMS = ("default", "static", "refill", "refill_static")


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


def static_anywhere(eager_cache, model, length: int, static: bool = False) -> dict:
    """`rollout.kv_cache`, transformers' compile config for every device when `static`."""
    if static:
        return compiled_everywhere(model, length, static)
    return eager_cache(model, length, static)


def main(argv: list[str] | None = None) -> int:
    ap = cli.Parser(__file__, __doc__)
    ap.add_argument("--shape", default="0.5b", choices=list(SHAPES))
    ap.add_argument("--layers", type=cli.count, default=2,
                    help="decoder layers (0: the model's all)")
    ap.add_argument("--vocab", type=cli.positive_int, default=4096)
    ap.add_argument("--rows", type=cli.positive_int, default=64,
                    help="rows a rollout (prompts × group)")
    ap.add_argument("--group", type=cli.positive_int, default=8, help="rows per prompt")
    ap.add_argument("--slots", type=cli.positive_int, default=16,
                    help="rollout.gen_batch_size of both arms")
    ap.add_argument("--sync-every", type=cli.positive_int, default=8,
                    help="rollout.sync_every (refill)")
    ap.add_argument("--prompt-tokens", type=cli.positive_int, default=32)
    ap.add_argument("--max-new", type=cli.positive_int, default=192)
    ap.add_argument("--mean-len", type=cli.positive_int, default=48)
    ap.add_argument("--repeats", type=cli.positive_int, default=3)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", type=cli.device, default="cpu")
    ap.add_argument("--threads", type=cli.positive_int, default=2)
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --json file")
    ap.add_argument("--arms", type=cli.names(ARMS), default=",".join(ARMS))
    ap.add_argument("--no-count", action="store_true", help="skip the host sync counts")
    ap.add_argument("--same-length", action="store_true", help="every prompt --prompt-tokens long "
                    "(default: 1/2 to all of it): HF's static arm then compiles for one shape")
    ap.add_argument("--compile-anywhere", action="store_true",
                    help="the static arms compile on this device too (a CPU's dry run)")
    a = ap.parse_args(argv)
    ap.check_file("--json", a.json, a.overwrite)
    if a.rows % a.group:
        ap.error(f"--rows {a.rows} is not a multiple of --group {a.group} (whole prompts)")
    if not a.same_length and a.prompt_tokens < 2:
        ap.error("--prompt-tokens must be ≥ 2 unless --same-length (prompts of half of them)")
    fault = cli.tokenizer_fault(a.vocab)
    if fault:
        ap.error(f"--vocab {a.vocab} {fault}")
    arms = a.arms
    torch.set_num_threads(a.threads)
    if a.compile_anywhere:  # the static arms compile on this device too
        eager_cache = rollout.kv_cache
        rollout.kv_cache = functools.partial(static_anywhere, eager_cache)
        decode.COMPILE_ANYWHERE = True
    tok = build_tokenizer()
    model = qwen_like(a.shape, a.layers, a.vocab, a.device).to(getattr(torch, a.dtype))
    prompts = random_prompts(len(tok), a.rows // a.group, a.prompt_tokens, not a.same_length)
    stop = list(range(4, 4 + max(1, a.vocab // a.mean_len)))
    cfgs = {}
    for arm in arms:
        static = arm.endswith("static")
        cfgs[arm] = RolloutConfig(group_size=a.group, batch_size=a.rows, max_new_tokens=a.max_new,
                                  gen_batch_size=a.slots, refill=arm.startswith("refill"),
                                  sync_every=a.sync_every, static_cache=static, pack_gqa=static)
    first = {}
    for arm in arms:  # warm-up: a compiled arm compiles here, on --slots rows
        t0 = time.perf_counter()
        one(model, tok, prompts[: max(1, a.slots // a.group)], cfgs[arm], stop, count=False)
        first[arm] = time.perf_counter() - t0
    runs = {arm: [] for arm in arms}
    for _ in range(a.repeats):
        for arm in arms:
            runs[arm].append(one(model, tok, prompts, cfgs[arm], stop, count=False))
    layers = model.config.num_hidden_layers
    shape = f"Qwen2.5-{a.shape}-like, {layers} layers, vocabulary {a.vocab}, {a.dtype}"
    result = {"shape": shape, "rows": a.rows, "group": a.group, "slots": a.slots,
              "sync_every": a.sync_every, "prompt_tokens": a.prompt_tokens,
              "max_new": a.max_new, "mean_len": a.mean_len, "device": a.device,
              "threads": a.threads, "torch": torch.__version__,
              "transformers": sys.modules["transformers"].__version__, "repeats": a.repeats,
              "arms": {}}
    if torch.cuda.is_available() and a.device.startswith("cuda"):
        result["gpu"] = torch.cuda.get_device_name()
    print(f"{shape}, {a.rows} rows ({a.group} a prompt), {a.slots} slots, up to {a.max_new} new "
          f"tokens (mean {a.mean_len}), {a.device}, torch {torch.__version__}, transformers "
          f"{result['transformers']}, {a.repeats} repeats")
    print(f"{'arm':<14} {'s/rollout':>10} {'tokens':>7} {'tokens/s':>9} {'row-steps/token':>16} "
          f"{'syncs/token':>12} {'first s':>8}")
    for arm in arms:
        seconds = statistics.median(r["seconds"] for r in runs[arm])
        tokens = statistics.median(r["tokens"] for r in runs[arm])
        row = {"seconds": seconds, "tokens": tokens,
               "tokens_per_s": statistics.median(r["tokens"] / r["seconds"] for r in runs[arm]),
               "row_steps_per_token": statistics.median(r["row_steps"] / r["tokens"]
                                                        for r in runs[arm]),
               "first_seconds": first[arm]}
        syncs = "-"
        if not a.no_count and not arm.endswith("static"):  # (counted eagerly)
            counted = one(model, tok, prompts, cfgs[arm], stop, count=True)
            row["syncs_per_token"] = counted["syncs"] / counted["tokens"]
            syncs = f"{row['syncs_per_token']:.3f}"
        result["arms"][arm] = row
        print(f"{arm:<14} {seconds:10.2f} {tokens:7.0f} {row['tokens_per_s']:9.0f} "
              f"{row['row_steps_per_token']:16.2f} {syncs:>12} {first[arm]:8.1f}")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
