"""Time of one decode step, side by side: `rollout.generate`'s step in the ways a run has generated
with the HF engine, at a real model's shape (random weights):

  before     FSDP2 at world size 1, its forward hooks on during generation, HF's DynamicCache
  hooks_off  FSDP2 at world size 1 as `parallel.generation` runs it now (hooks off), HF's cache
  after      hooks off and the KV cache written in place (support.kvcache._KVCache): today's path
  static     as after with rollout.static_cache: transformers' StaticCache, and on a GPU the
             decode step compiled (torch.compile, CUDA graphs); --compile-anywhere: compiled on
             this device too (transformers' compile config for every device), which proves the
             path a GPU takes on a CPU
  packed     as after with rollout.pack_gqa: a decode step's attention on the KV heads, K and V
             never expanded per query head (support.kvcache.packed_gqa)
  static_packed  static and packed together
  refill     as after with rollout.refill: support/decode.py's own loop (slots, a fixed-size
             cache, Gumbel-max draws, the host reading the device every rollout.sync_every steps)
  refill_packed  refill and packed together
  plain      one process, no FSDP, today's cache

  python bench/decode_step.py                    # 0.5b shape, 2 layers, 4 rows: the CPU default
  python bench/decode_step.py --vocab 4096       # a small head: the step's host overhead shows
  python bench/decode_step.py --shape 1.5b --layers 0 --rows 128 --prompt-tokens 512 \
      --tokens 32,288 --dtype bfloat16 --device cuda --repeats 1 --json out.json   # a GPU

A decode step's time is (time for T2 new tokens - time for T1) / (T2 - T1), so the prompt's pass
cancels (and, warmed up, compilation); the arms alternate within each repeat and the median is
reported, with useful tokens/s = rows / step time. Per decode step, also: "ops" the aten operators
dispatched that compute (a TorchDispatchMode; views aside, which launch no kernel; on a GPU each
of the others is a kernel launch; counted eagerly, so not for `static`), "cat MB" the bytes
`cat` writes (HF's cache copies every layer's K and V at every token), "clone MB" the bytes
`clone` writes (transformers' `repeat_kv` copies K and V per query head), "syncs" the device
reads the host waits for (`.item()`, `bool()` of a tensor: aten's _local_scalar_dense; a GPU
idles at each), "hooks" FSDP's
forward-hook events (torch's profiler). Prompts are random token ids (--ragged: of several
lengths, so left padding and a mask, as in training), no end token: every row runs T tokens.
bf16: FSDP's mixed-precision policy (float32 masters), autocast for `plain`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, Qwen2Config

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import rollout
from bench import cli
from data.build_tiny_model import build_tokenizer
from rollout import RolloutConfig
from support import parallel

ARMS = ("before", "hooks_off", "after", "packed", "static", "static_packed", "refill",
        "refill_packed", "plain")
SHARDED = ARMS[:-1]  # (plain: one process, no FSDP)
SHAPES = {  # hidden, heads, KV heads, MLP, layers (Qwen2.5's configs)
    "0.5b": (896, 14, 2, 4864, 24),
    "1.5b": (1536, 12, 2, 8960, 28),
}


class CountOps(TorchDispatchMode):
    """Counts the aten operators dispatched inside it: those that compute (`n`, views aside: no
    kernel), each operator's calls by name (`calls`), and the bytes `cat` and `clone` write
    (`clone`: what reshaping an expanded tensor copies, as transformers' `repeat_kv` does)."""

    def __init__(self):
        super().__init__()
        self.n = 0
        self.calls = {}
        self.cat_bytes = 0
        self.clone_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        self.n += not func.is_view
        self.calls[name] = self.calls.get(name, 0) + 1
        if name == "cat":
            self.cat_bytes += out.numel() * out.element_size()
        if name == "clone":
            self.clone_bytes += out.numel() * out.element_size()
        return out


def qwen_like(shape: str, layers: int, vocab: int, device: str) -> torch.nn.Module:
    """Qwen2.5's `shape` with `layers` decoder layers (0: all), random weights, float32."""
    hidden, heads, kv_heads, mlp, all_layers = SHAPES[shape]
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp,
                      num_hidden_layers=layers or all_layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, max_position_embeddings=32768,
                      tie_word_embeddings=shape == "0.5b")
    with torch.device(device):
        return AutoModelForCausalLM.from_config(cfg).eval()


def shard(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """FSDP2 as support/models.py shards it: a unit per decoder layer, then the root."""
    bf16 = dtype == torch.bfloat16
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None,
                              reduce_dtype=torch.float32)
    for unit in model.modules():
        if type(unit).__name__ in model._no_split_modules:
            fully_shard(unit, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def keep_hooks_on(module) -> dict:
    """`parallel._forward_hooks_off` that takes nothing off: generation as it ran before."""
    return {}


def hf_cache(model, length: int, static: bool = False) -> dict:
    """`rollout.kv_cache` as before: no cache given, so `generate` makes HF's DynamicCache."""
    return {}


def random_prompts(vocab: int, rows: int, tokens: int, ragged: bool) -> list[list[int]]:
    """`rows` prompts of `tokens` random ids from 4 to `vocab` - 1 (seed 0); with `ragged` each cut
    to a random length from half of `tokens` to all of them."""
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(4, vocab, (rows, tokens), generator=g).tolist()
    if ragged:
        lengths = torch.randint(tokens // 2, tokens + 1, (rows,), generator=g)
        prompts = [p[:n] for p, n in zip(prompts, lengths.tolist())]
    return prompts


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def compiled_everywhere(model, length: int, static: bool = False) -> dict:
    """`rollout.kv_cache` with static=True, plus transformers' compile config for every device
    (`generate` compiles the decode step on a GPU only, unless told)."""
    from transformers import CompileConfig

    config = CompileConfig()
    config._compile_all_devices = True
    return {"cache_implementation": "static", "compile_config": config}


@contextmanager
def generating_as(arm: str, anywhere: bool = False):
    """`parallel.generation` and `rollout.generate` as `arm` runs them, while inside: FSDP's hooks
    on (`before`), HF's DynamicCache (`before`, `hooks_off`), the compile config for every device
    (`static*` with `anywhere`). The static cache and packed attention are RolloutConfig's."""
    real = parallel._forward_hooks_off, rollout.kv_cache
    if arm == "before":
        parallel._forward_hooks_off = keep_hooks_on
    if arm in ("before", "hooks_off"):
        rollout.kv_cache = hf_cache
    if arm.startswith("static") and anywhere:
        rollout.kv_cache = compiled_everywhere
    try:
        yield
    finally:
        parallel._forward_hooks_off, rollout.kv_cache = real


def one(model, tok, prompts: list, new_tokens: int, arm: str, compute, count: bool,
        anywhere: bool = False) -> tuple:
    """(seconds, aten ops, bytes `cat` wrote, FSDP forward-hook events, bytes `clone` wrote, host
    syncs) of one `generate`."""
    cfg = RolloutConfig(group_size=1, max_new_tokens=new_tokens, gen_batch_size=len(prompts),
                        static_cache=arm.startswith("static"), pack_gqa=arm.endswith("packed"),
                        refill=arm.startswith("refill"))
    ops, hooks = CountOps(), 0
    device = next(model.parameters()).device
    with generating_as(arm, anywhere):
        torch.manual_seed(0)
        with parallel.generation(model, compute):
            if not count:
                sync(device)
                t0 = time.perf_counter()
                rollout.generate(model, tok, prompts, cfg, [])
                sync(device)
                return time.perf_counter() - t0, 0, 0, 0, 0, 0
            activities = [torch.profiler.ProfilerActivity.CPU]
            with torch.profiler.profile(activities=activities) as prof, ops:
                rollout.generate(model, tok, prompts, cfg, [])
            for event in prof.events():
                hooks += event.name.startswith("FSDP::") and "forward" in event.name
    syncs = ops.calls.get("_local_scalar_dense", 0)
    return 0.0, ops.n, ops.cat_bytes, hooks, ops.clone_bytes, syncs


def main(argv: list[str] | None = None) -> int:
    ap = cli.Parser(__file__, __doc__)
    ap.add_argument("--shape", default="0.5b", choices=list(SHAPES))
    ap.add_argument("--layers", type=cli.count, default=2,
                    help="decoder layers (0: the model's all)")
    ap.add_argument("--vocab", type=cli.positive_int, default=151936)
    ap.add_argument("--rows", type=cli.positive_int, default=4)
    ap.add_argument("--prompt-tokens", type=cli.positive_int, default=16)
    ap.add_argument("--ragged", action="store_true",
                    help="prompts of 1/2 to all of --prompt-tokens (left padding: a mask, as in "
                    "training), not all of one length")
    ap.add_argument("--tokens", type=token_pair, default="16,96", help="T1,T2 new tokens")
    ap.add_argument("--repeats", type=cli.positive_int, default=3)
    ap.add_argument("--arms", type=cli.names(ARMS), default=",".join(ARMS))
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", type=cli.device, default="cpu")
    ap.add_argument("--threads", type=cli.positive_int, default=2)
    ap.add_argument("--no-count", action="store_true", help="skip the op and hook counts")
    ap.add_argument("--compile-anywhere", action="store_true",
                    help="static: compile the decode step on this device too (a CPU)")
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --json file")
    a = ap.parse_args(argv)
    ap.check_file("--json", a.json, a.overwrite)
    if a.ragged and a.prompt_tokens < 2:
        ap.error("--ragged needs --prompt-tokens ≥ 2 (a prompt of half of them is not empty)")
    fault = cli.tokenizer_fault(a.vocab)
    if fault:
        ap.error(f"--vocab {a.vocab} {fault}")
    t1, t2 = a.tokens
    arms = a.arms
    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    torch.set_num_threads(a.threads)
    store = tempfile.NamedTemporaryFile(prefix="decode_step_")
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{store.name}", rank=0, world_size=1)
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)  # "cuda" names no index
    tok = build_tokenizer()
    prompts = random_prompts(len(tok), a.rows, a.prompt_tokens, a.ragged)
    models, compute = {}, {}
    if set(SHARDED) & set(arms):
        sharded = shard(qwen_like(a.shape, a.layers, a.vocab, a.device), dtype)
        models = dict.fromkeys(SHARDED, sharded)
        compute = dict.fromkeys(models, nullcontext())
    if "plain" in arms:
        models["plain"] = qwen_like(a.shape, a.layers, a.vocab, a.device)
        compute["plain"] = nullcontext()
        if dtype == torch.bfloat16:
            compute["plain"] = torch.autocast(device.type, dtype=torch.bfloat16)
    step = {arm: [] for arm in arms}
    failed = {}
    # warm-up; the static arm at both lengths: its cache's shape is the prompt + T, so it compiles
    # (and captures its CUDA graphs) for T1 and for T2 here, not while timed
    for arm in list(arms):  # a failure: its line, and the other arms go on
        lengths = (t2,)
        if arm.startswith("static"):
            lengths = (t1, t2)
        try:
            for t in lengths:
                one(models[arm], tok, prompts, t, arm, compute[arm], False, a.compile_anywhere)
        except Exception as e:
            failed[arm] = f"{type(e).__name__}: {str(e)[:300]}"
            arms.remove(arm)
            print(f"{arm}: failed: {failed[arm]}", flush=True)
    for _ in range(a.repeats):
        for arm in arms:
            short = one(models[arm], tok, prompts, t1, arm, compute[arm], False,
                        a.compile_anywhere)[0]
            long = one(models[arm], tok, prompts, t2, arm, compute[arm], False,
                       a.compile_anywhere)[0]
            step[arm].append((long - short) / (t2 - t1))
    layers = next(iter(models.values())).config.num_hidden_layers
    shape = f"Qwen2.5-{a.shape}-like, {layers} layers, vocabulary {a.vocab}, {a.dtype}"
    result = {"shape": shape, "rows": a.rows, "prompt_tokens": a.prompt_tokens,
              "ragged": a.ragged,
              "tokens": [t1, t2], "device": str(device), "threads": a.threads,
              "torch": torch.__version__, "transformers": sys.modules["transformers"].__version__,
              "repeats": a.repeats, "arms": {}, "failed": failed,
              "compiled_graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"]}
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name()
    print(f"{shape}, {a.rows} rows, prompts of {a.prompt_tokens}, {device}, torch "
          f"{torch.__version__}, transformers {result['transformers']}, {a.repeats} repeats")
    print(f"{'arm':<13} {'ms/step':>8} {'range':>15} {'tokens/s':>9} {'ops':>7} {'cat MB':>8} "
          f"{'hooks':>6} {'clone MB':>9} {'syncs':>6}")
    for arm in arms:
        ms = [1000 * s for s in step[arm]]
        row = {"ms_per_step": statistics.median(ms), "min": min(ms), "max": max(ms),
               "tokens_per_s": a.rows / statistics.median(step[arm])}
        counted = "  (not counted)"
        # (counted eagerly: a compiled step is not)
        if not a.no_count and not arm.startswith("static"):
            counts = [one(models[arm], tok, prompts, t, arm, compute[arm], True) for t in (t1, t2)]
            row["ops_per_step"] = (counts[1][1] - counts[0][1]) / (t2 - t1)
            row["cat_mb_per_step"] = (counts[1][2] - counts[0][2]) / (t2 - t1) / 2**20
            row["hooks_per_step"] = (counts[1][3] - counts[0][3]) / (t2 - t1)
            row["clone_mb_per_step"] = (counts[1][4] - counts[0][4]) / (t2 - t1) / 2**20
            row["syncs_per_step"] = (counts[1][5] - counts[0][5]) / (t2 - t1)
            counted = (f" {row['ops_per_step']:7.1f} {row['cat_mb_per_step']:8.3f} "
                       f"{row['hooks_per_step']:6.1f} {row['clone_mb_per_step']:9.3f} "
                       f"{row['syncs_per_step']:6.2f}")
        result["arms"][arm] = row
        print(f"{arm:<13} {row['ms_per_step']:8.2f} {row['min']:7.2f}-{row['max']:<7.2f} "
              f"{row['tokens_per_s']:9.0f}{counted}")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
    dist.destroy_process_group()
    return 0


def token_pair(text: str) -> tuple[int, int]:
    """--tokens T1,T2: two lengths, 1 ≤ T1 < T2 (a step's time is their difference's share)."""
    parts = text.split(",")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"must be T1,T2, got {text!r}")
    t1, t2 = map(cli.positive_int, parts)
    if t1 >= t2:
        raise argparse.ArgumentTypeError(f"must be T1,T2 with T1 < T2, got {text}")
    return t1, t2


if __name__ == "__main__":
    sys.exit(main())
