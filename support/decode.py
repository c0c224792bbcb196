"""Generation's own decode loop (`rollout.refill`): a fixed number of slots, each one sequence at
its own length in one fixed-size KV cache, and a row that ends frees its slot for the next row
(continuous batching inside one rollout), so a step's work follows the live rows, not the longest
row times the batch. The host reads the device only every `sync_every` steps (to refill slots, to
stop); between reads a finished slot idles. Everything else is what `rollout._sample` does: the
model's own forward (the chunked float32 head), `rollout.sampling_distribution`, the
behaviour log-prob and entropy of every sampled token, a completion ended by its first end token.

Sampling is Gumbel-max: token = argmax(z + g), g = −log(−log u), u a hash of (the call's seed, the
row, the token's index, the vocabulary entry). That is an exact draw from softmax(z), and a row's
draws do not depend on which slot it gets or which rows share the step, so with the same seed a
row samples the same tokens whatever the number of slots or the order rows end in. The default
path samples the same distribution with other draws (torch.multinomial).

A prompt's prefill runs alone (batch 1) and its K and V are copied to each of its rows' slots, so
a prompt's numbers do not depend on what it is batched with either.
"""

from __future__ import annotations

from collections import Counter

import torch
import transformers
from torch import Tensor

from support.kvcache import cache_kwarg
from support.parallel import hf_module
from support.util import RunError

# splitmix64's constants as signed int64, murmur3's as int32 (torch has no unsigned arithmetic)
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15
_MIX1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MIX2 = -7723592293110705685  # 0x94D049BB133111EB
_GOLDEN32 = -1640531527  # 0x9E3779B9
_FMIX1 = -2048144789  # 0x85EBCA6B
_FMIX2 = -1028477387  # 0xC2B2AE35


def _shift(x: Tensor, bits: int) -> Tensor:
    """x >> bits as an unsigned shift of x's width (torch's shift keeps the sign)."""
    width = 8 * x.element_size()
    return (x >> bits) & ((1 << (width - bits)) - 1)


def _mix64(x: Tensor) -> Tensor:
    """splitmix64's finaliser: every input bit moves every output bit."""
    x = (x ^ _shift(x, 30)) * _MIX1
    x = (x ^ _shift(x, 27)) * _MIX2
    return x ^ _shift(x, 31)


def _mix32(x: Tensor) -> Tensor:
    """murmur3's 32-bit finaliser."""
    x = (x ^ _shift(x, 16)) * _FMIX1
    x = (x ^ _shift(x, 13)) * _FMIX2
    return x ^ _shift(x, 16)


def gumbel(seed: Tensor | int, rows: Tensor, t: Tensor, vocab: int) -> Tensor:
    """(S, V) float32 Gumbel noise for rows `rows` (S,) at token indices `t` (S,): a function of
    (seed, row, t, entry) alone, computed on the rows' device without a host sync. A 64-bit key
    per (seed, row, t), then a 32-bit hash per entry (int32 arithmetic: inductor's CPU code for
    int64 vectors corrupted memory in torch 2.13)."""
    key = _mix64(_mix64(rows * _GOLDEN + seed) + t * _GOLDEN)  # (S,)
    key = ((key ^ _shift(key, 32)) & 0x7FFFFFFF).to(torch.int32)  # (S,): 31 bits
    entry = torch.arange(vocab, dtype=torch.int32, device=rows.device) * _GOLDEN32  # (V,)
    bits = _shift(_mix32(key[:, None] + entry[None]), 9)  # (S, V): 23 random bits
    # u = (bits + 1/2) / 2^23 lies in [2^-24, 1 - 2^-24], every value exact in float32 (with 24
    # bits, bits = 2^24 - 1 rounded u up to 1.0: noise +inf, about once per row-step at a real
    # vocabulary). −log u is computed as −log1p(−(1 − u)), exact near u = 1, and kept above 2^-26
    # so that an approximate GPU log cannot make it 0 (noise +inf) either.
    one_minus_u = (bits.float() + 0.5) * 2.0**-23  # (S, V): as u, in [2^-24, 1 - 2^-24]
    e = (-torch.log1p(-one_minus_u)).clamp(min=2.0**-26)  # (S, V): −log u, an Exp(1) draw
    return -torch.log(e)


class SlotCache(transformers.DynamicCache):
    """K and V of `slots` sequences, each written at its own position `pos` (S,): storage (S, H,
    length, D) per layer, made at the first prompt written, so that a layer's attention gets the
    whole storage and a mask (S, 1, 1, length) hides what a slot has not written."""

    def __init__(self, config, slots: int, length: int, dtype: torch.dtype | None = None):
        super().__init__(config=config)
        self.slots, self.length = slots, length
        self.dtype = dtype  # K and V stored in it (the autocast dtype), else as computed
        self.pos = None  # (S,) long: where each slot writes its next token's K and V
        self.storage = {}  # layer index -> (keys, values), (S, H, length, D) each

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = self.storage[layer_idx]
        at = torch.arange(self.slots, device=keys.device)
        keys[at, :, self.pos] = key_states[:, :, 0].to(keys.dtype)  # (S, H, D) at (s, pos[s])
        values[at, :, self.pos] = value_states[:, :, 0].to(values.dtype)
        return keys, values

    def write_prompt(self, prompt_cache, slot: int) -> None:
        """Copy a prompt's K and V (a batch-1 DynamicCache) to the start of `slot`."""
        for i, layer in enumerate(prompt_cache.layers):
            k, v = layer.keys, layer.values  # (1, H, P, D)
            if i not in self.storage:
                shape = (self.slots, k.shape[1], self.length, k.shape[3])
                keys = k.new_zeros(shape, dtype=self.dtype or k.dtype)
                self.storage[i] = (keys, v.new_zeros(shape, dtype=self.dtype or v.dtype))
                for x in self.storage[i]:  # a compiled step's CUDA graphs write into them
                    torch._dynamo.mark_static_address(x)
            keys, values = self.storage[i]
            keys[slot, :, : k.shape[2]] = k[0]
            values[slot, :, : v.shape[2]] = v[0]


def check_model(model) -> None:
    """RunError unless every layer attends to the whole sequence with sdpa (what the slots'
    cache and mask implement)."""
    config = hf_module(model).config
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"} or getattr(config, "use_sliding_window", False):
        raise RunError(f"rollout.refill: the model's layers are {sorted(kinds)} (sliding "
                       "windows are not supported): set rollout.refill false")
    if getattr(config, "_attn_implementation", "sdpa") != "sdpa":
        raise RunError("rollout.refill needs the model's sdpa attention, got "
                       f"{config._attn_implementation}: set rollout.refill false")


@torch.no_grad()
def decode(model, prompts: list[list[int]], distribution, stop: list[int], max_new: int, slots: int,
           sync_every: int, seed: int, should_stop,
           compiled: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """Completions of each prompt in `prompts` (a row per entry), `slots` at a time: tokens,
    behaviour log-probs and entropies (R, max_new) each, on the model's device; a row's entries
    after its first end token are padding (token −1, 0). `distribution(logits (S, V))` gives the
    sampling logits z, their log-softmax, its entropy and which rows were finite
    (rollout.sampling_distribution). `should_stop()` is asked before every step: True ends the
    call with None."""
    check_model(model)
    device = next(model.parameters()).device
    step = _step
    if compiled:
        step = _compiled_step(device)
    noise_seed = torch.tensor(seed, device=device)  # a tensor: a compiled step takes any seed
    R = len(prompts)
    S, length = cache_sizes(prompts, max_new, slots, compiled)
    config = hf_module(model).config
    dtype = None  # under autocast K and V in its dtype, which attention casts them to anyway
    if torch.is_autocast_enabled(device.type):
        dtype = torch.get_autocast_dtype(device.type)
    cache = SlotCache(config, S, length, dtype)
    key = cache_kwarg(model)
    out = _Records(R, max_new, device)
    stop_ids = torch.tensor(stop, dtype=torch.long, device=device)
    state = _Slots(S, R, device)  # what each slot holds, on the device
    queue = _Queue(prompts, lambda ids: _prefill(model, config, ids, device, key))
    zero = torch.zeros(1, dtype=torch.long, device=device)
    while True:
        if should_stop():
            return None
        free = (~state.alive).nonzero().flatten().tolist()  # the host read
        while free and queue.pending:
            s = free.pop()
            r, ids, prompt_cache, last = queue.take()
            cache.write_prompt(prompt_cache, s)
            rows = torch.tensor([r], device=device)
            first = out.put(rows, zero, *_sampled(last, distribution, noise_seed, rows, zero))
            if bool(torch.isin(first, stop_ids).any()) or max_new == 1:
                free.append(s)  # ended at its first token: the slot takes the next row
                continue
            state.start(s, r, int(first), len(ids))
        if not bool(state.alive.any()):
            break
        # Steps until the next host read: sync_every, but no more than the live row furthest
        # from max_new needs (every row has ended by then), and a stop ends the run of steps
        # (should_stop is a flag on the host, cheap to read at every step).
        for _ in range(min(sync_every, max_new - int(state.t[state.alive].min()))):
            if should_stop():
                return None
            cache.pos = state.pos
            if compiled:  # a new replay of the CUDA graphs, whose outputs the next overwrites
                torch.compiler.cudagraph_mark_step_begin()
            drawn = step(model, cache, key, state.token, state.pos, state.row, state.t,
                         distribution, noise_seed)
            nxt = out.put(state.row, state.t, *drawn)
            state.advance(nxt, torch.isin(nxt, stop_ids) | (state.t + 1 >= max_new), R, length)
    if not bool(out.finite):
        raise FloatingPointError("the policy's logits are not finite (NaN or inf weights)")
    return out.tokens[:R], out.logp[:R], out.entropy[:R]


def cache_sizes(prompts: list[list[int]], max_new: int, slots: int,
                compiled: bool) -> tuple[int, int]:
    """(slots, positions) of a call's cache: its rows, at most `slots`, and its longest prompt plus
    max_new; compiled, shapes that do not change with the call's rows (one compiled step serves
    all): every slot, the length rounded up to LENGTH_BUCKET."""
    length = max(map(len, prompts)) + max_new
    if compiled:
        return slots, -(-length // LENGTH_BUCKET) * LENGTH_BUCKET
    return min(slots, len(prompts)), length


class _Records:
    """Per row (R rows and a sink, row R, for empty slots), its tokens (−1 past its end), their
    behaviour log-probs and the distributions' entropies (R + 1, max_new) each, on the device; and
    whether every logit so far was finite."""

    def __init__(self, R: int, max_new: int, device):
        self.tokens = torch.full((R + 1, max_new), -1, dtype=torch.long, device=device)
        self.logp = torch.zeros(R + 1, max_new, device=device)
        self.entropy = torch.zeros(R + 1, max_new, device=device)
        self.finite = torch.ones((), dtype=torch.bool, device=device)

    def put(self, rows: Tensor, t: Tensor, nxt: Tensor, lp: Tensor, ent: Tensor,
            finite: Tensor) -> Tensor:
        """Record each slot's draw at (row, t) (t past the end: the last column); returns `nxt`."""
        at = (rows, t.clamp(max=self.tokens.shape[1] - 1))
        self.tokens.index_put_(at, nxt)
        self.logp.index_put_(at, lp)
        self.entropy.index_put_(at, ent)
        self.finite &= finite
        return nxt.clone()  # (a compiled step's next replay overwrites its outputs)


class _Queue:
    """The rows not yet started, in order, each with its prompt's pass (`prefill(ids)`, run once
    per distinct prompt and dropped once its last row is placed)."""

    def __init__(self, prompts: list[list[int]], prefill):
        self.prompts, self.prefill = prompts, prefill
        self.pending = list(range(len(prompts)))[::-1]  # the next last
        self.left = Counter(map(tuple, prompts))  # rows of each prompt not yet placed
        self.passes = {}  # prompt (as a tuple) -> (its batch-1 cache, its last logits (1, V))

    def take(self) -> tuple:
        """(row, prompt ids, the prompt's cache, its last logits) of the next row."""
        r = self.pending.pop()
        ids = tuple(self.prompts[r])
        if ids not in self.passes:
            self.passes[ids] = self.prefill(ids)
        prompt_cache, last = self.passes[ids]
        self.left[ids] -= 1
        if not self.left[ids]:
            del self.passes[ids]  # its last row placed
        return r, ids, prompt_cache, last


def _step(model, cache, key: str, token: Tensor, pos: Tensor, row: Tensor, t: Tensor, distribution,
          seed: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One decode step of every slot: the model's forward on each slot's token at its position
    (K and V written at `cache.pos`), then the next tokens (S,) drawn, their log-probs (S,), the
    distributions' entropies (S,) and whether every logit was finite (a device bool)."""
    mask = torch.arange(cache.length, device=pos.device)[None] <= pos[:, None]  # (S, length)
    out = model(input_ids=token[:, None], position_ids=pos[:, None],
                attention_mask=mask[:, None, None], use_cache=True, **{key: cache})
    return _sampled(out.logits[:, -1], distribution, seed, row, t)


_COMPILED = {}
LENGTH_BUCKET = 256
"""A compiled step's cache length is a multiple of it: few shapes, so few compiles."""
COMPILE_ANYWHERE = False
"""Whether rollout.static_cache compiles the refill step on a CPU too (a benchmark's dry run sets
it); by default it compiles on a GPU only, as transformers does its static decode step."""


def compiles(device: torch.device) -> bool:
    """Whether rollout.static_cache compiles the refill loop's step on `device`."""
    return device.type == "cuda" or COMPILE_ANYWHERE


def _compiled_step(device: torch.device):
    """`_step` compiled: on a GPU with CUDA graphs (mode reduce-overhead), elsewhere by inductor."""
    mode = "reduce-overhead" if device.type == "cuda" else None
    if mode not in _COMPILED:
        _COMPILED[mode] = torch.compile(_step, mode=mode)
    return _COMPILED[mode]


def _sampled(logits: Tensor, distribution, seed, rows: Tensor, t: Tensor) -> tuple:
    """Each slot's next token drawn from `logits` (S, V) (Gumbel-max), its log-prob, the
    distribution's entropy (S,) each, and whether every logit was finite."""
    z, lp, ent, finite = distribution(logits)  # (S, V), (S, V), (S,), (S, 1)
    nxt = (z + gumbel(seed, rows, t, z.shape[1])).argmax(-1)  # (S,)
    return nxt, lp.gather(1, nxt[:, None]).squeeze(1), ent, finite.all()


def _prefill(model, config, ids: tuple, device, key: str) -> tuple:
    """A prompt's pass alone: its KV cache (batch 1) and the logits after its last token (1, V)."""
    prompt_cache = transformers.DynamicCache(config=config)
    x = torch.tensor([ids], device=device)
    out = model(input_ids=x, use_cache=True, logits_to_keep=1, **{key: prompt_cache})
    return prompt_cache, out.logits[:, -1]


class _Slots:
    """Per slot, on the device: the row it decodes (R when empty), the token it feeds next and that
    token's position, the index of the token it samples next, and whether it is live."""

    def __init__(self, S: int, R: int, device):
        self.row = torch.full((S,), R, dtype=torch.long, device=device)
        self.token = torch.zeros(S, dtype=torch.long, device=device)
        self.pos = torch.zeros(S, dtype=torch.long, device=device)
        self.t = torch.zeros(S, dtype=torch.long, device=device)
        self.alive = torch.zeros(S, dtype=torch.bool, device=device)

    def start(self, s: int, r: int, first: int, prompt_len: int) -> None:
        """Slot s decodes row r from its first sampled token, which follows its prompt."""
        self.row[s], self.token[s], self.pos[s], self.t[s] = r, first, prompt_len, 1
        self.alive[s] = True

    def advance(self, nxt: Tensor, ended: Tensor, R: int, length: int) -> None:
        """After a step: live slots feed `nxt` next; those that `ended` empty (row R, the sink)."""
        self.alive &= ~ended
        self.row = torch.where(self.alive, self.row, R)
        self.token = nxt
        self.pos = (self.pos + 1).clamp(max=length - 1)  # an empty slot writes in place
        self.t = self.t + 1

