"""DAPO's dynamic sampling (rollout.dynamic_sampling = N > 0; verl's `filter_groups`): a step
generates up to N rounds of prompts until every rank holds its share of groups with a reward spread
(`Dynamic` wraps train.py's rollout round; train.py composes it at set-up). It pays for signal with
generation, which the comparison counts.

Departure from DAPO: a step whose N rounds found too few such groups is filled up with flat ones
(`dynamic/capped`), so every step trains on the same number of groups; DAPO keeps sampling.
"""

from __future__ import annotations

import torch

from grpo import group_stats
from batch import Rollouts
from support.parallel import MIN, all_ranks


def flat_groups(rewards: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """(N,) rows whose group's rewards are all equal: nothing to learn from (a single row too)."""
    s = group_stats(rewards, group)
    return s.flat[s.index]


def split(fresh: Rollouts) -> tuple[Rollouts, Rollouts]:
    """A round's rows: the groups with a reward spread, then the flat ones."""
    flat = flat_groups(fresh.reward, fresh.group)
    return fresh.select(~flat), fresh.select(flat)


def groups(rows: list[Rollouts]) -> int:
    """The groups among `rows` (each Rollouts' distinct group ids)."""
    return sum(len(set(part.group.tolist())) for part in rows)


def keep(kept: list[Rollouts], spare: list[Rollouts], wanted: int, rounds: int,
         pad_id: int) -> tuple[Rollouts, dict]:
    """The first `wanted` groups, informative ones first, and the rounds' metrics."""
    fresh = Rollouts.cat(kept + spare, pad_id)
    use = torch.tensor(list(dict.fromkeys(fresh.group.tolist()))[:wanted])
    used = torch.isin(fresh.group, use)  # (B,) rows of the groups kept
    capped = bool(flat_groups(fresh.reward, fresh.group)[used].any())
    metrics = {"dynamic/rounds": float(rounds), "dynamic/capped": float(capped),
               "dynamic/groups_dropped": float(fresh.group.unique().numel() - len(use))}
    return fresh.select(used), metrics


class Dynamic:
    """The rollout phase under dynamic sampling: `one_round(step, t, round, rounds)` (train.py's:
    the next prompts, generated and rewarded; returns the rows, their metrics, the tokens generated
    on every rank and this rank's prompts) up to `rounds` times, until every rank holds its share
    of groups with a spread; then the first groups, informative ones first (the same four)."""

    def __init__(self, one_round, rounds: int, pad_id: int):
        self.one_round, self.rounds, self.pad_id = one_round, rounds, pad_id

    def __call__(self, step: int, t: dict) -> tuple[Rollouts, dict, int, int]:
        kept, spare, generated = [], [], 0
        for rnd in range(self.rounds):
            fresh, metrics, tokens, mine = self.one_round(step, t, rnd, self.rounds)
            generated += tokens
            informative, flat = split(fresh)
            kept.append(informative)
            spare.append(flat)
            if all_ranks(float(groups(kept) >= mine), MIN):
                break
        fresh, rounds_metrics = keep(kept, spare, mine, rnd + 1, self.pad_id)
        return fresh, metrics | rounds_metrics, generated, mine
