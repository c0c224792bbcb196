"""Experience replay for GRPO: one rollout-level buffer and the strategies behind `replay.strategy`.

Storage: `capacity` rows of preallocated CPU tensors, a `Rollouts` (int32 token ids and float32
behaviour log-probs of shape (capacity, max_len), and every per-row field), plus per slot `valid`,
`used` (times replayed) and `score` (a strategy's own number: a priority, a success count). A write
fills the slots after the previous one, so a full buffer overwrites its oldest rows (eviction
"capacity"); evictions by age or retirement clear `valid`. A checkpoint holds the occupied rows.

A strategy is a subclass of `Replay` with a `name` (defining it registers it in STRATEGIES) that
overrides the hooks it needs: the README's "How to add a replay strategy" lists them and when
train.py calls them. Its randomness comes from the buffer's own generator, `self.gen`.

Advantages of replayed rows (`replay.advantage`): `stored` (default) is the advantage in the row's
own group at birth, as the buffer study and aper replay it. `recompute` re-centres the stored reward
against the prompt's current rewards as if the row joined them (its fresh group when the prompt is
in the batch, else its rows in the buffer; grpo's `group` scale), falling back to stored with < 2
rewards or no spread. Rows that join fresh groups (rlep, exgrpo) get advantages in the mixed group.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, fields

import torch

from data.solutions import PhaseOne, file_sha256, read_rlep_source, rlep_generated_tokens
from grpo import group_stats, no_grad_logprobs
from batch import Row, Rollouts, pack
from support import replay_state
from support.parallel import all_ranks

STRATEGIES: dict[str, type[Replay]] = {}


@dataclass
class ReplayConfig:
    strategy: str = "none"
    """a name in replay.STRATEGIES: none | uniform | aper | rlep | exgrpo | group, or one you add"""
    module: str = ""
    """a module to import first, for a strategy defined outside replay.py (`my_strategies` for
    my_strategies.py beside train.py or on PYTHONPATH); empty = none"""
    capacity: int = 4096
    """rows the buffer holds; memory is capacity × max_len × 8 bytes (int32 ids, fp32 log-probs)"""
    ratio: float = 0.5
    """uniform: replayed share of the update batch (< 1); aper: replayed rows per fresh row (≤ 4);
    exgrpo: share of a step's prompts taken from experience"""
    max_age: int = 0
    """uniform: evict rows older than this many steps; 0 = no limit (the study states none)"""
    tau_max: int = 4
    """aper, group: evict rows older than this many steps (≥ 1); the aper paper does not state it"""
    alpha: float = 1.0
    """aper: priority exponent in |A|^alpha + priority_eps (0 = uniform); the paper states none"""
    priority_eps: float = 1e-3
    """aper: priority floor, so every stored row stays drawable"""
    advantage: str = "stored"
    """advantage of replayed rows: stored (at birth) | recompute (against current rewards)"""
    rlep_n: int = 2
    """rlep: stored successes appended to each fresh group (the paper uses 2)"""
    rlep_source: str = ""
    """rlep: JSONL of phase-I solutions (eval.py --save-correct); empty = online RLEP"""
    exgrpo_sigma: float = 1.0
    """exgrpo: width of the Gaussian bucket weight centred on G/2, in successes (the release: 1)"""
    exgrpo_min_solve: float = 0.35
    """exgrpo: experience starts (for good) once more than this share of a step's rows is correct"""

    def check(self) -> dict[str, tuple[bool, str]]:
        # ".x" is a relative import (import_module's TypeError: no package to be relative to)
        found = not self.module or (not self.module.startswith(".") and imports(self.module))
        known = self.strategy in STRATEGIES
        rlep_only = not self.rlep_source or self.strategy == "rlep"
        rules = {
            "module": (found, "a module name on sys.path (a file's name without .py)"),
            "strategy": (known, f"one of {', '.join(STRATEGIES)} (or one in replay.module)"),
            "capacity": (self.capacity >= 1, "≥ 1"),
            "advantage": (self.advantage in ("stored", "recompute"), "stored or recompute"),
            "rlep_source": (rlep_only, "empty: it is read by rlep only"),
        }
        if known:
            rules |= STRATEGIES[self.strategy].check(self)
        return rules


def imports(module: str) -> bool:
    """Import `module` (defining its strategies registers them); False if there is none."""
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as e:
        if not (module + ".").startswith(f"{e.name}."):  # found, but it imports a missing module
            raise
        return False
    return True


class Replay:
    """none: plain on-policy GRPO. The base stores nothing, adds nothing, draws no random number."""

    name = "none"
    STATE = ()  # attributes state_dict keeps beside the rows
    METRICS = ()  # the strategy's own replay/* keys

    def __init_subclass__(cls, **kw):  # defining a strategy registers it under its name
        super().__init_subclass__(**kw)
        STRATEGIES[cls.name] = cls

    @staticmethod
    def check(cfg: ReplayConfig) -> dict[str, tuple[bool, str]]:
        return {}

    def __init__(self, cfg: ReplayConfig, max_len: int, pad_id: int, seed: int):
        C = cfg.capacity if type(self) is not Replay else 0
        self.cfg = cfg
        self.pad_id = pad_id
        self.head = 0  # the slot the next write starts at
        self.entropy_fn = None
        self.rows = Rollouts.empty(C, max_len, pad_id)
        self.rows.tokens = self.rows.tokens.int()  # ids < 2^31: half the bytes of int64
        self.valid = torch.zeros(C, dtype=torch.bool)
        self.used = torch.zeros(C)
        self.score = torch.zeros(C)
        self.gen = torch.Generator().manual_seed(seed)
        self.evicted = {"capacity": 0, "age": 0, "retired": 0}  # totals since the start of the run
        self.last = {}  # about the rows replayed at the latest step

    def __len__(self) -> int:
        return int(self.valid.sum())

    # ---- the hooks train.py calls (README: "How to add a replay strategy")

    def start(self, problems: list, prompts: list[list[int]], tokenizer, cfg, entropy=None) -> int:
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
        """The same keys every step (ranks add them up): size, evictions, the replayed rows."""
        m = {"replay/size": float(len(self))}
        for k, v in self.evicted.items():
            m[f"replay/evicted_{k}"] = float(v)
        for k in ("sampled", "replayed_share", "age_mean", "age_max", "reuse_max", *self.METRICS):
            m[f"replay/{k}"] = float(self.last.get(k, 0.0))
        return m

    def state_dict(self) -> dict:
        """The occupied rows, every slot's fields and STATE (support/replay_state.py)."""
        return replay_state.state_dict(self)

    def load_state_dict(self, d: dict) -> None:
        replay_state.load_state_dict(self, d)

    # ---- storage, for the strategies

    def write(self, new: Rollouts, score: torch.Tensor | None = None) -> torch.Tensor:
        """Store rows at the ring head (overwriting the oldest once full); returns their slots."""
        C, L = len(self.valid), self.rows.tokens.shape[1]
        longest = int(new.seq_len.max()) if len(new) else 0
        if longest > L:
            raise ValueError(f"replay: a rollout of {longest} tokens exceeds max_len={L}")
        if score is None:
            score = torch.zeros(len(new))
        if len(new) > C:  # only the newest C rows fit
            self.evicted["capacity"] += len(new) - C
            keep = torch.arange(len(new) - C, len(new))
            new = new.select(keep)
            score = score[keep]
        slots = (self.head + torch.arange(len(new))) % C
        self.evicted["capacity"] += int(self.valid[slots].sum())
        for f in fields(Rollouts):
            src, dst = getattr(new, f.name), getattr(self.rows, f.name)
            if dst.dim() == 2:  # columns past max_len can only be padding
                dst[slots] = self.pad_id if f.name == "tokens" else 0
                dst[slots, : min(L, src.shape[1])] = src[:, :L].to(dst.dtype)
            else:
                dst[slots] = src.to(dst.dtype)
        self.valid[slots] = True
        self.used[slots] = 0.0
        self.score[slots] = score.float()
        self.head = (self.head + len(new)) % C
        return slots

    def read(self, slots: torch.Tensor, fresh: Rollouts, onpolicy: bool = False) -> Rollouts:
        """The stored rows at `slots`, marked replayed, with their advantage per replay.advantage;
        notes their reuse and age in the metrics."""
        rows = self._select(slots)
        n = len(slots)
        rows.replayed = torch.ones(n, dtype=torch.bool)
        rows.onpolicy = torch.full((n,), onpolicy)
        rows.slot = slots
        if self.cfg.advantage == "recompute":
            rows.advantage = self._recomputed(rows, fresh)
        self.used.index_add_(0, slots, torch.ones(n))  # a slot may be drawn twice
        self._note(rows, fresh, self.used.max().item() if n else 0.0)
        return rows

    def evict(self, mask: torch.Tensor, reason: str) -> None:
        """Drop the stored rows where `mask` (C,) is set, counted in replay/evicted_{reason}."""
        self.evicted[reason] += int((mask & self.valid).sum())
        self.valid &= ~mask

    def stored(self) -> torch.Tensor:  # (N,) slots holding a row
        return self.valid.nonzero().squeeze(1)

    def _select(self, slots: torch.Tensor) -> Rollouts:
        """The stored rows at `slots`, token ids back to int64 as every batch holds them."""
        rows = self.rows.select(slots)
        rows.tokens = rows.tokens.long()
        return rows

    def _note(self, rows: Rollouts, fresh: Rollouts, reuse_max: float) -> None:
        """The replay metrics of this step's replayed `rows`."""
        n = len(rows)
        age = (fresh.born.max() - rows.born).float() if n and len(fresh) else torch.zeros(1)
        self.last = {"sampled": n, "replayed_share": n / max(1, n + len(fresh))}
        self.last["age_mean"] = age.mean().item()
        self.last["age_max"] = age.max().item()
        self.last["reuse_max"] = reuse_max

    def _recomputed(self, rows: Rollouts, fresh: Rollouts) -> torch.Tensor:
        """Each replayed row's advantage against its prompt's current rewards (module docstring)."""
        out = rows.advantage.clone()
        for i, p in enumerate(rows.prompt_idx.tolist()):
            in_batch = fresh.prompt_idx == p
            if in_batch.any():  # the row joins its prompt's fresh group
                ref = torch.cat([fresh.reward[in_batch], rows.reward[i : i + 1]])
            else:  # the prompt's rows in the buffer
                ref = self.rows.reward[self.valid & (self.rows.prompt_idx == p)]
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
        start = torch.cumsum(counts, 0) - counts  # where each prompt's slots begin
        rank = torch.arange(len(slots)) - torch.repeat_interleave(start, counts)
        return slots[rank < n]


STRATEGIES[Replay.name] = Replay


class UniformReplay(Replay):
    """uniform (replay-buffer study): a FIFO of the latest `capacity` rollouts, drawn uniformly
    without removal (distinct rows within one batch); `ratio` is the replayed share of the update
    batch; rows older than `max_age` steps are evicted."""

    name = "uniform"

    @staticmethod
    def check(cfg):
        share = "in [0, 1) for uniform (the replayed share of the batch)"
        return {"ratio": (0 <= cfg.ratio < 1, share),
                "max_age": (cfg.max_age >= 0, "≥ 0 (0 = no limit)")}

    def push(self, batch, step, entropy):
        self.write(batch.select(~batch.replayed))

    def sample(self, fresh, step):
        if self.cfg.max_age > 0:
            self.evict(step - self.rows.born > self.cfg.max_age, "age")
        k = min(round(self.cfg.ratio / (1 - self.cfg.ratio) * len(fresh)), len(self))
        key = torch.rand(len(self.valid), generator=self.gen)  # (C,)
        key = torch.where(self.valid, key, -1.0)  # the top k stored keys: a uniform k-subset
        return Rollouts.cat([fresh, self.read(key.topk(k).indices, fresh)], self.pad_id)


class AperReplay(Replay):
    """aper (rollout-level advantage-prioritized replay): rows with A = 0 are not stored, rows older
    than `tau_max` steps are evicted, and every update batch is all fresh rows plus
    k = round(ratio · n_fresh) rows drawn with replacement, P(row) ∝ |A|^alpha + priority_eps (A at
    birth), as in prioritized experience replay."""

    name = "aper"
    METRICS = ("priority_min", "priority_max")

    @staticmethod
    def check(cfg):
        return {"ratio": (0 <= cfg.ratio <= 4, "in [0, 4] for aper (replayed rows per fresh row)"),
                "tau_max": (cfg.tau_max >= 1, "≥ 1"),
                "alpha": (0 <= cfg.alpha < 100, "in [0, 100)"),
                "priority_eps": (0 < cfg.priority_eps < 1e6, "> 0")}

    def push(self, batch, step, entropy):
        fresh = batch.select(~batch.replayed & (batch.advantage.abs() > 1e-6))  # A = 0: no gradient
        self.write(fresh, fresh.advantage.abs().pow(self.cfg.alpha) + self.cfg.priority_eps)

    def sample(self, fresh, step):
        self.evict(step - self.rows.born > self.cfg.tau_max, "age")
        k = min(round(self.cfg.ratio * len(fresh)), len(self))  # never more draws than stored rows
        weight = torch.where(self.valid, self.score, 0.0)  # (C,)
        slots = self.stored()[:0]
        if k:  # with replacement: a row's expected count is k · P(row); it may come twice
            slots = torch.multinomial(weight, k, replacement=True, generator=self.gen)
        rows = self.read(slots, fresh)
        if k:
            self.last["priority_min"] = self.score[self.valid].min().item()
            self.last["priority_max"] = weight.max().item()
        return Rollouts.cat([fresh, rows], self.pad_id)


class RlepReplay(Replay):
    """rlep: a store of verified-correct answers; before advantages, up to `rlep_n` random successes
    of the same prompt join each fresh group (onpolicy: their log-probs count as the current
    policy's, as RLEP recomputes them). Phase I comes from `rlep_source`, kept whole in its own
    store (PhaseOne: `capacity` does not apply); without it the ring fills from this run's own
    verified successes ("online RLEP", a departure: the paper collects them from a finished run)."""

    name = "rlep"

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.store = None  # a PhaseOne, with rlep_source
        self.prompts = []
        self.reward = 0.0  # of a verified-correct answer

    @staticmethod
    def check(cfg):
        return {"rlep_n": (cfg.rlep_n >= 1, "≥ 1")}

    def __len__(self) -> int:
        return super().__len__() + (len(self.store) if self.store else 0)

    def start(self, problems, prompts, tokenizer, cfg, entropy=None):
        """Phase I from `rlep_source`; returns the tokens it cost (its `.meta.json`)."""
        if not self.cfg.rlep_source:
            return 0
        path = self.cfg.rlep_source
        rows = read_rlep_source(path, problems, tokenizer, cfg.rollout.max_new_tokens)
        owner = [i for i, _ in rows]
        completions = [ids for _, ids in rows]
        self.store = PhaseOne(completions, owner, len(prompts), file_sha256(path))
        self.prompts = prompts
        self.reward = cfg.reward.correct
        return rlep_generated_tokens(path)

    def push(self, batch, step, entropy):
        if not self.cfg.rlep_source:  # online RLEP: the ring holds this run's verified successes
            self.write(batch.select(~batch.replayed & batch.correct))

    def before_advantages(self, fresh, step):
        gid, first = torch.unique(fresh.group, return_inverse=True)
        prompt_of = torch.zeros_like(gid).scatter_(0, first, fresh.prompt_idx)  # (K,) each group's
        if self.store is None:
            stored = self.stored()
            stored = stored[torch.isin(self.rows.prompt_idx[stored], prompt_of)]
            key = torch.rand(len(stored), generator=self.gen)
            slots = self._first_per_prompt(stored, key, self.cfg.rlep_n)
            rows = self.read(slots, fresh, onpolicy=True)
        else:
            drawn = self.store.draw(torch.unique(prompt_of), self.cfg.rlep_n, self.gen)
            rows = self.store.rollouts(drawn, self.prompts, self.pad_id, self.reward)
            self._note(rows, fresh, float(self.store.used.max()) if len(drawn) else 0.0)
        order = torch.argsort(prompt_of, stable=True)  # a prompt in two groups feeds the first one
        rows.group = gid[order[torch.searchsorted(prompt_of[order], rows.prompt_idx)]]
        mixed = Rollouts.cat([fresh, rows], self.pad_id)
        return mixed.select(torch.argsort(mixed.group, stable=True))  # groups adjacent, fresh first

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

    def merge_split(self, parts):
        """After support/replay_state.load_split: phase I's replay counts are the saved ranks'
        sums (each rank holds the whole store)."""
        self._same_source(parts[0])
        if self.store:
            counts = torch.stack([d["source_used"] for d in parts])
            self.store.used = counts.sum(0, dtype=torch.int32)

    def _same_source(self, d: dict) -> None:
        sha = self.store.sha256 if self.store else ""
        if d["source_sha256"] != sha:
            raise ValueError(f"replay.rlep_source {self.cfg.rlep_source} is not the file this run "
                             "started from (its sha256 differs)")


class ExgrpoReplay(Replay):
    """exgrpo, as released (ExGRPO in ElliottYan/LUFFY; the defaults are the release's). Once a
    step's rollouts (every rank's) are more than exgrpo_min_solve correct, and from then on, a
    question with k of G correct, 0 < k < G, keeps each new correct trajectory (no duplicates) and
    its latest k; one solved G/G retires from the buffer and from fresh sampling (the release: at
    its next epoch). Each step int(ratio · prompts) stored questions replace the last stream ones: a
    bucket k drawn ∝ N(k; G/2, exgrpo_sigma), then a question in it; each gets G − 1 fresh rows plus
    its stored success of lowest entropy under the current policy, advantages over that mixed group,
    its ratio against the stored log-probs (the release's r/(r + 0.1): grpo.offpolicy=shaped). Not
    matched: the release's entropy bonus (0.001), skip past gradient norm 500, unbounded store."""

    name = "exgrpo"
    STATE = ("retired", "latched", "chosen")
    METRICS = ("experience_on", "retired")

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.retired = torch.zeros(0, dtype=torch.long)  # questions solved by all their rows
        self.chosen = torch.zeros(0, dtype=torch.long)  # the slots plan picked for this step
        self.latched = False  # experience is on

    @staticmethod
    def check(cfg):
        share = "in [0, 1) for exgrpo (the share of a step's questions)"
        return {"ratio": (0 <= cfg.ratio < 1, share),
                "exgrpo_sigma": (0 < cfg.exgrpo_sigma < 1e6, "> 0"),
                "exgrpo_min_solve": (0 <= cfg.exgrpo_min_solve <= 1, "in [0, 1]")}

    def plan(self, idx, G, step):
        n = len(idx)
        retired = set(self.retired.tolist())
        idx = [i for i in idx if i not in retired]
        stored = self.stored()
        pool, first = torch.unique(self.rows.prompt_idx[stored], return_inverse=True)
        k = torch.zeros(len(pool)).scatter_(0, first, self.score[stored])  # latest success counts
        drawn = pool[:0]
        if self.latched:  # every rank measures, even nothing: under FSDP a forward is collective
            drawn = self._draw(pool, k, min(len(pool), int(self.cfg.ratio * n)), G)
            candidates = stored[torch.isin(self.rows.prompt_idx[stored], drawn)]
            entropy = self.entropy_fn(self._select(candidates))
            self.chosen = self._first_per_prompt(candidates, entropy, 1)
        fresh = idx[: n - len(drawn)]
        return fresh + drawn.tolist(), [G] * len(fresh) + [G - 1] * len(drawn)

    def _draw(self, pool, k, n, G):
        """n questions: a bucket by its Gaussian weight (of those not empty), then one of its."""
        left = {}  # each bucket's questions, shuffled
        for b in k.unique().tolist():
            mine = pool[k == b]
            left[b] = mine[torch.randperm(len(mine), generator=self.gen)].tolist()
        out = []
        for _ in range(n):
            buckets = [b for b in left if left[b]]
            z = [(b - G / 2) / self.cfg.exgrpo_sigma for b in buckets]
            w = torch.tensor([math.exp(-0.5 * x**2) for x in z])
            pick = torch.multinomial(w, 1, generator=self.gen)
            out.append(left[buckets[int(pick)]].pop())
        return torch.tensor(out, dtype=torch.long)

    def before_advantages(self, fresh, step):
        chosen = self.chosen[torch.isin(self.rows.prompt_idx[self.chosen], fresh.prompt_idx)]
        self.chosen = self.chosen[:0]
        rows = self.read(chosen, fresh)  # (a question dynamic sampling dropped keeps its row)
        group_of = dict(zip(fresh.prompt_idx.tolist(), fresh.group.tolist()))
        rows.group = torch.tensor([group_of[p] for p in rows.prompt_idx.tolist()], dtype=torch.long)
        mixed = Rollouts.cat([fresh, rows], self.pad_id)
        return mixed.select(torch.argsort(mixed.group, stable=True))

    def push(self, batch, step, entropy):
        s = group_stats(batch.correct, batch.group)
        k, n, inv = s.total, s.count, s.index  # successes and rows per group (replay included)
        solved = torch.unique(batch.prompt_idx[(k == n)[inv]])
        self.retired = torch.unique(torch.cat([self.retired, solved]))
        self.evict(torch.isin(self.rows.prompt_idx, solved), "retired")
        if self.latched:
            self._keep_successes(batch, inv, (k > 0) & (k < n), k)
        rate = all_ranks(torch.tensor([float(batch.correct.sum()), float(len(batch))]))
        self.latched = self.latched or bool(rate[0] > self.cfg.exgrpo_min_solve * rate[1])
        self.last["experience_on"] = float(self.latched)
        self.last["retired"] = float(len(self.retired))

    def _keep_successes(self, batch, inv, partly, k):
        """Store the new correct rows of partly solved groups (`partly` (K,), `inv` (B,) each row's
        group); every stored row of their questions takes its group's success count `k` as score."""
        # a duplicate can only be a stored row of the batch's questions
        here = self.valid & torch.isin(self.rows.prompt_idx, batch.prompt_idx)
        seen = {_completion(self.rows, s) for s in torch.nonzero(here).squeeze(1).tolist()}
        keep = []
        for i in range(len(batch)):
            row = _completion(batch, i)
            if not batch.replayed[i] and batch.correct[i] and partly[inv[i]] and row not in seen:
                keep.append(i)
                seen.add(row)  # a completion sampled twice in one batch is kept once
        self.write(batch.select(torch.tensor(keep, dtype=torch.long)))
        for g in torch.nonzero(partly).squeeze(1).tolist():
            prompt = batch.prompt_idx[inv == g][0]
            self.score[self.valid & (self.rows.prompt_idx == prompt)] = k[g]


def row_entropy(model, rows, settings, compute, device) -> torch.Tensor:
    """(B,) the policy's mean token entropy of each row (exgrpo scores stored rows by it; train.py
    hands it to the replay's start); every rank calls it together."""
    n = len(rows)
    if n == 0:  # a stand-in row runs, so every rank's passes match; its value is dropped
        rows = pack([Row([0, 0], 1, [0.0], False, 0.0)], 0, torch.zeros(1), torch.zeros(1), 0)
    _, ent = no_grad_logprobs(model, rows, settings, compute, device, with_entropy=True)
    return (ent.sum(1) / rows.completion_len.clamp(min=1))[:n]


def _completion(rows: Rollouts, i: int) -> tuple:
    """Row i's prompt and tokens, as a set key."""
    return int(rows.prompt_idx[i]), tuple(rows.tokens[i, : rows.seq_len[i]].tolist())


class GroupReplay(Replay):
    """group (zero-variance group substitution, the idea of TRL's GRPOWithReplayBufferTrainer, PR
    #4060): whole informative groups (reward spread > 0) are stored with their advantages, priority
    Σ_i |A_i| · std(r), and evicted after tau_max steps; each zero-variance fresh group of the
    update is replaced by a stored group, drawn ∝ priority without replacement (while any is left).
    Replayed rows keep their advantages and take the usual off-policy correction. A group the ring
    overwrites in part is dropped whole."""

    name = "group"
    METRICS = ("groups_replaced", "flat_groups")

    @staticmethod
    def check(cfg):
        return {"tau_max": (cfg.tau_max >= 1, "≥ 1")}

    def push(self, batch, step, entropy):
        fresh = batch.select(~batch.replayed)
        s = group_stats(fresh.reward, fresh.group)
        informative = s.std > 0  # (K,)
        priority = group_stats(fresh.advantage.abs(), fresh.group).total * s.std  # (K,)
        size = s.count.long() * informative  # (K,) rows each group would store
        fits = size.flip(0).cumsum(0).flip(0) <= len(self.valid)  # (K,) the last groups that fit
        keep = informative[s.index]
        self.evicted["capacity"] += int((keep & ~fits[s.index]).sum())
        keep &= fits[s.index]
        C = len(self.valid)
        next_slots = (self.head + torch.arange(min(int(keep.sum()), C))) % C
        overwritten = self.rows.group[next_slots][self.valid[next_slots]]
        self.evict(torch.isin(self.rows.group, overwritten), "capacity")  # never part of a group
        self.write(fresh.select(keep), priority[s.index][keep])

    def sample(self, fresh, step):
        self.evict(step - self.rows.born > self.cfg.tau_max, "age")
        s = group_stats(fresh.reward, fresh.group)
        flat = s.ids[s.std == 0]  # (F,) the zero-variance fresh groups
        stored = self.stored()
        groups, first = torch.unique(self.rows.group[stored], return_inverse=True)
        priority = torch.zeros(len(groups)).scatter_(0, first, self.score[stored])
        m = min(len(flat), len(groups))
        take = groups[:0]
        if m:
            take = groups[torch.multinomial(priority, m, replacement=False, generator=self.gen)]
        replayed = self.read(stored[torch.isin(self.rows.group[stored], take)], fresh)
        self.last["groups_replaced"] = float(m)
        self.last["flat_groups"] = float(len(flat))
        kept = fresh.select(~torch.isin(fresh.group, flat[:m]))
        return Rollouts.cat([kept, replayed], self.pad_id)


def buffers(cfg: ReplayConfig) -> bool:
    """Whether replay config `cfg`'s strategy keeps a buffer (`none` keeps none)."""
    return STRATEGIES.get(cfg.strategy, Replay) is not Replay


def make_replay(cfg: ReplayConfig, max_len: int, pad_id: int, seed: int) -> Replay:
    """The buffer for `cfg.strategy` (config.validate checked `cfg`); its sampler's seed `seed`."""
    return STRATEGIES[cfg.strategy](cfg, max_len, pad_id, seed)
