"""Prompt skipping before generation, as GRESO's released code does it (Infini-AI-Lab/GRESO:
`presampling_selector.py`, the p updates in `ray_trainer.py`). In one step `choose` picks the
prompts before generate; `update` reads their groups after the reward. A prompt whose recent groups
were all solved (mean ≥ easy) or all failed (mean ≤ hard) will likely give a flat group again,
which teaches nothing; with k the length of that run, it is skipped (nothing generated) with
probability 1 − max(p^k, floor).

Departures from the released code, each also noted where it happens:
 1. Each skipped prompt is replaced by the next in data order, so a step has exactly n prompts.
    GRESO concatenates filtered loader batches until it holds enough.
 2. A cap on candidates per step (`max_scan`); GRESO has none.
 3. One draw per candidate from our own seeded generator; GRESO draws from torch's global RNG,
    once for the easy rule and once for the hard one.
 4. GRESO holds p still through epoch 0; here p holds still until a step holds a prompt that has
    been seen before (the same steps when an epoch visits each prompt once).
 5. Reward scale: GRESO's rewards are 1 (correct) and 0.1 (wrong), so its hard threshold 0.11 means
    "all wrong" for any group under 90. With 0/1 rewards, 1 correct of 10 or more also counts as
    hard. Its flat shares count all-1 and all-0.1 groups; here flat groups at ≥ easy and ≤ hard.
Under several processes every rank must hold the same state: call `choose` on every rank with the
same data order, split its prompts by rank, and pass every rank's groups to `update`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from data.loaders import Choice
from grpo import group_stats
from support import parallel


@dataclass
class SkipConfig:
    enabled: bool = False
    """skip prompts predicted to give flat groups (GRESO); off: every prompt in data order"""
    p_init: float = 0.5
    """starting p_easy and p_hard (GRESO's 0.5)"""
    easy: float = 0.98
    """a visit is easy when its group's mean reward is ≥ this (GRESO's 0.98)"""
    hard: float = 0.11
    """a visit is hard when its group's mean reward is ≤ this (GRESO's 0.11, on its 1/0.1 scale)"""
    target: float = 0.25
    """flat-group share p steers toward: a third of it easy, two thirds hard (GRESO's 0.25)"""
    step: float = 0.01
    """how far p moves after each step (GRESO's 0.01)"""
    p_min: float = 0.05
    """lowest p: the most skipping (GRESO's 0.05)"""
    p_max: float = 0.95
    """highest p: the least skipping (GRESO's 0.95)"""
    floor: float = 0.01
    """smallest chance of keeping a prompt however long its run, so none is dropped for good"""
    max_scan: int = 10
    """skip among the first max_scan × n candidates of a step, then take them as they come"""

    def check(self) -> dict[str, tuple[bool, str]]:
        return {
            "p_init": (self.p_min <= self.p_init <= self.p_max, "in [p_min, p_max]"),
            "easy": (self.hard < self.easy, "> hard (a visit is easy, hard or neither)"),
            "target": (0 <= self.target <= 1, "in [0, 1]"),
            "step": (0 < self.step < 1, "in (0, 1)"),
            "p_min": (0 < self.p_min <= self.p_max, "in (0, p_max]"),
            "p_max": (self.p_max < 1, "< 1 (p = 1 would never skip)"),
            "floor": (0 < self.floor < 1, "in (0, 1) (> 0: a skipped prompt may come back)"),
            "max_scan": (self.max_scan >= 1, "≥ 1"),
        }


class PromptSkip:
    """Per training prompt, the part of its trace of group means that GRESO's rule reads: the
    length of its current run of easy visits and of hard visits (one of them is 0, both when the
    last visit was neither), and its number of visits. GRESO keeps (epoch, mean) for every visit;
    its probabilistic rule reads only these runs, so skipping is the same."""

    SHARED = True  # every rank holds the same state (checkpoint.restore)

    def __init__(self, cfg: SkipConfig, n_prompts: int, seed: int):
        self.cfg = cfg
        self.easy_run = torch.zeros(n_prompts, dtype=torch.long)  # (N,) latest visits at ≥ easy
        self.hard_run = torch.zeros(n_prompts, dtype=torch.long)  # (N,) latest visits at ≤ hard
        self.visits = torch.zeros(n_prompts, dtype=torch.long)  # (N,)
        self.p_easy = cfg.p_init
        self.p_hard = cfg.p_init
        self.gen = torch.Generator().manual_seed(seed)
        self.last = {"skipped": 0.0, "consumed": 0.0, "flat_easy": 0.0, "flat_hard": 0.0}

    def skip_prob(self, i: int) -> float:
        """1 − max(p^k, floor) with the run the prompt is on. A prompt never seen has no run and is
        never skipped (p^0 = 1 says so too; the check makes it plain)."""
        if self.visits[i] == 0:
            return 0.0
        if self.hard_run[i] > 0:  # counted only when the last visit was hard
            keep = self.p_hard ** int(self.hard_run[i])
        else:  # an easy run, or none (k = 0: kept)
            keep = self.p_easy ** int(self.easy_run[i])
        return 1.0 - max(keep, self.cfg.floor)

    def choose(self, order: Iterator[int], n: int) -> Choice:
        """The next n prompts of `order` (prompt indices in data order from the data position on),
        each candidate skipped with its skip_prob and replaced by the next (departure 1). Past
        max_scan × n candidates the rest are taken unskipped (departure 2), so a pool of prompts
        that are all skippable still ends. One uniform draw per candidate before the cap
        (departure 3)."""
        chosen, consumed = [], 0
        limit = self.cfg.max_scan * n
        while len(chosen) < n:
            i = next(order)
            consumed += 1
            if consumed <= limit:
                u = torch.rand((), generator=self.gen).item()
                if u < self.skip_prob(i):
                    continue
            chosen.append(i)
        self.last["skipped"] = float(consumed - n)
        self.last["consumed"] = float(consumed)
        return Choice(chosen, consumed, consumed - n)

    def observe(self, fresh) -> None:
        """`update` with every rank's fresh groups of this step (Rollouts, rewarded), before any
        stored row joins them (train.py calls it once the step's rollout is final)."""
        s = group_stats(fresh.reward, fresh.group)  # (K,) per group
        prompt = torch.zeros(len(s.ids), dtype=torch.long).scatter_(0, s.index, fresh.prompt_idx)
        seen = parallel.gather(list(zip(prompt.tolist(), s.mean.tolist(), s.flat.tolist())))
        prompts = [i for i, _, _ in seen]
        self.update(prompts, torch.tensor([m for _, m, _ in seen]),
                    torch.tensor([f for _, _, f in seen]))

    def metrics(self) -> dict[str, float]:
        """The same keys every step; p after this step's update."""
        m = {f"greso/{k}": v for k, v in self.last.items()}
        m["greso/p_easy"] = self.p_easy
        m["greso/p_hard"] = self.p_hard
        return m

    def update(self, prompts: list[int], mean: torch.Tensor, flat: torch.Tensor) -> None:
        """After the step's rewards: extend each prompt's runs with its group's mean reward, then
        move each p by `step` toward the target flat share. GRESO's direction: a flat-easy share at
        or above target/3 means skip more easy prompts, so p_easy falls (a lower p is a lower p^k,
        a higher skip probability), floored at p_min; below it p_easy rises, capped at p_max. The
        same for p_hard against 2·target/3. p holds still until a step holds a prompt seen before
        (departure 4). `mean` and `flat` (K,): one per group, as grpo.group_stats gives them
        (flat: its rewards all equal). A prompt listed twice counts as two visits, in order."""
        if len(prompts) == 0:
            return
        mean = mean.double()  # (K,) each group's mean reward
        easy = mean >= self.cfg.easy  # (K,)
        hard = mean <= self.cfg.hard  # (K,)
        seen_before = bool((self.visits[torch.as_tensor(prompts, dtype=torch.long)] > 0).any())
        for i, e, h in zip(prompts, easy.tolist(), hard.tolist()):
            self.easy_run[i] = self.easy_run[i] + 1 if e else 0
            self.hard_run[i] = self.hard_run[i] + 1 if h else 0
            self.visits[i] += 1
        share_easy = (flat & easy).double().mean().item()  # departure 5: flat and at ≥ easy
        share_hard = (flat & hard).double().mean().item()
        self.last["flat_easy"] = share_easy
        self.last["flat_hard"] = share_hard
        if seen_before:
            self.p_easy = self._nudge(self.p_easy, share_easy, self.cfg.target / 3)
            self.p_hard = self._nudge(self.p_hard, share_hard, self.cfg.target * 2 / 3)

    def _nudge(self, p: float, share: float, target: float) -> float:
        if share >= target:  # too many flat groups: skip more
            return max(p - self.cfg.step, self.cfg.p_min)
        return min(p + self.cfg.step, self.cfg.p_max)

    def state_dict(self) -> dict:
        """Tensors and plain values only (checkpoints load with weights_only=True)."""
        return {"easy_run": self.easy_run.clone(), "hard_run": self.hard_run.clone(),
                "visits": self.visits.clone(), "p_easy": self.p_easy, "p_hard": self.p_hard,
                "rng": self.gen.get_state(), "last": dict(self.last)}

    def load_state_dict(self, d: dict) -> None:
        if d["visits"].shape != self.visits.shape:
            raise ValueError(f"skip state holds {len(d['visits'])} prompts, this task "
                             f"{len(self.visits)}")
        self.easy_run = d["easy_run"].clone()
        self.hard_run = d["hard_run"].clone()
        self.visits = d["visits"].clone()
        self.p_easy = float(d["p_easy"])
        self.p_hard = float(d["p_hard"])
        self.gen.set_state(d["rng"])
        self.last = dict(d["last"])
