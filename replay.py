"""Experience replay for GRPO: one rollout-level buffer and the strategies behind `replay.strategy`, side by side.

Storage. `capacity` rows of preallocated tensors on CPU (a `Rollouts` of int32 token ids and float32
behaviour log-probs of shape (capacity, max_len), 8 bytes per position, and every per-row field),
plus per slot `valid`, `used` (times replayed) and `score` (a strategy's own number: a priority, a
solve count). There is no Python object per rollout and memory is fixed by `capacity`; a checkpoint
holds the occupied slots' tokens only. A push writes the slots after the previous write, so a full
buffer overwrites its oldest rows (eviction "capacity"); evictions by age or retirement clear
`valid`, and the ring reuses those slots later.

A strategy is a subclass with a `name` (defining it registers it: STRATEGIES[name]) that overrides what it needs:
  check(cfg)               its own (condition, message) pairs for its config keys
  start(problems, prompts, tokenizer, cfg, entropy)  once before training: load a source, keep the entropy function
  plan(idx, step)          the step's prompts and fresh completions per prompt (default: idx, G each)
  before_advantages(fresh, step)  rows to join fresh groups before advantages (RLEP, ExGRPO)
  sample(fresh, step)      the update batch: fresh rows (all, or some) and replayed ones (`slot` = their buffer row)
  push(batch, step, entropy)  after the update, the whole batch with each row's current mean token entropy (NaN if not
                           trained): fresh rows to store, replayed rows (slot ≥ 0) to rescore
All randomness comes from the buffer's own torch.Generator; state_dict saves it with the storage and the `STATE`
attributes a strategy lists. The trainer calls, each step: plan → generate → reward → before_advantages →
advantages → sample → update → push.

Advantages of replayed rows (`replay.advantage`): `stored` (default) is the advantage in the row's own group at
birth: what the buffer study and aper replay (aper's priority is defined by it). `recompute` re-centres the stored
reward against the prompt's current rewards as if the row joined them (the fresh group of its prompt when that is in
the batch, else the prompt's rows in the buffer; grpo's `group` scale), falling back to stored with < 2 rewards or
no spread. Rows that join fresh groups (rlep, exgrpo) get their advantages from grpo inside the mixed group.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from data.loaders import PARSED_BYTES, json_line, jsonl_rows, machine_memory, open_regular
from grpo import group_stats
from rollout import Rollouts, pack
from util import all_ranks

STRATEGIES: dict[str, type[Replay]] = {}
RAGGED = ("tokens", "behav_logp")  # the (rows, max_len) fields: a checkpoint holds occupied rows


@dataclass
class ReplayConfig:
    strategy: str = "none"
    """a name in replay.STRATEGIES: none | uniform | aper | rlep | exgrpo | group (or one you add)"""
    capacity: int = 4096
    """rows the buffer holds; memory is capacity × max_len × 8 bytes (int32 ids, fp32 log-probs)"""
    ratio: float = 0.5
    """uniform: replayed share of the update batch (< 1); aper: replayed rows per fresh row (≤ 4); exgrpo: share of
    a step's prompts taken from experience"""
    max_age: int = 0
    """uniform: evict rows older than this many steps; 0 = no limit (the study does not state one)"""
    tau_max: int = 4
    """aper, group: evict rows older than this many steps (≥ 1); the aper paper does not state its value"""
    alpha: float = 1.0
    """aper: priority exponent in |A|^alpha + priority_eps (0 = uniform); the paper does not state its value"""
    priority_eps: float = 1e-3
    """aper: priority floor, so every stored row stays drawable"""
    advantage: str = "stored"
    """advantage of replayed rows: stored (at birth) | recompute (against the prompt's current rewards)"""
    rlep_n: int = 2
    """rlep: stored successes appended to each fresh group (the paper uses 2)"""
    rlep_source: str = ""
    """rlep: JSONL of phase-I solutions (eval.py --save-correct); empty = online RLEP (this run's own successes)"""
    exgrpo_sigma: float = 1.0
    """exgrpo: width of the Gaussian bucket weight, in successes out of G (the release: 1, centred on G/2)"""
    exgrpo_min_solve: float = 0.35
    """exgrpo: experience starts (for good) once a step's rollouts are more than this fraction correct"""

    def check(self) -> dict[str, tuple[bool, str]]:
        known = self.strategy in STRATEGIES
        return {"strategy": (known, f"one of {', '.join(STRATEGIES)}"), "capacity": (self.capacity >= 1, "≥ 1"),
                "advantage": (self.advantage in ("stored", "recompute"), "stored or recompute"),
                "rlep_source": (not self.rlep_source or self.strategy == "rlep", "empty: it is read by rlep only"),
                **(STRATEGIES[self.strategy].check(self) if known else {})}


class Replay:
    """none: plain on-policy GRPO. The base stores nothing, adds nothing and draws no random numbers."""

    name, STATE, METRICS = "none", (), ()  # STATE: attributes state_dict keeps; METRICS: the strategy's own replay/*

    def __init_subclass__(cls, **kw):  # defining a strategy registers it under its name
        super().__init_subclass__(**kw)
        STRATEGIES[cls.name] = cls

    @staticmethod
    def check(cfg: ReplayConfig) -> dict[str, tuple[bool, str]]:
        return {}

    def __init__(self, cfg: ReplayConfig, max_len: int, pad_id: int, seed: int):
        C = cfg.capacity if type(self) is not Replay else 0
        self.cfg, self.pad_id, self.head, self.entropy_fn = cfg, pad_id, 0, None
        self.rows = Rollouts.empty(C, max_len, pad_id)
        self.rows.tokens = self.rows.tokens.int()  # ids < 2^31: half the bytes of int64
        self.valid, self.used, self.score = torch.zeros(C, dtype=torch.bool), torch.zeros(C), torch.zeros(C)
        self.gen = torch.Generator().manual_seed(seed)
        self.evicted = {"capacity": 0, "age": 0, "retired": 0}  # totals since the start of the run
        self.last = {}  # about the rows replayed at the latest step

    def __len__(self) -> int:
        return int(self.valid.sum())

    # ---- the hooks train.py calls; strategies override what they need

    def start(self, problems: list, prompts: list[list[int]], tokenizer, cfg, entropy=None) -> int:
        """Called once before training; returns the tokens generated to make an external source (0: none).
        `entropy(rows) -> (B,)` measures the current policy's mean token entropy of rows (no gradient)."""
        self.entropy_fn = entropy
        return 0

    def plan(self, idx: list[int], G: int, step: int) -> tuple[list[int], list[int]]:
        return idx, [G] * len(idx)

    def before_advantages(self, fresh: Rollouts, step: int) -> Rollouts:
        return fresh

    def sample(self, fresh: Rollouts, step: int) -> Rollouts:
        return fresh

    def push(self, batch: Rollouts, step: int, entropy: torch.Tensor) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        """The same keys every step (ranks add them up): size, evictions, and about the rows replayed this step."""
        m = {"replay/size": float(len(self)), **{f"replay/evicted_{k}": float(v) for k, v in self.evicted.items()}}
        keys = ("sampled", "replayed_share", "age_mean", "age_max", "reuse_max", *self.METRICS)
        return m | {f"replay/{k}": float(self.last.get(k, 0.0)) for k in keys}

    def state_dict(self) -> dict:
        """Every per-slot field, but the (C, max_len) tokens and log-probs of occupied slots only,
        cut to their longest row: what an empty slot holds is never read (a write replaces the whole
        row)."""
        slots = self._stored()
        L = int(self.rows.seq_len[slots].max()) if len(slots) else 0
        rows = {f.name: getattr(self.rows, f.name).clone() for f in fields(Rollouts)}
        rows["tokens"] = self.rows.tokens[slots, :L]
        rows["behav_logp"] = self.rows.behav_logp[slots, :L]
        own = {k: getattr(self, k) for k in ("valid", "used", "score", *self.STATE)}
        own = {k: v.clone() if torch.is_tensor(v) else v for k, v in own.items()}
        more = {"head": self.head, "rng": self.gen.get_state(), "evicted": dict(self.evicted),
                "last": dict(self.last), "max_len": self.rows.tokens.shape[1]}
        return rows | own | more

    def load_state_dict(self, d: dict) -> None:
        shape, here = (len(d["valid"]), d["max_len"]), tuple(self.rows.tokens.shape)
        if shape != here:
            raise ValueError(f"replay state holds {shape} rows × tokens, this buffer {here}")
        empty = Rollouts.empty(*shape, self.pad_id)
        rows = {f.name: d[f.name].clone() for f in fields(Rollouts) if f.name not in RAGGED}
        self.rows = Rollouts(**rows, tokens=empty.tokens.int(), behav_logp=empty.behav_logp)
        slots, L = d["valid"].nonzero().squeeze(1), d["tokens"].shape[1]
        self.rows.tokens[slots, :L] = d["tokens"].int()
        self.rows.behav_logp[slots, :L] = d["behav_logp"]
        for k in ("valid", "used", "score", *self.STATE):
            setattr(self, k, d[k].clone() if torch.is_tensor(d[k]) else d[k])
        self.head, self.evicted, self.last = d["head"], dict(d["evicted"]), dict(d["last"])
        self.gen.set_state(d["rng"])

    def load_split(self, parts: list[dict], rank: int, world: int, seed: int) -> None:
        """Resume the state_dicts of another number of processes (`parts`, one per saved rank):
        their stored rows merged and dealt out by prompt (the i-th prompt in id order to rank i mod
        world: groups and a question's rows stay together), written oldest first (a smaller total
        capacity keeps each rank's newest); per-row scores and replay counts kept; strategy state
        merged (merge_state); eviction totals the saved ranks' mean (the logged mean over ranks goes
        on); the sampler restarts from `seed`."""
        merged, score, used = [], [], []
        for d in parts:
            slots = d["valid"].nonzero().squeeze(1)
            flat = {f.name: d[f.name][slots] for f in fields(Rollouts) if f.name not in RAGGED}
            merged.append(Rollouts(**flat, tokens=d["tokens"].long(), behav_logp=d["behav_logp"]))
            score.append(d["score"][slots])
            used.append(d["used"][slots])
        rows, score, used = Rollouts.cat(merged, self.pad_id), torch.cat(score), torch.cat(used)
        _, prompt_rank = torch.unique(rows.prompt_idx, return_inverse=True)
        mine = torch.nonzero(prompt_rank % world == rank).squeeze(1)
        mine = mine[torch.argsort(rows.born[mine], stable=True)]  # oldest first, then rank, slot
        if len(mine):
            slots = self._write(rows.select(mine), score[mine])
            self.used[slots] = used[mine][len(mine) - len(slots) :]
        for k in self.STATE:
            setattr(self, k, self.merge_state([d[k] for d in parts]))
        self.evicted = {k: sum(d["evicted"][k] for d in parts) // len(parts) for k in self.evicted}
        self.last = dict(parts[0]["last"])
        self.gen.manual_seed(seed)

    @staticmethod
    def merge_state(values: list):
        """One STATE attribute from the saved ranks' values: tensors of ids are united, flags or-ed;
        anything else keeps rank 0's value (a strategy with other state overrides this)."""
        if torch.is_tensor(values[0]):
            return torch.unique(torch.cat(values))
        if isinstance(values[0], bool):
            return any(values)
        return values[0]

    # ---- storage

    def _write(self, new: Rollouts, score: torch.Tensor | None = None) -> torch.Tensor:
        """Store rows at the ring head, overwriting the oldest slots once full. Returns the slots written."""
        C, L = len(self.valid), self.rows.tokens.shape[1]
        if len(new) and int(new.seq_len.max()) > L:
            raise ValueError(f"replay: a rollout of {int(new.seq_len.max())} tokens exceeds max_len={L}")
        if len(new) > C:  # only the newest C rows fit
            self.evicted["capacity"] += len(new) - C
            keep = torch.arange(len(new) - C, len(new))
            new, score = new.select(keep), None if score is None else score[keep]
        slots = (self.head + torch.arange(len(new))) % C
        self.evicted["capacity"] += int(self.valid[slots].sum())
        for f in fields(Rollouts):
            src, dst = getattr(new, f.name), getattr(self.rows, f.name)
            if dst.dim() == 2:  # columns past max_len can only be padding
                dst[slots] = self.pad_id if f.name == "tokens" else 0
                dst[slots, : min(L, src.shape[1])] = src[:, :L].to(dst.dtype)
            else:
                dst[slots] = src.to(dst.dtype)
        self.valid[slots], self.used[slots], self.score[slots] = True, 0.0, 0.0 if score is None else score.float()
        self.head = (self.head + len(new)) % C
        return slots

    def _read(self, slots: torch.Tensor, fresh: Rollouts, onpolicy: bool = False) -> Rollouts:
        """The stored rows at `slots`, marked replayed, with their advantage per replay.advantage; notes their reuse
        and age in the metrics."""
        rows, n = self._select(slots), len(slots)
        rows.replayed, rows.onpolicy, rows.slot = torch.ones(n, dtype=torch.bool), torch.full((n,), onpolicy), slots
        if self.cfg.advantage == "recompute":
            rows.advantage = self._recomputed(rows, fresh)
        self.used.index_add_(0, slots, torch.ones(n))  # a slot may be drawn twice
        self._note(rows, fresh, self.used.max().item() if n else 0.0)
        return rows

    def _note(self, rows: Rollouts, fresh: Rollouts, reuse_max: float) -> None:
        """The replay metrics of this step's replayed `rows`."""
        n = len(rows)
        age = (fresh.born.max() - rows.born).float() if n and len(fresh) else torch.zeros(1)
        self.last = {"sampled": n, "replayed_share": n / max(1, n + len(fresh)), "age_mean": age.mean().item(),
                     "age_max": age.max().item(), "reuse_max": reuse_max}

    def _select(self, slots: torch.Tensor) -> Rollouts:
        """The stored rows at `slots`, token ids back to int64 as every batch holds them."""
        rows = self.rows.select(slots)
        rows.tokens = rows.tokens.long()
        return rows

    def _evict(self, mask: torch.Tensor, reason: str) -> None:
        self.evicted[reason] += int((mask & self.valid).sum())
        self.valid &= ~mask

    def _stored(self) -> torch.Tensor:  # (N,) slots holding a row
        return self.valid.nonzero().squeeze(1)

    def _recomputed(self, rows: Rollouts, fresh: Rollouts) -> torch.Tensor:
        """Advantage of each replayed row against its prompt's current rewards (see the module docstring)."""
        out = rows.advantage.clone()
        for i, p in enumerate(rows.prompt_idx.tolist()):
            in_batch = fresh.prompt_idx == p
            ref = (torch.cat([fresh.reward[in_batch], rows.reward[i : i + 1]]) if in_batch.any()  # the row joins
                   else self.rows.reward[self.valid & (self.rows.prompt_idx == p)]).double()
            s = group_stats(ref, torch.zeros(len(ref), dtype=torch.long))  # one group
            spread = len(ref) >= 2 and s.std[0].item() > 1e-6
            if spread or in_batch.any():  # a group without spread gives 0, as grpo's does
                out[i] = (rows.reward[i] - s.mean[0]) / (s.std[0] + 1e-6) if spread else 0.0
        return out

    def _first_per_prompt(self, slots: torch.Tensor, key: torch.Tensor, n: int) -> torch.Tensor:
        """Of `slots`, the n with the smallest `key` within each prompt."""
        slots = slots[torch.argsort(key, stable=True)]
        slots = slots[torch.argsort(self.rows.prompt_idx[slots], stable=True)]
        _, counts = torch.unique_consecutive(self.rows.prompt_idx[slots], return_counts=True)
        rank = torch.arange(len(slots)) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
        return slots[rank < n]


STRATEGIES[Replay.name] = Replay


class UniformReplay(Replay):
    """uniform (replay-buffer study): a FIFO of the latest `capacity` rollouts, drawn uniformly without removal
    (distinct rows within one batch); `ratio` is the replayed share of the update batch; rows older than
    `max_age` steps are evicted."""

    name = "uniform"

    @staticmethod
    def check(cfg):
        return {"ratio": (0 <= cfg.ratio < 1, "in [0, 1) for uniform (the replayed share of the batch)"),
                "max_age": (cfg.max_age >= 0, "≥ 0 (0 = no limit)")}

    def push(self, batch, step, entropy):
        self._write(batch.select(~batch.replayed))

    def sample(self, fresh, step):
        if self.cfg.max_age > 0:
            self._evict(step - self.rows.born > self.cfg.max_age, "age")
        k = min(round(self.cfg.ratio / (1 - self.cfg.ratio) * len(fresh)), len(self))
        key = torch.where(self.valid, torch.rand(len(self.valid), generator=self.gen), -1.0)  # (C,) in [0, 1) if stored
        return Rollouts.cat([fresh, self._read(key.topk(k).indices, fresh)], self.pad_id)  # a uniform k-subset


class AperReplay(Replay):
    """aper (rollout-level advantage-prioritized replay): rows with A = 0 are not stored, rows older than `tau_max`
    steps are evicted, and every update batch is all fresh rows plus k = round(ratio · n_fresh) rows drawn with
    replacement, P(row) ∝ |A|^alpha + priority_eps (A at birth), as in prioritized experience replay."""

    name, METRICS = "aper", ("priority_min", "priority_max")

    @staticmethod
    def check(cfg):
        return {"ratio": (0 <= cfg.ratio <= 4, "in [0, 4] for aper (replayed rows per fresh row)"),
                "tau_max": (cfg.tau_max >= 1, "≥ 1"), "alpha": (0 <= cfg.alpha < 100, "in [0, 100)"),
                "priority_eps": (0 < cfg.priority_eps < 1e6, "> 0")}

    def push(self, batch, step, entropy):
        fresh = batch.select(~batch.replayed & (batch.advantage.abs() > 1e-6))  # A = 0 carries no gradient
        self._write(fresh, fresh.advantage.abs().pow(self.cfg.alpha) + self.cfg.priority_eps)

    def sample(self, fresh, step):
        self._evict(step - self.rows.born > self.cfg.tau_max, "age")
        k = min(round(self.cfg.ratio * len(fresh)), len(self))  # never more draws than stored rows
        weight = torch.where(self.valid, self.score, 0.0)  # (C,)
        # With replacement, a row's expected count in the batch is exactly k · P(row); a high-|A| row may appear twice.
        slots = torch.multinomial(weight, k, replacement=True, generator=self.gen) if k else self._stored()[:0]
        rows = self._read(slots, fresh)
        if k:
            self.last |= {"priority_min": self.score[self.valid].min().item(), "priority_max": weight.max().item()}
        return Rollouts.cat([fresh, rows], self.pad_id)


class PhaseOne:
    """RLEP's phase-I store: every verified success of `rlep_source`, kept whole beside the ring
    (never evicted, whatever `capacity` is). Ragged: the completions' int32 ids in one flat tensor
    with row offsets, rows sorted by prompt, so a prompt's rows are one range. No log-probs: RLEP
    treats its replayed rows as on-policy (the loss never reads their behaviour log-probs). 4 bytes
    per completion token on every rank; no checkpoint holds it (the file is its source): the file's
    sha256 and each row's replay count do."""

    def __init__(self, completions: list[list[int]], prompt_idx: list[int], n_prompts: int,
                 sha256: str):
        order = sorted(range(len(completions)), key=prompt_idx.__getitem__)  # stable: file order
        lengths = torch.tensor([len(completions[i]) for i in order])
        self.ids = torch.tensor([t for i in order for t in completions[i]], dtype=torch.int32)
        self.offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])  # (N + 1,)
        self.prompt_idx = torch.tensor([prompt_idx[i] for i in order], dtype=torch.long)  # (N,)
        self.first = torch.searchsorted(self.prompt_idx, torch.arange(n_prompts + 1))  # (P + 1,)
        self.used = torch.zeros(len(order), dtype=torch.int32)  # (N,) times each row was replayed
        self.sha256 = sha256

    def __len__(self) -> int:
        return len(self.prompt_idx)

    def completion(self, i: int) -> list[int]:
        return self.ids[self.offsets[i] : self.offsets[i + 1]].tolist()

    def draw(self, prompts: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
        """Up to n rows of each of `prompts` (unique ids), uniformly without replacement: the n
        smallest of one uniform key per row of theirs."""
        lo, counts = self.first[prompts], self.first[prompts + 1] - self.first[prompts]  # (K,)
        start = torch.cumsum(counts, 0) - counts  # (K,) where each prompt's rows begin among `rows`
        rank = torch.arange(int(counts.sum())) - torch.repeat_interleave(start, counts)
        rows = torch.repeat_interleave(lo, counts) + rank  # (R,) every row of these prompts
        key = torch.rand(len(rows), generator=gen)
        owner = torch.repeat_interleave(torch.arange(len(prompts)), counts)
        order = torch.argsort(owner * 2.0 + key, stable=True)  # by prompt, then by key (< 1)
        return rows[order][rank < n]

    def rollouts(self, rows: torch.Tensor, prompts: list, pad_id: int, reward: float) -> Rollouts:
        """The stored `rows` as replayed, on-policy, verified-correct rollouts (slot -1)."""
        n = len(rows)
        if not n:
            return Rollouts.empty(0, 1, pad_id)
        parts = []
        for i in rows.tolist():
            prompt = prompts[int(self.prompt_idx[i])]
            seq = prompt + self.completion(i)
            parts.append((seq, len(prompt), [0.0] * (len(seq) - len(prompt)), False, 0.0))
        out = pack(parts, pad_id, self.prompt_idx[rows], torch.full((n,), -1), 0)
        out.reward = torch.full((n,), reward)
        out.correct = torch.ones(n, dtype=torch.bool)
        out.replayed = torch.ones(n, dtype=torch.bool)
        self.used.index_add_(0, rows, torch.ones(n, dtype=torch.int32))
        return out


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class RlepReplay(Replay):
    """rlep: a store of verified-correct answers; before advantages, up to `rlep_n` random successes
    of the same prompt join each fresh group (onpolicy: their log-probs count as the current
    policy's, as RLEP recomputes them). Phase I comes from `rlep_source`, kept whole in its own
    store (PhaseOne: `capacity` does not apply); without it the ring fills from this run's own
    verified successes ("online RLEP", a departure: the paper collects them from a finished run)."""

    name = "rlep"

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.store, self.prompts, self.reward = None, [], 0.0

    @staticmethod
    def check(cfg):
        return {"rlep_n": (cfg.rlep_n >= 1, "≥ 1")}

    def __len__(self) -> int:
        return super().__len__() + (len(self.store) if self.store else 0)

    def start(self, problems, prompts, tokenizer, cfg, entropy=None):
        """Phase I from `rlep_source`: JSONL rows {"problem": text (or "prompt_idx": i),
        "completion_ids": [...]} as eval.py --save-correct writes them: the sampled tokens are
        replayed exactly. A text-only row ({"completion": text}) is tokenized, the end token
        appended. A row that names no training prompt, or would be cut (over
        rollout.max_new_tokens), is refused. The tokens phase I generated come from
        `<rlep_source>.meta.json`."""
        if not self.cfg.rlep_source:
            return 0
        path, ids, owner = self.cfg.rlep_source, [], []
        for i, done, _ in read_rlep_source(path, problems, tokenizer, cfg.rollout.max_new_tokens):
            ids.append(done)
            owner.append(i)
        self.store = PhaseOne(ids, owner, len(prompts), file_sha256(path))
        self.prompts, self.reward = prompts, cfg.reward.correct
        return rlep_generated_tokens(path)

    def push(self, batch, step, entropy):
        if not self.cfg.rlep_source:  # online RLEP: the store grows from this run's own verified successes
            self._write(batch.select(~batch.replayed & batch.correct))

    def before_advantages(self, fresh, step):
        gid, first = torch.unique(fresh.group, return_inverse=True)
        prompt_of = torch.zeros_like(gid).scatter_(0, first, fresh.prompt_idx)  # (groups,) the prompt of each group
        if self.store is None:
            stored = self._stored()
            stored = stored[torch.isin(self.rows.prompt_idx[stored], prompt_of)]
            key = torch.rand(len(stored), generator=self.gen)
            slots = self._first_per_prompt(stored, key, self.cfg.rlep_n)
            rows = self._read(slots, fresh, onpolicy=True)
        else:
            drawn = self.store.draw(torch.unique(prompt_of), self.cfg.rlep_n, self.gen)
            rows = self.store.rollouts(drawn, self.prompts, self.pad_id, self.reward)
            self._note(rows, fresh, float(self.store.used.max()) if len(drawn) else 0.0)
        order = torch.argsort(prompt_of, stable=True)  # a prompt in two groups feeds the first of them
        rows.group = gid[order[torch.searchsorted(prompt_of[order], rows.prompt_idx)]]
        mixed = Rollouts.cat([fresh, rows], self.pad_id)
        return mixed.select(torch.argsort(mixed.group, stable=True))  # each group's rows adjacent, fresh first

    def state_dict(self):
        """The ring (online RLEP's rows); with a source, its sha256 and replay counts (no rows)."""
        store = self.store or PhaseOne([], [], 0, "")
        own = {"source_sha256": store.sha256, "source_used": store.used.clone()}
        return super().state_dict() | own

    def load_state_dict(self, d):
        self._same_source(d)
        super().load_state_dict(d)
        if self.store:
            self.store.used = d["source_used"].clone()

    def load_split(self, parts, rank, world, seed):
        """As the base; phase I's replay counts are the saved ranks' sums (each rank holds it)."""
        self._same_source(parts[0])
        super().load_split(parts, rank, world, seed)
        if self.store:
            counts = torch.stack([d["source_used"] for d in parts])
            self.store.used = counts.sum(0, dtype=torch.int32)

    def _same_source(self, d: dict) -> None:
        sha = self.store.sha256 if self.store else ""
        if d["source_sha256"] != sha:
            raise ValueError(f"replay.rlep_source {self.cfg.rlep_source} is not the file this run "
                             "started from (its sha256 differs)")


def read_rlep_source(path: str, problems: list, tokenizer, max_new_tokens: int) -> list[tuple]:
    """RLEP phase I's solutions in `path` as (prompt index, completion ids cut to max_new_tokens,
    behaviour log-probs, zeros when the row has none), every field checked: ValueError naming file,
    line and field. Rows as eval.py --save-correct writes them ({"problem": text or "prompt_idx": i,
    "completion_ids": [...], "behav_logp": [...]}); a text-only row ({"completion": text}) is
    tokenized, the end token appended."""
    by_problem, rows = {p.problem: i for i, p in enumerate(problems)}, []
    vocab = len(tokenizer) if tokenizer is not None else 2**63  # (None: every row carries its ids)
    size = os.stat(path).st_size if os.path.exists(path) else 0
    if size * PARSED_BYTES > machine_memory():
        raise ValueError(f"{path} is {size / 2**30:.1f} GB, more than this machine holds parsed")
    for n, r in jsonl_rows(path):
        where = f"{path}:{n}"
        i = r.get("prompt_idx")
        if i is None and not isinstance(r.get("problem"), str):
            raise ValueError(f"{where}: problem must be its text (or prompt_idx its index)")
        i = by_problem.get(r["problem"]) if i is None else i
        if i is None:
            raise ValueError(f"{where}: problem is not among the training problems (data.train)")
        if type(i) is not int or not 0 <= i < len(problems):
            raise ValueError(f"{where}: prompt_idx must be an integer in [0, {len(problems)}), "
                             f"got {_short(i)}")
        ids = r.get("completion_ids")
        if ids is None and isinstance(r.get("completion"), str) and r["completion"]:
            ids = tokenizer(r["completion"], add_special_tokens=False)["input_ids"]
            ids.append(tokenizer.eos_token_id)
        known = isinstance(ids, list) and all(type(t) is int and 0 <= t < vocab for t in ids)
        if not ids or not known:
            raise ValueError(f"{where}: completion_ids must be a non-empty list of token ids in "
                             f"[0, {vocab}) (or completion a text), got {_short(ids)}")
        lp = r.get("behav_logp", [])
        if not isinstance(lp, list) or not all(_log_prob(x) for x in lp):
            raise ValueError(f"{where}: behav_logp must be a list of log-probabilities (numbers "
                             f"≤ 0), got {_short(lp)}")
        if len(ids) > max_new_tokens:  # cut, it would no longer be the verified solution
            raise ValueError(f"{where}: completion_ids holds {len(ids)} tokens, over "
                             f"rollout.max_new_tokens ({max_new_tokens}): it would be cut")
        rows.append((i, ids, lp[: len(ids)] if len(lp) >= len(ids) else [0.0] * len(ids)))
    if not rows:
        raise ValueError(f"replay.rlep_source {path} holds no solutions")
    return rows


def rlep_generated_tokens(path: str) -> int:
    """The tokens phase I generated, from `<path>.meta.json` (0 without one); ValueError naming the
    file."""
    meta = Path(path + ".meta.json")
    if not meta.exists():
        return 0
    with open_regular(meta, 1 << 20) as f:
        d = json_line(f.read(), meta, 1) or {}
    n = d.get("generated_tokens", 0)
    if type(n) is not int or n < 0:
        raise ValueError(f"{meta}: generated_tokens must be an integer ≥ 0, got {_short(n)}")
    return n


def _log_prob(x) -> bool:
    return type(x) in (int, float) and -math.inf < x <= 0


def _short(value) -> str:
    return json.dumps(value)[:40]


class ExgrpoReplay(Replay):
    """exgrpo, as released (ExGRPO in ElliottYan/LUFFY: mix_trainer_experience.py, experience_collate_fn.py,
    weighted_bucket_sampler.py, run_exgrpo.sh; each default below is the release's):
    - experience starts once a step's rollouts (every rank's) are more than exgrpo_min_solve correct, and stays on;
    - from then on, a question with k of its G rollouts correct, 0 < k < G, keeps each new correct trajectory (with
      its behaviour log-probs; no duplicates) and its latest k; a question solved by all G is retired: dropped from
      the buffer and from fresh sampling (the release drops it from fresh sampling at its next epoch; here at once);
    - each step n_exp = min(questions stored, int(ratio · prompts)) experience questions take the place of the
      step's last stream questions: a bucket k is drawn with weight N(k; G/2, σ = exgrpo_sigma successes), then one
      of its questions uniformly, without replacement (an emptied bucket's weight goes to the others);
    - an experience question gets G − 1 fresh rollouts plus its stored success of lowest mean token entropy under the
      current policy, measured when the batch is assembled; advantages are computed over that mixed group of G;
    - the replayed row is off-policy: its ratio is taken against the stored behaviour log-probs (the release shapes
      it as r / (r + 0.1), unclipped: grpo.offpolicy=shaped in configs/papers/exgrpo_qwen25_math_7b.yaml).
    Not matched: the release adds an entropy bonus (0.001; here entropy is only measured) and skips updates whose
    gradient norm passes 500; its store has no size bound (here `capacity` rows, overwritten oldest first)."""

    name, STATE, METRICS = "exgrpo", ("retired", "latched", "chosen"), ("experience_on", "retired")

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.retired, self.chosen, self.latched = self._stored()[:0], self._stored()[:0], False  # empty int64

    @staticmethod
    def check(cfg):
        return {"ratio": (0 <= cfg.ratio < 1, "in [0, 1) for exgrpo (the share of a step's questions)"),
                "exgrpo_sigma": (0 < cfg.exgrpo_sigma < 1e6, "> 0"),
                "exgrpo_min_solve": (0 <= cfg.exgrpo_min_solve <= 1, "in [0, 1]")}

    def plan(self, idx, G, step):
        n, retired = len(idx), set(self.retired.tolist())
        idx = [i for i in idx if i not in retired]
        stored = self._stored()
        pool, first = torch.unique(self.rows.prompt_idx[stored], return_inverse=True)
        k = torch.zeros(len(pool)).scatter_(0, first, self.score[stored])  # each question's latest success count
        drawn = self._draw(pool, k, min(len(pool), int(self.cfg.ratio * n)), G) if self.latched else pool[:0]
        if self.latched:  # every rank measures, even with nothing to measure: under FSDP a forward is collective
            candidates = stored[torch.isin(self.rows.prompt_idx[stored], drawn)]
            entropy = self.entropy_fn(self._select(candidates))
            self.chosen = self._first_per_prompt(candidates, entropy, 1)
        fresh = idx[: n - len(drawn)]
        return fresh + drawn.tolist(), [G] * len(fresh) + [G - 1] * len(drawn)

    def _draw(self, pool, k, n, G):
        """n questions: a bucket by its Gaussian weight among buckets with questions left, then one of them."""
        left = {b: pool[k == b][torch.randperm(int((k == b).sum()), generator=self.gen)].tolist()
                for b in k.unique().tolist()}
        out = []
        for _ in range(n):
            buckets = [b for b in left if left[b]]
            w = torch.tensor([math.exp(-0.5 * ((b - G / 2) / self.cfg.exgrpo_sigma) ** 2) for b in buckets])
            out.append(left[buckets[int(torch.multinomial(w, 1, generator=self.gen))]].pop())
        return torch.tensor(out, dtype=torch.long)

    def before_advantages(self, fresh, step):
        chosen = self.chosen[torch.isin(self.rows.prompt_idx[self.chosen], fresh.prompt_idx)]
        self.chosen = self.chosen[:0]
        rows = self._read(chosen, fresh)  # (a question dynamic sampling dropped keeps its stored row)
        by_prompt = dict(zip(fresh.prompt_idx.tolist(), fresh.group.tolist()))
        rows.group = torch.tensor([by_prompt[p] for p in rows.prompt_idx.tolist()], dtype=torch.long)
        mixed = Rollouts.cat([fresh, rows], self.pad_id)
        return mixed.select(torch.argsort(mixed.group, stable=True))

    def push(self, batch, step, entropy):
        s = group_stats(batch.correct, batch.group)
        k, n, inv = s.total, s.count, s.index  # successes and rows per group (replay included)
        solved = torch.unique(batch.prompt_idx[(k == n)[inv]])
        self.retired = torch.unique(torch.cat([self.retired, solved]))
        self._evict(torch.isin(self.rows.prompt_idx, solved), "retired")
        if self.latched:
            v = self.valid & torch.isin(self.rows.prompt_idx, batch.prompt_idx)  # duplicates can only be there
            seen = {(int(p), tuple(t[:n].tolist())) for p, t, n in zip(self.rows.prompt_idx[v], self.rows.tokens[v],
                                                                      self.rows.seq_len[v])}
            keep = []
            for i in range(len(batch)):
                row = (int(batch.prompt_idx[i]), tuple(batch.tokens[i, : batch.seq_len[i]].tolist()))
                if not batch.replayed[i] and batch.correct[i] and 0 < k[inv[i]] < n[inv[i]] and row not in seen:
                    keep.append(i)
                    seen.add(row)  # a completion sampled twice in one batch is kept once
            self._write(batch.select(torch.tensor(keep, dtype=torch.long)))
            for g in torch.nonzero((k > 0) & (k < n)).squeeze(1).tolist():  # every stored row learns its question's k
                self.score[self.valid & (self.rows.prompt_idx == batch.prompt_idx[inv == g][0])] = k[g]
        rate = all_ranks(torch.tensor([float(batch.correct.sum()), float(len(batch))]))
        self.latched = self.latched or bool(rate[0] > self.cfg.exgrpo_min_solve * rate[1])
        self.last |= {"experience_on": float(self.latched), "retired": float(len(self.retired))}


class GroupReplay(Replay):
    """group (zero-variance group substitution, the idea of TRL's GRPOWithReplayBufferTrainer, PR #4060): whole
    informative groups (reward spread > 0) are stored with their behaviour log-probs and advantages, priority
    Σ_i |A_i| · std(r), and evicted after tau_max steps; each zero-variance fresh group of the update is replaced by
    a stored group, drawn with probability ∝ priority without replacement (as many as are stored). Replayed rows keep
    their advantages and take the usual off-policy correction. A flat group is never stored; a group the ring
    overwrites in part is dropped whole."""

    name, METRICS = "group", ("groups_replaced", "flat_groups")

    @staticmethod
    def check(cfg):
        return {"tau_max": (cfg.tau_max >= 1, "≥ 1")}

    def push(self, batch, step, entropy):
        fresh = batch.select(~batch.replayed)
        s = group_stats(fresh.reward, fresh.group)
        ids, inv, std = s.ids, s.index, s.std
        priority = torch.zeros(len(ids), dtype=torch.float64).index_add_(0, inv, fresh.advantage.abs().double()) * std
        keep = (std > 0)[inv]
        size = torch.bincount(inv, minlength=len(ids)) * (std > 0)  # (K,) rows each group would store
        fits = (size.flip(0).cumsum(0).flip(0) <= len(self.valid))[inv]  # the last groups that fit whole
        self.evicted["capacity"] += int((keep & ~fits).sum())
        keep &= fits
        next_slots = (self.head + torch.arange(min(int(keep.sum()), len(self.valid)))) % len(self.valid)
        overwritten = self.rows.group[next_slots][self.valid[next_slots]]
        self._evict(torch.isin(self.rows.group, overwritten), "capacity")  # never keep part of a group
        self._write(fresh.select(keep), priority[inv][keep])

    def sample(self, fresh, step):
        self._evict(step - self.rows.born > self.cfg.tau_max, "age")
        s = group_stats(fresh.reward, fresh.group)
        ids, std = s.ids, s.std
        stored = self._stored()
        groups, first = torch.unique(self.rows.group[stored], return_inverse=True)
        priority = torch.zeros(len(groups)).scatter_(0, first, self.score[stored])
        m = min(int((std == 0).sum()), len(groups))
        take = groups[torch.multinomial(priority, m, replacement=False, generator=self.gen)] if m else groups[:0]
        drop = ids[std == 0][:m]
        replayed = self._read(stored[torch.isin(self.rows.group[stored], take)], fresh)
        self.last |= {"groups_replaced": float(m), "flat_groups": float((std == 0).sum())}
        return Rollouts.cat([fresh.select(~torch.isin(fresh.group, drop)), replayed], self.pad_id)


def row_bytes(max_len: int) -> int:
    """Bytes of one Rollouts row of `max_len` tokens, every field included."""
    row = Rollouts.empty(1, 1, 0)
    sizes = [getattr(row, f.name) for f in fields(Rollouts)]
    return sum(t.element_size() * (max_len if t.dim() == 2 else 1) for t in sizes)


def buffer_bytes(cfg: ReplayConfig, max_len: int) -> int:
    """Bytes the buffer preallocates for rows of up to `max_len` tokens (0 for none, which stores
    nothing): a Rollouts row per slot, and its `valid`, `used` and `score`."""
    if STRATEGIES.get(cfg.strategy, Replay) is Replay:
        return 0
    return cfg.capacity * (row_bytes(max_len) + 1 + 4 + 4)


def make_replay(cfg: ReplayConfig, max_len: int, pad_id: int, seed: int) -> Replay:
    """The buffer for `cfg.strategy`, its sampling generator seeded from `seed`; a bad config raises ValueError."""
    bad = [f"replay.{k} must be {rule}, got {getattr(cfg, k)!r}" for k, (ok, rule) in cfg.check().items() if not ok]
    if bad:
        raise ValueError(bad[0])
    return STRATEGIES[cfg.strategy](cfg, max_len, pad_id, seed)
