"""Generation, side by side: `rollout.generate` as a run calls it, at a real model's shape with
random weights, in each way this codebase generates (arms), on one workload. The model is sharded
by FSDP2 at world size 1 as a run shards it (with --dtype bfloat16: bf16 compute over float32
masters), and `parallel.generation` gathers its weights for the phase.

Arms (a comma list; the first is measured first):
  default        today's path: HF generate, the KV cache written in place (support/kvcache.py)
  dynamic        HF's DynamicCache instead: generation before support/kvcache.py
  hooks_on       dynamic with FSDP's forward hooks left on: before parallel.generation took them off
  packed         rollout.pack_gqa: a decode step's attention on the KV heads, K and V not expanded
  static         rollout.static_cache: transformers' StaticCache, the decode step compiled on a GPU
  static_packed  static and packed
  refill         rollout.refill: support/decode.py's slots, a row that ends freeing its slot for
                 the next, the host reading the device every --sync-every steps
  refill_static  refill with static_cache and pack_gqa: the slots' step compiled on a GPU

What is timed (--measure):
  rollout  a whole rollout of --rows rows (--group a prompt), --slots at a time
           (rollout.gen_batch_size). Rows end at random lengths: a random model samples
           near-uniformly, so a stop set of vocab / --mean-len ids ends a row with probability
           1 / --mean-len at each token, up to --max-new. Per arm: seconds, useful tokens/s
           (completion tokens sampled) and row-steps (rows computed at a decode step, summed)
           per useful token. HF generate runs each call until its longest row ends; refill gives
           an ended row's slot to the next, so its steps follow the total tokens.
  step     one decode step of --rows rows: no end token, every row runs T new tokens, and a step
           is (seconds for T2 - seconds for T1) / (T2 - T1): the prompt's pass cancels.
Per arm also: the warm-up's seconds and what torch compiled in it (a compiled arm compiles there,
on --slots rows), and the compile counters of the timed runs (a recompile or a CUDA-graph
re-record while timed shows there). Options:
  --count   per useful token (step: per step): aten ops that compute, MB `cat` and `clone` write
            (HF's cache copies K and V at every token; `repeat_kv` copies them per query head),
            host syncs (aten's _local_scalar_dense) and FSDP forward-hook events, counted eagerly
            in one more, untimed run (not for a compiled arm)
  --memory  the peak of one more, untimed run: on a GPU torch.cuda.max_memory_allocated; on a
            CPU the most live tensor bytes, the phase where they peak and what holds them then
The arms alternate within each of --repeats; medians are reported. An arm that fails is its
error line and the others go on. Each arm's figures reach --json the moment they are measured.

  python bench/generation.py --arms default,refill                    # a CPU: 2 layers, 0.5b
  python bench/generation.py --measure step --vocab 4096 --count       # the host's overhead
  python bench/generation.py --measure step --arms dynamic,default --memory --vocab 512 \
      --rows 4 --prompt-tokens 8 --tokens 128,256                     # the cache's memory
  python bench/generation.py --shape 1.5b --layers 0 --rows 256 --slots 128 --max-new 1024 \
      --mean-len 256 --prompt-tokens 512 --same-length --dtype bfloat16 --device cuda \
      --repeats 1 --arms refill_static,static_packed,default --json out.json    # a GPU
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import statistics
import sys
import time
import weakref
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
import transformers
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import AutoModelForCausalLM, CompileConfig, Qwen2Config

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import rollout
from bench import cli
from data.build_tiny_model import build_tokenizer
from rollout import RolloutConfig
from support import decode, parallel
from support.kvcache import cache_kwarg
from support.parallel import hf_module

ARMS = ("default", "dynamic", "hooks_on", "packed", "static", "static_packed", "refill",
        "refill_static")
SHAPES = {  # hidden, heads, KV heads, MLP, layers (Qwen2.5's configs)
    "0.5b": (896, 14, 2, 4864, 24),
    "1.5b": (1536, 12, 2, 8960, 28),
}
MiB = 2**20
COUNTS = ("ops", "cat_mb", "clone_mb", "syncs", "hooks")  # --count's figures, per run
# the model part a storage belongs to: the innermost running module with one of these names
PARTS = {"mlp": "MLP", "self_attn": "attention", "rotary_emb": "attention",
         "lm_head": "output layer"}


# ------------------------------------------------------------------------------ the model, arms
def qwen_like(shape: str, layers: int, vocab: int, device: str) -> torch.nn.Module:
    """Qwen2.5's `shape` with `layers` decoder layers (0: all), random weights (seed 0), float32."""
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
    param_dtype = None
    if dtype == torch.bfloat16:
        param_dtype = torch.bfloat16
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for unit in model.modules():
        if type(unit).__name__ in model._no_split_modules:
            fully_shard(unit, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def random_prompts(vocab: int, rows: int, tokens: int, ragged: bool) -> list[list[int]]:
    """`rows` prompts of `tokens` random ids from 4 to `vocab` - 1 (seed 0); with `ragged` each cut
    to a random length from half of `tokens` to all of them (left padding: a mask)."""
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(4, vocab, (rows, tokens), generator=g).tolist()
    if ragged:
        lengths = torch.randint(tokens // 2, tokens + 1, (rows,), generator=g)
        prompts = [p[:n] for p, n in zip(prompts, lengths.tolist())]
    return prompts


def nothing(*args) -> dict:
    """Generation as it ran before parallel.generation and support/kvcache.py: no forward hook
    taken off (`parallel._forward_hooks_off`), no cache given (`rollout.kv_cache`: HF makes a
    DynamicCache)."""
    return {}


def compiled_everywhere(eager, model, length: int, static: bool = False) -> dict:
    """`rollout.kv_cache` (`eager`), with transformers' compile config for every device when
    `static` (it compiles the static decode step on a GPU only, unless told)."""
    if not static:
        return eager(model, length, static)
    config = CompileConfig()
    config._compile_all_devices = True
    return {"cache_implementation": "static", "compile_config": config}


@contextmanager
def generating_as(arm: str):
    """`parallel.generation` and `rollout.generate` as `arm` runs them, while inside: FSDP's hooks
    kept on (`hooks_on`), HF's DynamicCache (`dynamic`, `hooks_on`). The static cache, packed
    attention and refill are RolloutConfig's (`settings`)."""
    real = parallel._forward_hooks_off, rollout.kv_cache
    if arm == "hooks_on":
        parallel._forward_hooks_off = nothing
    if arm in ("dynamic", "hooks_on"):
        rollout.kv_cache = nothing
    try:
        yield
    finally:
        parallel._forward_hooks_off, rollout.kv_cache = real


def settings(arm: str) -> dict:
    """The RolloutConfig fields `arm` sets."""
    static = arm in ("static", "static_packed", "refill_static")
    packed = arm in ("packed", "static_packed", "refill_static")
    return {"static_cache": static, "pack_gqa": packed, "refill": arm.startswith("refill")}


# -------------------------------------------------------------------------------------- counting
class CountOps(TorchDispatchMode):
    """Counts the aten operators dispatched inside it: those that compute (`n`, views aside: no
    kernel), each operator's calls by name (`calls`), and the bytes `cat` and `clone` write."""

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


class LiveBytes(TorchDispatchMode):
    """The bytes of every storage an aten operator returned that is still alive (a
    weakref.finalize takes them off when it is freed), their peak, the phase it fell in and what
    held them then, by the innermost model part running when each storage was made."""

    def __init__(self, model):
        super().__init__()
        self.names = {}  # module -> its name in the HF model
        for name, module in hf_module(model).named_modules():
            self.names[module] = name or "model"
        self.running = []  # names of the modules running, innermost last
        self.live = {}  # id(storage) -> (bytes, category)
        self.total = 0
        self.forwards = 0  # the model's forward calls so far: the first is the prompt's pass
        self.cache = None  # the KV cache generate hands the model
        self.peak = {"bytes": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.add(t.untyped_storage(), self.category(), func.overloadpacket.__name__)
        return out

    def category(self) -> str:
        for name in reversed(self.running):
            part = PARTS.get(name.rsplit(".", 1)[-1])
            if part is not None:
                return part
        if self.running:
            return "hidden states, norms"
        return "outside the model"

    def add(self, storage, category: str, op: str) -> None:
        key = id(storage)
        if key in self.live:
            return
        self.live[key] = (storage.nbytes(), category)
        self.total += storage.nbytes()
        weakref.finalize(storage, self.free, key)
        if self.total > self.peak["bytes"]:
            self.peak = {"bytes": self.total, "phase": self.phase(), "op": op, "held": self.held()}

    def phase(self) -> str:
        if self.forwards == 0:
            return "generate's set-up"
        if self.forwards == 1:
            return "the prompt pass"
        return f"decode step {self.forwards - 1}"

    def count_weights(self, model) -> None:
        """Counts the weights FSDP gathered (whole until the phase ends) from here on: their
        storages were made outside this mode. The peak starts here."""
        for p in model.parameters():
            storage = p.untyped_storage()
            self.add(storage, "gathered weights", "unshard")
            self.live[id(storage)] = (storage.nbytes(), "gathered weights")
        self.peak = {"bytes": 0}

    def free(self, key: int) -> None:
        self.total -= self.live.pop(key)[0]

    def held(self) -> dict:
        """Live MiB by category; the KV cache's K and V (views of its storage) as the cache."""
        cache = set()
        for layer in getattr(self.cache, "layers", []):
            for t in (layer.keys, layer.values):
                if isinstance(t, torch.Tensor):
                    cache.add(id(t.untyped_storage()))
        held = {}
        for key, (n, category) in self.live.items():
            if key in cache:
                category = "KV cache"
            held[category] = held.get(category, 0) + n / MiB
        return held


@contextmanager
def tracking(model, live: LiveBytes):
    """`live` told which module runs (global module hooks) and which cache the model is given."""
    hf = hf_module(model)
    cache = cache_kwarg(model)

    def enter(module, args):
        if module is hf:
            live.forwards += 1
        if module in live.names:
            live.running.append(live.names[module])

    def leave(module, args, out):
        if module in live.names:
            live.running.pop()

    def keep_cache(module, args, kwargs):
        live.cache = kwargs.get(cache)

    hooks = [torch.nn.modules.module.register_module_forward_pre_hook(enter),
             torch.nn.modules.module.register_module_forward_hook(leave),
             hf.register_forward_pre_hook(keep_cache, with_kwargs=True)]
    try:
        with live:
            live.count_weights(model)
            yield
    finally:
        for hook in hooks:
            hook.remove()


def compile_counters() -> dict:
    """torch's compile counters that say what compiled: seconds compiling, graphs, graph breaks,
    recompiles and inductor's CUDA-graph counters (skips, re-records)."""
    counters = torch._dynamo.utils.counters
    times = getattr(torch._dynamo.utils, "compilation_time_metrics", {})
    found = {"compile_seconds": sum(times.get("_compile.compile_inner", [])),
             "graph_breaks": sum(counters["graph_break"].values())}
    for group in ("stats", "inductor"):
        for key, value in counters[group].items():
            if "graph" in key or "recompil" in key:
                found[f"{group}.{key}"] = value
    return found


def since(before: dict) -> dict:
    """The compile counters that moved since `before`."""
    moved = {}
    for key, value in compile_counters().items():
        if value != before.get(key, 0):
            moved[key] = value - before.get(key, 0)
    return moved


# --------------------------------------------------------------------------------------- one run
def one(model, tok, prompts: list, cfg: RolloutConfig, stop: list[int], arm: str,
        watch: str = "") -> dict:
    """One `rollout.generate` as `arm` runs it (seed 0): seconds, useful tokens, row-steps, a hash
    of the tokens; with `watch` "count" the eager counts, with "memory" the peak."""
    seen = []

    def rows_in(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and ids.shape[1] == 1:  # a decode step (the prompt's pass aside)
            seen.append(ids.shape[0])

    device = next(model.parameters()).device
    ops, live, profiler, watched = CountOps(), None, nullcontext(), nullcontext()
    if watch == "count":
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        watched = ops
    hook = hf_module(model).register_forward_pre_hook(rows_in, with_kwargs=True)
    torch.manual_seed(0)
    if watch == "memory" and device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        # (nullcontext: FSDP's policy computes in bf16 with --dtype bfloat16, as in a run)
        with generating_as(arm), parallel.generation(model, nullcontext()), profiler:
            if watch == "memory" and device.type == "cpu":
                live = LiveBytes(model)
                watched = tracking(model, live)  # (the weights gathered: counted from here)
            cli.sync(device)
            t0 = time.perf_counter()
            with watched:
                out, _ = rollout.generate(model, tok, prompts, cfg, stop)
            cli.sync(device)
            seconds = time.perf_counter() - t0
    finally:
        hook.remove()
    r = {"seconds": seconds, "tokens": int(out.completion_len.sum()), "row_steps": sum(seen),
         "tokens_sha": hashlib.sha256(str(out.tokens.tolist()).encode()).hexdigest()[:16]}
    if watch == "count":
        hooks = 0
        for event in profiler.events():
            hooks += event.name.startswith("FSDP::") and "forward" in event.name
        r |= {"ops": ops.n, "cat_mb": ops.cat_bytes / MiB, "clone_mb": ops.clone_bytes / MiB,
              "syncs": ops.calls.get("_local_scalar_dense", 0), "hooks": hooks}
    if watch == "memory" and device.type == "cuda":
        r["peak"] = {"bytes": torch.cuda.max_memory_allocated(device)}
    if watch == "memory" and device.type == "cpu":
        r["peak"] = live.peak
    return r


# ---------------------------------------------------------------------------------- the workload
class Workload:
    """The prompts, stop ids and configs of one benchmark, and the runs that measure an arm."""

    def __init__(self, a: argparse.Namespace, tok):
        self.a = a
        self.tok = tok
        if a.measure == "rollout":
            self.prompts = random_prompts(len(tok), a.rows // a.group, a.prompt_tokens,
                                          not a.same_length)
            self.stop = list(range(4, 4 + max(1, a.vocab // a.mean_len)))
            self.lengths = [a.max_new]
            self.group, self.slots = a.group, a.slots
        else:
            self.prompts = random_prompts(len(tok), a.rows, a.prompt_tokens, not a.same_length)
            self.stop = []
            self.lengths = list(a.tokens)
            self.group, self.slots = 1, a.rows  # every row in one call

    def config(self, arm: str, new_tokens: int, prompts: list) -> RolloutConfig:
        return RolloutConfig(group_size=self.group, batch_size=len(prompts) * self.group,
                             max_new_tokens=new_tokens, gen_batch_size=self.slots,
                             sync_every=self.a.sync_every, **settings(arm))

    def warm(self, model, arm: str) -> float:
        """Seconds of the warm-up: one rollout of --slots rows (rollout) or one generate at each
        length (step; a static cache's shape is the prompt + T, so it compiles for each)."""
        t0 = time.perf_counter()
        prompts = self.prompts
        if self.a.measure == "rollout":
            prompts = prompts[: max(1, self.slots // self.group)]
        for t in self.lengths:
            one(model, self.tok, prompts, self.config(arm, t, prompts), self.stop, arm)
        return time.perf_counter() - t0

    def timed(self, model, arm: str, watch: str = "") -> dict:
        """One timed measure: a whole rollout, or a decode step from two lengths; the peak
        (`watch` "memory") of the longest run alone."""
        lengths = self.lengths
        if watch == "memory":
            lengths = self.lengths[-1:]
        runs = [one(model, self.tok, self.prompts, self.config(arm, t, self.prompts), self.stop,
                    arm, watch) for t in lengths]
        if self.a.measure == "rollout" or watch == "memory":
            return runs[-1]
        (t1, t2), (short, long) = self.lengths, runs
        r = {"step_seconds": (long["seconds"] - short["seconds"]) / (t2 - t1),
             "tokens_sha": long["tokens_sha"]}
        for key in COUNTS:
            if key in long:
                r[key] = (long[key] - short[key]) / (t2 - t1)
        return r


def figures(a: argparse.Namespace, runs: list[dict]) -> dict:
    """An arm's figures from its timed runs (medians)."""
    if a.measure == "step":
        seconds = statistics.median(r["step_seconds"] for r in runs)
        return {"ms_per_step": 1000 * seconds, "tokens_per_s": a.rows / seconds,
                "ms_range": [1000 * min(r["step_seconds"] for r in runs),
                             1000 * max(r["step_seconds"] for r in runs)]}
    return {"seconds": statistics.median(r["seconds"] for r in runs),
            "tokens": statistics.median(r["tokens"] for r in runs),
            "tokens_per_s": statistics.median(r["tokens"] / r["seconds"] for r in runs),
            "row_steps_per_token": statistics.median(r["row_steps"] / r["tokens"] for r in runs)}


def extras(a: argparse.Namespace, r: dict, tokens: float) -> dict:
    """--count's counts per useful token (a rollout's) or per step (`r`'s already), --memory's
    peak."""
    found = {}
    for key in COUNTS:
        if key in r and a.measure == "rollout":
            found[f"{key}_per_token"] = r[key] / tokens
        if key in r and a.measure == "step":
            found[f"{key}_per_step"] = r[key]
    if "peak" in r:
        found["peak"] = r["peak"]
    return found


# ------------------------------------------------------------------------------------------ main
def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = cli.Parser(__file__, __doc__)
    ap.add_argument("--arms", type=cli.names(ARMS), default="default,static_packed,refill")
    ap.add_argument("--measure", default="rollout", choices=["rollout", "step"])
    ap.add_argument("--shape", default="0.5b", choices=list(SHAPES))
    ap.add_argument("--layers", type=cli.count, default=2,
                    help="decoder layers (0: the model's all)")
    ap.add_argument("--vocab", type=cli.positive_int, default=151936)
    ap.add_argument("--rows", type=cli.positive_int, default=64,
                    help="rows a rollout (prompts × group), or of a decode step")
    ap.add_argument("--group", type=cli.positive_int, default=8, help="rows per prompt")
    ap.add_argument("--slots", type=cli.positive_int, default=16,
                    help="rollout.gen_batch_size (rollout)")
    ap.add_argument("--sync-every", type=cli.positive_int, default=8,
                    help="rollout.sync_every (refill)")
    ap.add_argument("--prompt-tokens", type=cli.positive_int, default=32)
    ap.add_argument("--same-length", action="store_true", help="every prompt --prompt-tokens "
                    "long (default: 1/2 to all of it): a static cache then has one shape")
    ap.add_argument("--max-new", type=cli.positive_int, default=192, help="(rollout)")
    ap.add_argument("--mean-len", type=cli.positive_int, default=48, help="(rollout)")
    ap.add_argument("--tokens", type=token_pair, default="16,96", help="T1,T2 new tokens (step)")
    ap.add_argument("--repeats", type=cli.positive_int, default=3)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", type=cli.device, default="cpu")
    ap.add_argument("--threads", type=cli.positive_int, default=2)
    ap.add_argument("--count", action="store_true", help="ops, bytes, host syncs, hooks")
    ap.add_argument("--memory", action="store_true", help="the peak memory")
    ap.add_argument("--compile-anywhere", action="store_true",
                    help="the static arms compile on this device too (a CPU's dry run)")
    ap.add_argument("--json", help="also write the figures here, as each arm is measured")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --json file")
    a = ap.parse_args(argv)
    ap.check_file("--json", a.json, a.overwrite)
    if a.measure == "rollout" and a.rows % a.group:
        ap.error(f"--rows {a.rows} is not a multiple of --group {a.group} (whole prompts)")
    if not a.same_length and a.prompt_tokens < 2:
        ap.error("--prompt-tokens must be ≥ 2 unless --same-length (prompts of half of them)")
    fault = cli.tokenizer_fault(a.vocab)
    if fault:
        ap.error(f"--vocab {a.vocab} {fault}")
    return a


def token_pair(text: str) -> tuple[int, int]:
    """--tokens T1,T2: two lengths, 1 ≤ T1 < T2 (a step's time is their difference's share)."""
    parts = text.split(",")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"must be T1,T2, got {text!r}")
    t1, t2 = map(cli.positive_int, parts)
    if t1 >= t2:
        raise argparse.ArgumentTypeError(f"must be T1,T2 with T1 < T2, got {text}")
    return t1, t2


def measure(a: argparse.Namespace, say=print) -> dict:
    """Every arm of `a` measured; the result as --json holds it (written as each arm ends)."""
    device = torch.device(a.device)
    torch.set_num_threads(a.threads)
    if a.compile_anywhere:
        rollout.kv_cache = functools.partial(compiled_everywhere, rollout.kv_cache)
        decode.COMPILE_ANYWHERE = True
    tok = build_tokenizer()
    work = Workload(a, tok)
    model = shard(qwen_like(a.shape, a.layers, a.vocab, a.device), getattr(torch, a.dtype))
    layers = model.config.num_hidden_layers
    args = {k: v for k, v in vars(a).items() if k not in ("json", "overwrite")}
    result = {"shape": f"Qwen2.5-{a.shape}-like, {layers} layers, vocabulary {a.vocab}, "
                       f"{a.dtype}", "args": args, **cli.versions(), "arms": {}, "failed": {}}
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(device)
    say(f"{result['shape']}, {a.measure}, {device}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}, {a.repeats} repeats")
    runs = {}
    for arm in a.arms:  # each arm whole, in the order given: its figures land before the next's
        try:
            before = compile_counters()
            first = work.warm(model, arm)
            result["arms"][arm] = {"first_seconds": first, "compiled": since(before)}
            before = compile_counters()
            runs[arm] = [work.timed(model, arm)]
            result["arms"][arm] |= figures(a, runs[arm])
            result["arms"][arm]["compiled_while_timed"] = since(before)
            for watch in ("count", "memory"):
                if getattr(a, watch) and not (watch == "count" and settings(arm)["static_cache"]):
                    r = work.timed(model, arm, watch)
                    tokens = result["arms"][arm].get("tokens", 1)
                    result["arms"][arm] |= extras(a, r, tokens)
            result["arms"][arm]["tokens_sha"] = runs[arm][0]["tokens_sha"]
        except Exception as e:  # its line; the other arms go on
            result["arms"].pop(arm, None)
            result["failed"][arm] = f"{type(e).__name__}: {str(e)[:300]}"
        say(line(arm, result))
        save(a, result)
    for _ in range(a.repeats - 1):  # then alternating
        for arm in runs:
            before = compile_counters()
            runs[arm].append(work.timed(model, arm))
            moved = since(before)
            for key, value in moved.items():
                counted = result["arms"][arm]["compiled_while_timed"]
                counted[key] = counted.get(key, 0) + value
            result["arms"][arm] |= figures(a, runs[arm])
        save(a, result)
    if a.repeats > 1:
        for arm in runs:
            say(line(arm, result))
    return result


def line(arm: str, result: dict) -> str:
    if arm in result["failed"]:
        return f"{arm}: failed: {result['failed'][arm]}"
    r = result["arms"][arm]
    parts = [f"{arm}: {r['tokens_per_s']:.0f} useful tokens/s"]
    if "ms_per_step" in r:
        parts.append(f"{r['ms_per_step']:.2f} ms a step")
    if "seconds" in r:
        parts.append(f"{r['seconds']:.2f} s for {r['tokens']:.0f} tokens, "
                     f"{r['row_steps_per_token']:.2f} row-steps a token")
    parts.append(f"warm-up {r['first_seconds']:.1f} s (compiled {r['compiled'] or 'nothing'})")
    if r["compiled_while_timed"]:
        parts.append(f"compiled while timed: {r['compiled_while_timed']}")
    for key, value in r.items():
        if key.rpartition("_per_")[0] in COUNTS:
            parts.append(f"{key} {value:.3f}")
    if "peak" in r:
        parts.append(peak_line(r["peak"]))
    return "; ".join(parts)


def peak_line(peak: dict) -> str:
    text = f"peak {peak['bytes'] / MiB:.1f} MiB"
    if "phase" in peak:
        held = sorted(peak["held"].items(), key=lambda item: -item[1])
        parts = [f"{name} {mib:.2f}" for name, mib in held if mib >= 0.005]
        text += f" at {peak['phase']} ({peak['op']}): {', '.join(parts)}"
    return text


def save(a: argparse.Namespace, result: dict) -> None:
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    with cli.one_process(torch.device(a.device)):
        result = measure(a)
    return int(bool(result["failed"]))


if __name__ == "__main__":
    sys.exit(main())
