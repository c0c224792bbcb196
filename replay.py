"""Experience replay for GRPO: one rollout-level buffer, five strategies behind `replay.strategy`.

Storage. A ring of `capacity` rows in tensors allocated once, on CPU: token ids (int32) and behaviour log-probs
(float32) of shape (capacity, max_len), and per row its lengths, prompt index, group id, step born, reward,
advantage at birth, verified-correct flag, mean token entropy, its prompt's latest solve rate, how often it was
replayed, and a `valid` flag. There is no Python object per rollout and memory is fixed by `capacity`. A push
writes the slots after the previous write, so a full buffer overwrites its oldest rows (eviction "capacity");
evictions by age or retirement only clear `valid`, and the ring reuses those slots when it reaches them.

The trainer calls, each step: before_advantages → grpo.group_advantages → sample → update → push (fresh rows).

  none     Plain on-policy GRPO: stores nothing, adds nothing, draws no random numbers.
  uniform  FIFO of the latest `capacity` rollouts, drawn uniformly without removal (distinct rows within one
           batch); `ratio` is the replayed share of the update batch; rows older than `max_age` steps are evicted.
           (Replay-buffer study, "Efficient RL training for LLMs with experience replay".)
  aper     Rollout-level advantage-prioritized replay: rows with A = 0 are not stored, rows older than `tau_max`
           steps are evicted, and every update batch is all fresh rows plus k = round(ratio · n_fresh) rows drawn
           with replacement, P(row) ∝ |A|^alpha + priority_eps (A at birth), as in prioritized experience replay.
  rlep     RLEP: a store of verified-correct answers; before advantages, up to `rlep_n` random successes of the
           same prompt join each fresh group (same group id, onpolicy=True: the trainer recomputes their log-probs).
           Phase I is `load_rlep_solutions`. With no `rlep_source` the store fills from this run's own verified
           successes: "online RLEP", a departure from the paper, which collects them from a finished run.
  exgrpo   ExGRPO: successful rows are kept per prompt; prompts are bucketed by their latest solve rate, a bucket
           is drawn with weight exp(-(rate - mu)² / 2σ²) and a prompt uniformly within it, and each drawn prompt
           replays its lowest-entropy success (one row per drawn prompt, so the stored prompts cap the draw).
           Prompts solved by every rollout are retired for good. Experience is mixed in (share `ratio`) only
           once the fresh batch solve rate reaches `exgrpo_min_solve`.

Advantages of rows returned by `sample` (`replay.advantage`):
  stored     (default) the advantage computed in the row's own group at birth. It is what the buffer study and
             aper replay (aper's priority is defined by it), it does not depend on which prompts happen to be in
             this batch, and with short staleness bounds the baseline has barely moved.
  recompute  re-centre the stored reward against the prompt's current rewards, as if the row joined that group:
             the fresh group of the same prompt plus the row when that prompt is in this batch, else the prompt's
             rows still in the buffer. A = (r - mean) / (std + 1e-6), std unbiased: grpo's `group` scale. Falls
             back to stored when buffer statistics have < 2 rewards or no spread (exgrpo keeps only successes).
RLEP rows get their advantages from grpo inside the mixed group, so the key does not apply to them.
All randomness comes from one torch.Generator owned by the buffer; state_dict saves it with the storage.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from data.loaders import read_jsonl
from rollout import Rollouts, pack


@dataclass
class ReplayConfig:
    strategy: str = "none"
    """none | uniform | aper | rlep | exgrpo"""
    capacity: int = 4096
    """rows the buffer holds; memory is capacity × max_len × 8 bytes"""
    ratio: float = 0.5
    """uniform, exgrpo: replayed share of the update batch (0 ≤ ratio < 1); aper: k = round(ratio × n_fresh) (0 ≤ ratio ≤ 4)"""
    max_age: int = 0
    """uniform: evict rows older than this many steps before sampling; 0 = no limit (the study does not state one)"""
    tau_max: int = 4
    """aper: evict rows older than this many steps (≥ 1); the paper does not state its value"""
    alpha: float = 1.0
    """aper: priority exponent in |A|^alpha + priority_eps (0 = uniform); the paper does not state its value"""
    priority_eps: float = 1e-3
    """aper: priority floor, so every stored row stays drawable"""
    advantage: str = "stored"
    """advantage of sampled rows: stored (at birth) | recompute (against the prompt's current rewards)"""
    rlep_n: int = 2
    """rlep: stored successes appended to each fresh group (the paper uses 2)"""
    rlep_source: str = ""
    """rlep: JSONL of phase-I solutions, read by the trainer; empty = online RLEP (store this run's own successes)"""
    exgrpo_mu: float = 0.5
    """exgrpo: solve rate at which the bucket weight peaks"""
    exgrpo_sigma: float = 0.2
    """exgrpo: width of the Gaussian bucket weight"""
    exgrpo_min_solve: float = 0.35
    """exgrpo: mix in experience only once the fresh batch solve rate reaches this"""

    def check(self) -> list[tuple[bool, str]]:
        """Checks every strategy shares, then the chosen strategy's own (its class's `check`)."""
        known = self.strategy in STRATEGIES
        return [(known, f"replay.strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}"),
                (self.capacity >= 1, f"replay.capacity must be ≥ 1, got {self.capacity}"),
                (not self.rlep_source or self.strategy == "rlep", f"replay.rlep_source is read by rlep only, "
                                                                   f"not {self.strategy}"),
                (self.advantage in ("stored", "recompute"), f"replay.advantage must be stored or recompute, "
                                                            f"got {self.advantage!r}"),
                *(STRATEGIES[self.strategy].check(self) if known else [])]


# Per-row fields kept exactly as Rollouts holds them; the 2-D tokens and behav_logp are stored separately.
L64, F32, BOOL = torch.int64, torch.float32, torch.bool
ROW_FIELDS = {"prompt_len": L64, "seq_len": L64, "truncated": BOOL, "prompt_idx": L64, "group": L64, "born": L64,
              "reward": F32, "correct": BOOL, "advantage": F32, "entropy": F32}  # fmt: skip
STATE = ("tokens", "behav_logp", *ROW_FIELDS, "solve_rate", "times_sampled", "valid", "retired")
ZERO_ADV = 1e-6  # aper: |A| at or below this counts as zero
DIAGNOSTICS = ("sampled", "replayed_share", "age_mean", "age_max", "reuse_mean", "reuse_max", "priority_min", "priority_max")


class Replay:
    """Tensor storage shared by all strategies. The base stores nothing and adds nothing; subclasses decide."""

    @staticmethod
    def check(cfg: ReplayConfig) -> list[tuple[bool, str]]:
        """(condition, message) for this strategy's own keys; evaluating it must never raise."""
        return []

    def __init__(self, cfg: ReplayConfig, max_len: int, pad_id: int, seed: int):
        self.cfg, self.max_len, self.pad_id = cfg, max_len, pad_id
        C = cfg.capacity
        self.tokens = torch.full((C, max_len), pad_id, dtype=torch.int32)
        self.behav_logp = torch.zeros(C, max_len)
        for name, dtype in ROW_FIELDS.items():
            setattr(self, name, torch.zeros(C, dtype=dtype))
        self.solve_rate = torch.zeros(C)  # exgrpo: fraction of the prompt's latest fresh group that was correct
        self.times_sampled = torch.zeros(C, dtype=L64)  # draws since stored (rlep: appends)
        self.valid = torch.zeros(C, dtype=BOOL)  # the slot holds a row
        self.retired = torch.zeros(0, dtype=L64)  # exgrpo: prompts every rollout solved; never stored again
        self.head = 0  # next slot to write
        self.gen = torch.Generator().manual_seed(seed)
        self.evicted = {"capacity": 0, "age": 0, "retired": 0}  # totals since the start of the run
        self.last = dict.fromkeys(DIAGNOSTICS, 0.0)  # about the rows added at the latest step

    def __len__(self) -> int:
        return int(self.valid.sum())

    # ---- the interface train.py uses; strategies override what they need

    def before_advantages(self, fresh: Rollouts, step: int) -> Rollouts:
        return fresh

    def sample(self, fresh: Rollouts, step: int) -> Rollouts | None:
        return None

    def push(self, batch: Rollouts, step: int) -> None:
        pass

    def start(self, problems: list, prompts: list[list[int]], tokenizer, cfg) -> int:
        """Called once before training with the training problems, their prompt ids, the tokenizer and the whole
        config; a strategy with an external source loads it here. Returns the tokens generated to make that source
        (counted in tokens/generated_total), 0 when there is none."""
        return 0

    def metrics(self) -> dict[str, float]:
        m = {"replay/size": float(len(self)), **{f"replay/evicted_{k}": float(v) for k, v in self.evicted.items()}}
        return m | {f"replay/{k}": float(v) for k, v in self.last.items()}

    def state_dict(self) -> dict:
        d = {name: getattr(self, name).clone() for name in STATE}
        return d | {"head": self.head, "rng": self.gen.get_state(), "evicted": dict(self.evicted), "last": dict(self.last)}

    def load_state_dict(self, d: dict) -> None:
        if d["tokens"].shape != self.tokens.shape:
            raise ValueError(f"replay state holds {tuple(d['tokens'].shape)} rows × tokens, this buffer {tuple(self.tokens.shape)}")
        for name in STATE:
            setattr(self, name, d[name].clone())
        self.head, self.evicted, self.last = d["head"], dict(d["evicted"]), dict(d["last"])
        self.gen.set_state(d["rng"])

    # ---- storage helpers

    def _write(self, rows: Rollouts) -> torch.Tensor:
        """Store rows at the ring head, overwriting the oldest slots once full. Returns the slots written."""
        if len(rows) and int(rows.seq_len.max()) > self.max_len:
            raise ValueError(f"replay: a rollout of {int(rows.seq_len.max())} tokens exceeds max_len={self.max_len}")
        C = self.cfg.capacity
        if len(rows) > C:  # only the newest C rows fit
            self.evicted["capacity"] += len(rows) - C
            rows = rows.select(torch.arange(len(rows) - C, len(rows)))
        slots = (self.head + torch.arange(len(rows))) % C
        self.evicted["capacity"] += int(self.valid[slots].sum())
        L = min(rows.tokens.shape[1], self.max_len)  # columns past max_len can only be padding
        self.tokens[slots] = self.pad_id
        self.tokens[slots, :L] = rows.tokens[:, :L].to(torch.int32)
        self.behav_logp[slots] = 0.0
        self.behav_logp[slots, :L] = rows.behav_logp[:, :L]
        for name in ROW_FIELDS:
            getattr(self, name)[slots] = getattr(rows, name)
        self.times_sampled[slots] = 0
        self.valid[slots] = True
        self.head = (self.head + len(rows)) % C
        return slots

    def _read(self, slots: torch.Tensor, onpolicy: bool) -> Rollouts:
        """Copies of the rows at `slots`, trimmed to their longest sequence, marked replayed."""
        L = int(self.seq_len[slots].max())
        n = len(slots)
        return Rollouts(
            tokens=self.tokens[slots, :L].long(), behav_logp=self.behav_logp[slots, :L],
            **{name: getattr(self, name)[slots] for name in ROW_FIELDS},
            replayed=torch.ones(n, dtype=torch.bool), onpolicy=torch.full((n,), onpolicy),
        )  # fmt: skip

    def _evict(self, mask: torch.Tensor, reason: str) -> None:
        self.evicted[reason] += int((mask & self.valid).sum())
        self.valid &= ~mask

    def _stored(self) -> torch.Tensor:  # (N,) slots holding a row
        return self.valid.nonzero().squeeze(1)

    def _replayed(self, slots: torch.Tensor, fresh: Rollouts, step: int) -> Rollouts | None:
        """Read drawn rows for the update batch, with their advantage per `replay.advantage`."""
        self._record(slots, len(slots) + len(fresh), step)
        if len(slots) == 0:
            return None
        rows = self._read(slots, onpolicy=False)
        if self.cfg.advantage == "recompute":
            rows.advantage = self._recomputed(slots, fresh)
        # Keep rows of one original group together, but past the fresh ids: no replayed row joins a fresh group.
        g = rows.group - rows.group.min()
        _, inv = torch.unique(rows.born * (int(g.max()) + 1) + g, return_inverse=True)  # one id per (born, group)
        rows.group = inv + (int(fresh.group.max()) + 1 if len(fresh) else 0)
        return rows

    def _record(self, slots: torch.Tensor, batch_rows: int, step: int) -> None:
        """Count the reuse of the rows added at this step and note their diagnostics."""
        self.last = dict.fromkeys(DIAGNOSTICS, 0.0)
        if len(slots) == 0:
            return
        self.times_sampled.index_add_(0, slots, torch.ones_like(slots))  # index_add_: a slot may be drawn twice
        age = (step - self.born[slots]).float()
        self.last.update(sampled=len(slots), replayed_share=len(slots) / batch_rows, age_mean=age.mean().item(),
                         age_max=age.max().item(), reuse_mean=self.times_sampled[slots].float().mean().item(),
                         reuse_max=float(self.times_sampled.max()))  # fmt: skip

    def _recomputed(self, slots: torch.Tensor, fresh: Rollouts) -> torch.Tensor:
        """Advantage of each drawn row against its prompt's current rewards (see the module docstring)."""
        p, r = self.prompt_idx[slots], self.reward[slots].double()
        keys, inv = torch.unique(p, return_inverse=True)

        def sums(prompts, rewards):  # (3, k): count, sum and sum of squares of the rewards of each drawn row's prompt
            hit = torch.isin(prompts, keys)
            j, x = torch.searchsorted(keys, prompts[hit]), rewards[hit].double()
            out = torch.zeros(3, len(keys), dtype=torch.float64)
            for i, v in enumerate((torch.ones_like(x), x, x * x)):
                out[i].index_add_(0, j, v)
            return out[:, inv]

        in_batch = sums(fresh.prompt_idx, fresh.reward) + torch.stack([torch.ones_like(r), r, r * r])  # the row joins
        use_fresh = in_batch[0] > 1
        n, s, ss = torch.where(use_fresh, in_batch, sums(self.prompt_idx[self.valid], self.reward[self.valid]))
        mean = s / n
        var = (ss - n * mean**2) / (n - 1).clamp(min=1)
        var = torch.where(var > 1e-12, var, 0.0)  # below this it is round-off of equal rewards
        adv = torch.where(var > 0, (r - mean) / (var.sqrt() + 1e-6), 0.0)  # a flat group gets 0, as in grpo
        trusted = use_fresh | ((n >= 2) & (var > 0))
        return torch.where(trusted, adv, self.advantage[slots].double()).float()

    def _first_per_prompt(self, slots: torch.Tensor, key: torch.Tensor, n: int) -> torch.Tensor:
        """Of `slots`, the n with the smallest `key` within each prompt."""
        slots = slots[torch.argsort(key, stable=True)]
        slots = slots[torch.argsort(self.prompt_idx[slots], stable=True)]
        _, counts = torch.unique_consecutive(self.prompt_idx[slots], return_counts=True)
        rank = torch.arange(len(slots)) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
        return slots[rank < n]


class NoReplay(Replay):
    """Plain on-policy GRPO: the base class's no-ops, with no storage allocated."""

    def __init__(self, cfg: ReplayConfig, max_len: int, pad_id: int, seed: int):
        super().__init__(replace(cfg, capacity=0), max_len, pad_id, seed)


class UniformReplay(Replay):
    """FIFO of the latest rollouts, drawn uniformly without removal; `ratio` is the replayed share of the batch."""

    @staticmethod
    def check(cfg: ReplayConfig) -> list[tuple[bool, str]]:
        return [(0 <= cfg.ratio < 1, f"replay.ratio must be in [0, 1) for uniform (the replayed share of the batch), "
                                     f"got {cfg.ratio}"),
                (cfg.max_age >= 0, f"replay.max_age must be ≥ 0 (0 = no limit), got {cfg.max_age}")]

    def push(self, batch: Rollouts, step: int) -> None:
        self._write(batch.select(~batch.replayed))

    def sample(self, fresh: Rollouts, step: int) -> Rollouts | None:
        if self.cfg.max_age > 0:
            self._evict(step - self.born > self.cfg.max_age, "age")
        k = min(round(self.cfg.ratio / (1 - self.cfg.ratio) * len(fresh)), len(self))
        key = torch.where(self.valid, torch.rand(len(self.valid), generator=self.gen), -1.0)  # (C,) in [0, 1) if stored
        return self._replayed(key.topk(k).indices, fresh, step)  # the k largest random keys: a uniform k-subset


class AperReplay(Replay):
    """Rollout-level, advantage-prioritized, age-bounded; every fresh row stays in the batch and k are added."""

    @staticmethod
    def check(cfg: ReplayConfig) -> list[tuple[bool, str]]:
        return [(0 <= cfg.ratio <= 4, f"replay.ratio must be in [0, 4] for aper (replayed rows per fresh row), "
                                      f"got {cfg.ratio}"),
                (cfg.tau_max >= 1, f"replay.tau_max must be ≥ 1, got {cfg.tau_max}"),
                (0 <= cfg.alpha < 100 and 0 < cfg.priority_eps < 1e6, "replay.alpha must be ≥ 0 and "
                                                                      "replay.priority_eps > 0")]

    def push(self, batch: Rollouts, step: int) -> None:
        self._write(batch.select(~batch.replayed & (batch.advantage.abs() > ZERO_ADV)))  # A = 0 carries no gradient

    def sample(self, fresh: Rollouts, step: int) -> Rollouts | None:
        self._evict(step - self.born > self.cfg.tau_max, "age")
        k = min(round(self.cfg.ratio * len(fresh)), len(self))  # never more draws than stored rows
        if k == 0:
            return self._replayed(torch.zeros(0, dtype=torch.long), fresh, step)
        priority = self.advantage.abs().pow(self.cfg.alpha) + self.cfg.priority_eps  # (C,)
        # With replacement, a row's expected count in the batch is exactly k · P(row); a high-|A| row may appear twice.
        weight = torch.where(self.valid, priority, 0.0)
        rows = self._replayed(torch.multinomial(weight, k, replacement=True, generator=self.gen), fresh, step)
        lowest = torch.where(self.valid, priority, torch.inf).min()
        self.last.update(priority_min=lowest.item(), priority_max=weight.max().item())
        return rows


class RlepReplay(Replay):
    """Verified successes per prompt, appended to each fresh group of the same prompt before advantages."""

    @staticmethod
    def check(cfg: ReplayConfig) -> list[tuple[bool, str]]:
        return [(cfg.rlep_n >= 1, f"replay.rlep_n must be ≥ 1, got {cfg.rlep_n}")]

    def start(self, problems: list, prompts: list[list[int]], tokenizer, cfg) -> int:
        """Phase I from `rlep_source`: a JSONL of verified solutions, one per line, {"problem": text (or "prompt_idx":
        i), "completion_ids": [...], "behav_logp": [...]} as `eval.py --save-correct` writes them; the sampled token
        ids are replayed exactly. A text-only row ({"completion": text}) is tokenized, the end token appended. The
        tokens phase I generated come from `<rlep_source>.meta.json` when it exists."""
        if not self.cfg.rlep_source:
            return 0
        path, by_problem, rows = self.cfg.rlep_source, {p.problem: i for i, p in enumerate(problems)}, []
        for n, r in enumerate(read_jsonl(path), 1):
            i, ids = r.get("prompt_idx", by_problem.get(r.get("problem"))), r.get("completion_ids")
            if ids is None and isinstance(r.get("completion"), str):
                ids = tokenizer(r["completion"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            if not isinstance(i, int) or not 0 <= i < len(prompts) or not isinstance(ids, list) or not ids:
                raise ValueError(f"{path}: row {n} needs a known problem (or prompt_idx) and a completion")
            ids = ids[: cfg.rollout.max_new_tokens]
            lp = r.get("behav_logp") if len(r.get("behav_logp") or []) >= len(ids) else [0.0] * len(ids)
            rows.append((prompts[i] + ids, len(prompts[i]), lp[: len(ids)], False, 0.0, i))
        if not rows:
            raise ValueError(f"replay.rlep_source {path} holds no solutions")
        ro = pack([r[:5] for r in rows], self.pad_id, torch.tensor([r[5] for r in rows]), torch.full((len(rows),), -1), 0)
        ro.reward, ro.correct = torch.full((len(rows),), cfg.reward.correct), torch.ones(len(rows), dtype=torch.bool)
        self.load_rlep_solutions(ro)
        meta = Path(path + ".meta.json")
        return int(json.loads(meta.read_text()).get("generated_tokens", 0)) if meta.is_file() else 0

    def load_rlep_solutions(self, rollouts: Rollouts) -> None:
        """Phase I: seed the store with verified-correct rows (the trainer tokenizes `rlep_source` into Rollouts with
        correct=True and the reward of a correct answer). With `rlep_source` set the store stays fixed afterwards."""
        if not bool(rollouts.correct.all()):
            raise ValueError("rlep: phase-I solutions must all be verified correct (correct=True)")
        self._write(rollouts)

    def push(self, batch: Rollouts, step: int) -> None:
        if not self.cfg.rlep_source:  # online RLEP: the store grows from this run's own verified successes
            self._write(batch.select(~batch.replayed & batch.correct))

    def before_advantages(self, fresh: Rollouts, step: int) -> Rollouts:
        gid, inv = torch.unique(fresh.group, return_inverse=True)
        gprompt = torch.zeros_like(gid).scatter_(0, inv, fresh.prompt_idx)  # (n_groups,) prompt of each group
        stored = self._stored()
        stored = stored[torch.isin(self.prompt_idx[stored], gprompt)]
        slots = self._first_per_prompt(stored, torch.rand(len(stored), generator=self.gen), self.cfg.rlep_n)
        self._record(slots, len(fresh) + len(slots), step)
        if len(slots) == 0:
            return fresh
        rows = self._read(slots, onpolicy=True)  # RLEP treats replayed answers as on-policy
        by_prompt = torch.argsort(gprompt, stable=True)  # a prompt in two groups feeds the first of them
        rows.group = gid[by_prompt[torch.searchsorted(gprompt[by_prompt], rows.prompt_idx)]]
        mixed = Rollouts.cat([fresh, rows], self.pad_id)
        return mixed.select(torch.argsort(mixed.group, stable=True))  # each group's rows adjacent, fresh first


class ExgrpoReplay(Replay):
    """Per-prompt successes, prompts drawn by a Gaussian weight on solve-rate buckets, lowest-entropy success replayed."""

    @staticmethod
    def check(cfg: ReplayConfig) -> list[tuple[bool, str]]:
        return [(0 <= cfg.ratio < 1, f"replay.ratio must be in [0, 1) for exgrpo, got {cfg.ratio}"),
                (0 < cfg.exgrpo_sigma < 1e6, f"replay.exgrpo_sigma must be > 0, got {cfg.exgrpo_sigma}")]

    def push(self, batch: Rollouts, step: int) -> None:
        fresh = batch.select(~batch.replayed)
        prompts, inv = torch.unique(fresh.prompt_idx, return_inverse=True)
        rate = torch.zeros(len(prompts)).index_add_(0, inv, fresh.correct.float()) / torch.bincount(inv)
        solved = prompts[rate == 1]
        self.retired = torch.unique(torch.cat([self.retired, solved]))
        self._evict(torch.isin(self.prompt_idx, solved), "retired")
        self._write(fresh.select(fresh.correct & ~torch.isin(fresh.prompt_idx, self.retired)))
        hit = self.valid & torch.isin(self.prompt_idx, prompts)  # every stored row of these prompts gets the new rate
        self.solve_rate[hit] = rate[torch.searchsorted(prompts, self.prompt_idx[hit])]

    def sample(self, fresh: Rollouts, step: int) -> Rollouts | None:
        stored = self._stored()
        if len(fresh) == 0 or float(fresh.correct.float().mean()) < self.cfg.exgrpo_min_solve:
            return self._replayed(stored[:0], fresh, step)
        prompts, inv = torch.unique(self.prompt_idx[stored], return_inverse=True)
        rate = torch.zeros(len(prompts)).scatter_(0, inv, self.solve_rate[stored])  # one rate per prompt
        buckets, b_inv, b_count = torch.unique(rate, return_inverse=True, return_counts=True)
        weight = torch.exp(-0.5 * ((buckets - self.cfg.exgrpo_mu) / self.cfg.exgrpo_sigma) ** 2) / b_count
        weight = weight[b_inv]  # (n_prompts,) P(bucket) · P(prompt | bucket) for a single draw
        k = min(round(self.cfg.ratio / (1 - self.cfg.ratio) * len(fresh)), int((weight > 0).sum()))
        chosen = prompts[torch.multinomial(weight, k, replacement=False, generator=self.gen)] if k else prompts[:0]
        candidates = stored[torch.isin(self.prompt_idx[stored], chosen)]
        return self._replayed(self._first_per_prompt(candidates, self.entropy[candidates], 1), fresh, step)


STRATEGIES = {"none": NoReplay, "uniform": UniformReplay, "aper": AperReplay, "rlep": RlepReplay, "exgrpo": ExgrpoReplay}


def make_replay(cfg: ReplayConfig, max_len: int, pad_id: int, seed: int) -> Replay:
    """The buffer for `cfg.strategy` (checked by `cfg.check()`), its sampling generator seeded from `seed`."""
    problems = [msg for ok, msg in cfg.check() if not ok]
    if problems:
        raise ValueError(problems[0])
    return STRATEGIES[cfg.strategy](cfg, max_len, pad_id, seed)
