"""Staged rollouts: generate a few samples per prompt first, and the rest only where they can
teach. The idea is AR3PO's (2025); it publishes no code, stage sizes or cap, so the rule here is
ours. `Stages.complete` wraps a step's generate-and-reward (train.py composes it at set-up when
stages.first > 0): it asks `next_counts` how many more samples each prompt gets, generates them,
verifies them, and asks again until every count is 0.

With G the group size and g1 = `first`:
  stage 1  every prompt gets g1 samples;
  stop     a prompt whose g1 samples are all correct stops there: its group is flat, so it has no
           advantage, and the G − g1 it did not get would most likely have been correct too;
  stage 2  every other prompt is filled up to G: a group that can teach has plain GRPO's size.
After the last stage, `unsolved` names the prompts with no success at all; such a prompt may take
one stored success of its own (AR3PO's buffer), so its group gets a spread. The caller wires that.

Departures from AR3PO as its paper describes it, each a choice of ours:
 1. AR3PO stops a prompt once it has one correct response and gives the hard ones more stages.
    Here only an all-correct prompt stops; a mixed one is filled to G as well, so its baseline is
    the mean of G rewards, not of g1, and the saving is the all-correct prompts' G − g1 samples.
 2. Two stages, capped at G (AR3PO: several, up to a cap it does not state).
 3. A stopped prompt keeps its g1 samples as a flat group (zero advantage, as in plain GRPO).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batch import Rollouts
from support.parallel import MAX, all_ranks


@dataclass
class StageConfig:
    first: int = 0
    """samples per prompt in stage 1 (g1 < rollout.group_size); a prompt whose g1 are all correct
    stops, the others are filled to group_size. 0 = off: one stage of group_size. AR3PO: unstated"""

    def check(self) -> dict[str, tuple[bool, str]]:
        return {"first": (self.first >= 0, "≥ 0 (0 = off) and < rollout.group_size")}


def stops(correct: list[bool]) -> bool:
    """The stop rule: a prompt that has samples, all verified correct. Its group is flat at the
    top, and more samples from the same policy would most likely be correct too."""
    return len(correct) > 0 and all(correct)


def next_counts(correct: list[list[bool]], G, g1: int) -> list[int]:
    """How many more samples each prompt gets in the next stage (0 = done). `correct[j]`: whether
    each of prompt j's samples so far was verified correct (empty before stage 1); `G` the group
    size, or each prompt's own target (a replay plan may ask fewer). A prompt with no sample gets
    g1 (its target when g1 = 0); one that `stops` gets 0; any other is filled up to its target."""
    targets = G
    if isinstance(G, int):
        targets = [G] * len(correct)
    if not 0 <= g1 < max(targets, default=g1 + 1):
        raise ValueError(f"stage 1 takes 0 (off) to G − 1 = {max(targets) - 1} samples, not {g1}")
    counts = []
    for c, target in zip(correct, targets, strict=True):
        if len(c) == 0:
            counts.append(min(g1, target) if g1 > 0 else target)
        elif stops(c):
            counts.append(0)
        else:
            counts.append(max(target - len(c), 0))
    return counts


def unsolved(correct: list[list[bool]]) -> list[bool]:
    """After the last stage: the prompts with no correct sample. Their group is flat at the bottom;
    a stored success of their own would give it a spread (AR3PO), which the caller wires."""
    out = []
    for c in correct:
        out.append(not any(c))
    return out


def outcomes(correct: torch.Tensor, group: torch.Tensor, groups: list[int]) -> list[list[bool]]:
    """`next_counts`'s input from generated rows: each listed group's `correct`, in row order.
    correct (B,) bool and group (B,) int64 are Rollouts' fields, over every stage's rows so far."""
    out = []
    for g in groups:
        out.append(correct[group == g].tolist())
    return out


def metrics(correct: list[list[bool]], G: int) -> dict[str, float]:
    """After the last stage: share of prompts stopped early, share with no success, and samples
    generated against plain GRPO's n × G."""
    n = max(len(correct), 1)
    stopped, samples = 0, 0
    for c in correct:
        if len(c) < G:
            stopped += 1
        samples += len(c)
    return {"stages/stopped": stopped / n,
            "stages/unsolved": sum(unsolved(correct)) / n,
            "stages/sample_share": samples / (n * G)}


class Stages:
    """Staged sampling of one step's prompts (`complete`) and, per prompt, the latest verified
    success this rank generated (`stored`), which an unsolved prompt takes after
    the last stage. That row keeps its behaviour log-probs and is marked replayed and off-policy,
    so the loss corrects it as any replayed row (grpo.py, departure 1)."""

    def __init__(self, cfg: StageConfig, pad_id: int):
        self.cfg = cfg
        self.pad_id = pad_id
        self.stored = {}  # prompt index -> its latest verified-correct fresh row (a 1-row Rollouts)

    def complete(self, generate, counts: list[int], key: tuple) -> tuple[Rollouts, dict]:
        """The step's rows in stages: `generate(todo, key)` (train.py: generate and reward
        todo[i] completions of each prompt, an engine's seeds from key) for g1 samples per prompt,
        then for what `next_counts` asks until no rank has any left; then a stored success for
        each unsolved prompt. Returns the rows and the rollout's metrics (the verifier's over the
        stages, and stages/*). The stages run on every rank together (generation may be
        collective)."""
        parts, stage_metrics = [], []
        todo = self._unless_done(next_counts([[]] * len(counts), counts, self.cfg.first))
        while todo is not None:
            fresh, verifier = generate(todo, (*key, len(parts)))
            parts.append(fresh)
            stage_metrics.append((verifier, len(fresh)))
            done = Rollouts.cat(parts, self.pad_id)
            seen = outcomes(done.correct, done.group, _first_group(done, len(counts)))
            todo = self._unless_done(next_counts(seen, counts, self.cfg.first))
        fresh = Rollouts.cat(parts, self.pad_id)
        seen = outcomes(fresh.correct, fresh.group, _first_group(fresh, len(counts)))
        last = metrics(seen, max(counts, default=1))
        taken = self.take(fresh)
        last["stages/stored_taken"] = float(len(taken))
        return Rollouts.cat([fresh, taken], self.pad_id), _merge(stage_metrics) | last

    @staticmethod
    def _unless_done(todo: list[int]) -> list[int] | None:
        if all_ranks(float(sum(todo)), MAX) > 0:
            return todo
        return None

    def take(self, fresh: Rollouts) -> Rollouts:
        """A stored success for each group of `fresh` with no correct row, when its prompt has
        one: replayed, off-policy, in that group."""
        rows = []
        for g in fresh.group.unique().tolist():
            mine = fresh.group == g
            prompt = int(fresh.prompt_idx[mine][0])
            if not fresh.correct[mine].any() and prompt in self.stored:
                row = self.stored[prompt].select(torch.tensor([0]))
                row.group = torch.tensor([g])
                rows.append(row)
        if not rows:
            return Rollouts.empty(0, 1, self.pad_id)
        out = Rollouts.cat(rows, self.pad_id)
        out.replayed = torch.ones(len(out), dtype=torch.bool)
        out.onpolicy = torch.zeros(len(out), dtype=torch.bool)
        return out

    def observe(self, fresh: Rollouts) -> None:
        """Keep each prompt's latest verified success among this step's generated rows (the last
        one wins); train.py calls it once the step's rollout is final (a stop during it leaves
        the store as it was)."""
        for i in torch.nonzero(fresh.correct & ~fresh.replayed).squeeze(1).tolist():
            self.stored[int(fresh.prompt_idx[i])] = fresh.select(torch.tensor([i]))

    def metrics(self) -> dict[str, float]:
        """None after the update: staged rollouts' metrics (stages/*) come with each rollout."""
        return {}

    def state_dict(self) -> dict:
        """The stored rows as one Rollouts' fields (tensors: checkpoints load weights_only)."""
        prompts = sorted(self.stored)
        rows = Rollouts.empty(0, 1, self.pad_id)
        if prompts:
            rows = Rollouts.cat([self.stored[p] for p in prompts], self.pad_id)
        return {"prompts": torch.tensor(prompts, dtype=torch.long), "rows": vars(rows).copy()}

    def load_state_dict(self, d: dict) -> None:
        rows = Rollouts(**d["rows"])
        self.stored = {}
        for j, p in enumerate(d["prompts"].tolist()):
            self.stored[p] = rows.select(torch.tensor([j]))


def _first_group(rows: Rollouts, n: int) -> list[int]:
    """The group ids of the n prompts, in prompt order (ids are consecutive from the first)."""
    first = int(rows.group.min()) if len(rows) else 0
    return list(range(first, first + n))


def _merge(stage_metrics: list[tuple[dict, int]]) -> dict:
    """The verifier's metrics of several calls: shares weighted by rows, counts and seconds
    added."""
    rows = max(1, sum(n for _, n in stage_metrics))
    out = {}
    for metrics, n in stage_metrics:
        for k, v in metrics.items():
            share = k.endswith("_frac")
            out[k] = out.get(k, 0.0) + v * n / rows if share else out.get(k, 0.0) + v
    return out
