"""Peak of live tensor bytes in one generation phase (`parallel.generation` around
`rollout.generate`) on this CPU, and what holds them then, for two of bench/decode_step.py's arms
at a Qwen2.5-like shape (random weights, FSDP2 at world size 1, bf16 weights, one thread):

  before  FSDP's forward hooks on during generation, HF's DynamicCache
  after   hooks off, the KV cache written in place (support.kvcache.kv_cache): today's path

  python bench/generation_memory.py                     # 8 rows, prompts of 64, 64 new tokens
  python bench/generation_memory.py --new-tokens 640    # the peak moves to the last decode step
  python bench/generation_memory.py --ragged --json out.json

A TorchDispatchMode records the storage of every tensor an aten operator returns and a
weakref.finalize takes its bytes off when it is freed. The weights FSDP gathers are counted from
the moment `parallel.generation` hands them over (its all-gather's buffers, the same in every arm,
are not; nor are the float32 master shards). A storage belongs to the innermost model part running
when it was made; the KV cache's storages are picked out at the peak. No end token: every row
runs all its new tokens. The peak falls in the prompt's pass (the last layer's MLP beside the
cache) or at the last decode step (the output layer beside the whole cache): bench/memory_plan.py's
generation term.
"""

from __future__ import annotations

import json
import sys
import tempfile
import weakref
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import rollout
from bench import cli
from bench.decode_step import SHAPES, generating_as, qwen_like, random_prompts, shard
from data.build_tiny_model import build_tokenizer
from rollout import RolloutConfig
from support import parallel
from support.kvcache import cache_kwarg
from support.parallel import hf_module

ARMS = ("before", "after")
MiB = 2**20
# the model part a storage belongs to: the innermost running module with one of these names
PARTS = {"mlp": "MLP", "self_attn": "attention", "rotary_emb": "attention",
         "lm_head": "output layer"}


@dataclass
class Peak:
    """The most live tensor bytes of one generation phase, and when they were reached."""

    bytes: int = 0
    phase: str = ""  # "the prompt pass" or "decode step N" (the model's N + 1-th forward)
    op: str = ""  # the aten operator whose output reached it
    module: str = ""  # the innermost module running then
    held: dict = field(default_factory=dict)  # category -> bytes, at the peak


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of every storage an aten operator returned that is still alive."""

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
        self.peak = Peak()

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
        if self.total > self.peak.bytes:
            module = "-"
            if self.running:
                module = self.running[-1]
            self.peak = Peak(self.total, self.phase(), op, module, self.held())

    def phase(self) -> str:
        if self.forwards == 0:
            return "generate's set-up"
        if self.forwards == 1:
            return "the prompt pass"
        return f"decode step {self.forwards - 1}"

    def name_weights(self, model) -> None:
        """Counts the weights FSDP gathered (whole and bf16 until the phase ends) under their name:
        their storages were made beside the dispatcher, or by it outside the model."""
        for p in model.parameters():
            storage = p.untyped_storage()
            self.add(storage, "gathered weights", "unshard")
            self.live[id(storage)] = (storage.nbytes(), "gathered weights")
        self.peak = Peak()  # from here

    def free(self, key: int) -> None:
        self.total -= self.live.pop(key)[0]

    def held(self) -> dict:
        """Live bytes by category; the KV cache's K and V (views of its storage) by the cache."""
        cache = set()
        for layer in getattr(self.cache, "layers", []):
            for t in (layer.keys, layer.values):
                if isinstance(t, torch.Tensor):
                    cache.add(id(t.untyped_storage()))
        held = {}
        for key, (n, category) in self.live.items():
            if key in cache:
                category = "KV cache"
            held[category] = held.get(category, 0) + n
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
            yield
    finally:
        for hook in hooks:
            hook.remove()


def peak(model, tok, prompts: list, new_tokens: int, arm: str) -> tuple[Peak, list]:
    """The peak of one generation phase as `arm` runs it, and the tokens it sampled (seed 0)."""
    cfg = RolloutConfig(group_size=1, max_new_tokens=new_tokens, gen_batch_size=len(prompts))
    live = LiveBytes(model)
    torch.manual_seed(0)
    with generating_as(arm), tracking(model, live), parallel.generation(model, nullcontext()):
        live.name_weights(model)
        rollouts, _ = rollout.generate(model, tok, prompts, cfg, [])
    return live.peak, rollouts.tokens.tolist()


@contextmanager
def one_process():
    """A gloo process group of one, which FSDP2 needs, unless one is already set up."""
    if dist.is_initialized():
        yield
        return
    with tempfile.NamedTemporaryFile(prefix="generation_memory_") as store:
        dist.init_process_group("gloo", init_method=f"file://{store.name}", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def measure(arms=ARMS, shape: str = "1.5b", layers: int = 2, vocab: int = 4096, rows: int = 8,
            prompt_tokens: int = 64, new_tokens: int = 64, ragged: bool = False) -> dict:
    """{"peaks": {arm: Peak}, "same_tokens": whether every arm sampled the first arm's tokens}."""
    tok = build_tokenizer()
    prompts = random_prompts(len(tok), rows, prompt_tokens, ragged)
    peaks, tokens = {}, {}
    with one_process():
        model = shard(qwen_like(shape, layers, vocab, "cpu"), torch.bfloat16)
        for arm in arms:
            peaks[arm], tokens[arm] = peak(model, tok, prompts, new_tokens, arm)
    same = all(tokens[arm] == tokens[arms[0]] for arm in arms)
    return {"peaks": peaks, "same_tokens": same}


def report(peaks: dict) -> None:
    for arm, p in peaks.items():
        print(f"{arm}: peak {p.bytes / MiB:.1f} MiB at {p.phase}, {p.op} in {p.module}")
        for category, n in sorted(p.held.items(), key=lambda item: -item[1]):
            if n >= 0.005 * MiB:  # what prints as 0.00 is left out
                print(f"  {category:<22} {n / MiB:8.2f}")


def main(argv: list[str] | None = None) -> int:
    ap = cli.Parser(__file__, __doc__)
    ap.add_argument("--arms", type=cli.names(ARMS), default=",".join(ARMS))
    ap.add_argument("--shape", default="1.5b", choices=list(SHAPES))
    ap.add_argument("--layers", type=cli.count, default=2,
                    help="decoder layers (0: the model's all)")
    ap.add_argument("--vocab", type=cli.positive_int, default=4096)
    ap.add_argument("--rows", type=cli.positive_int, default=8)
    ap.add_argument("--prompt-tokens", type=cli.positive_int, default=64)
    ap.add_argument("--new-tokens", type=cli.positive_int, default=64)
    ap.add_argument("--ragged", action="store_true",
                    help="prompts of 1/2 to all of --prompt-tokens (left padding: a mask)")
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --json file")
    a = ap.parse_args(argv)
    ap.check_file("--json", a.json, a.overwrite)
    if a.ragged and a.prompt_tokens < 2:
        ap.error("--ragged needs --prompt-tokens ≥ 2 (a prompt of half of them is not empty)")
    fault = cli.tokenizer_fault(a.vocab)
    if fault:
        ap.error(f"--vocab {a.vocab} {fault}")
    torch.set_num_threads(1)
    result = measure(tuple(a.arms), a.shape, a.layers, a.vocab, a.rows,
                     a.prompt_tokens, a.new_tokens, a.ragged)
    print(f"Qwen2.5-{a.shape}-like, {a.layers} layers, vocabulary {a.vocab}, {a.rows} rows, "
          f"prompts of {a.prompt_tokens}, {a.new_tokens} new tokens, torch {torch.__version__}, "
          f"transformers {transformers.__version__} (MiB of live tensors)")
    report(result["peaks"])
    print(f"same tokens in every arm: {result['same_tokens']}")
    if a.json:
        args = vars(a) | {"arms": ",".join(a.arms)}  # (as before --overwrite: the text given)
        args.pop("overwrite")
        out = {"args": args, "torch": torch.__version__,
               "transformers": transformers.__version__, "same_tokens": result["same_tokens"],
               "peaks": {arm: asdict(p) for arm, p in result["peaks"].items()}}
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
