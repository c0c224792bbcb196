"""The batch every stage of a step passes on: `Rollouts`, B sequences with the behaviour log-prob
each completion token was sampled with and where each row came from, and `pack`, which makes one
from what an engine sampled (`Row`s). rollout.py fills it, rewards.py and grpo.py score and train
on it, replay.py stores it as it is; support/vllm.py's engine returns it too.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import NamedTuple

import torch


FLOAT_FIELDS = ("reward", "advantage", "entropy")  # of the per-row fields
BOOL_FIELDS = ("truncated", "correct", "replayed", "onpolicy")  # (the others are int64)


@dataclass
class Rollouts:
    """B sequences, each `prompt | completion | pad`, right-padded to length L. `behav_logp[b, t]`
    is log μ(tokens[b, t] | tokens[b, :t]), 0 outside the completion; the per-row fields say where
    it came from and how it scored."""

    tokens: torch.Tensor  # (B, L) int64, pad id after seq_len
    prompt_len: torch.Tensor  # (B,) int64, number of prompt tokens (the completion starts there)
    seq_len: torch.Tensor  # (B,) int64, prompt + completion tokens (the end token included)
    behav_logp: torch.Tensor  # (B, L) float32, behaviour-policy log-prob of each completion token
    truncated: torch.Tensor  # (B,) bool, hit max_new_tokens before any end token
    prompt_idx: torch.Tensor  # (B,) int64, index of the prompt in the training set
    group: torch.Tensor  # (B,) int64, rows with the same id share a prompt: one GRPO group
    born: torch.Tensor  # (B,) int64, training step at which the row was generated
    reward: torch.Tensor  # (B,) float32, scalar reward (rewards.py, plus overlong shaping when on)
    correct: torch.Tensor  # (B,) bool, verified-correct final answer
    advantage: torch.Tensor  # (B,) float32, group-relative advantage (grpo.group_advantages)
    entropy: torch.Tensor  # (B,) float32, mean token entropy of the distribution sampled from
    replayed: torch.Tensor  # (B,) bool, came from the replay buffer, not this step's generation
    onpolicy: torch.Tensor  # (B,) bool, behaviour log-probs are the current policy's (fresh, RLEP)
    slot: torch.Tensor  # (B,) int64, the replay buffer row a replayed row came from; -1 if fresh

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @staticmethod
    def empty(B: int, L: int, pad_id: int) -> Rollouts:
        """B blank rows of length L: pad tokens, zeros, False, slot -1."""
        rows = {}
        for f in fields(Rollouts):
            dtype = torch.float32 if f.name in FLOAT_FIELDS else torch.long
            if f.name in BOOL_FIELDS:
                dtype = torch.bool
            rows[f.name] = torch.full((B,), -(f.name == "slot"), dtype=dtype)
        rows["tokens"] = torch.full((B, L), pad_id)
        rows["behav_logp"] = torch.zeros(B, L)
        return Rollouts(**rows)

    @property
    def completion_len(self) -> torch.Tensor:  # (B,)
        return self.seq_len - self.prompt_len

    def completion_mask(self) -> torch.Tensor:  # (B, L) bool
        t = torch.arange(self.tokens.shape[1], device=self.tokens.device)[None, :]
        return (t >= self.prompt_len[:, None]) & (t < self.seq_len[:, None])

    def select(self, idx: torch.Tensor) -> Rollouts:
        """Rows `idx` (index tensor or bool mask), trimmed to their longest sequence."""
        rows = {f.name: getattr(self, f.name)[idx] for f in fields(self)}
        L = int(rows["seq_len"].max()) if len(rows["seq_len"]) else 1
        rows["tokens"] = rows["tokens"][:, :L]
        rows["behav_logp"] = rows["behav_logp"][:, :L]
        return Rollouts(**rows)

    @staticmethod
    def cat(parts: list[Rollouts], pad_id: int) -> Rollouts:
        """Stack rows of several batches, right-padding token tensors to the longest."""
        L = max(p.tokens.shape[1] for p in parts)
        rows = {}
        for f in fields(Rollouts):
            values = [getattr(p, f.name) for p in parts]
            if values[0].dim() == 2:  # (b, l) -> (b, L)
                fill = pad_id if f.name == "tokens" else 0
                values = [torch.nn.functional.pad(v, (0, L - v.shape[1]), value=fill)
                          for v in values]
            rows[f.name] = torch.cat(values)
        return Rollouts(**rows)


class Row(NamedTuple):
    """One sampled sequence, as `pack` takes it."""

    ids: list[int]  # prompt + completion token ids
    prompt_len: int
    logp: list[float] | torch.Tensor  # behaviour log-prob of each completion token
    truncated: bool  # no end token came within max_new_tokens
    entropy: float  # mean token entropy of the distribution sampled


def pack(rows: list[Row], pad_id: int, prompt_idx: torch.Tensor, group: torch.Tensor,
         step: int) -> Rollouts:
    """`rows` as one on-policy Rollouts born at `step`."""
    ro = Rollouts.empty(len(rows), max((len(row.ids) for row in rows), default=1), pad_id)
    for b, row in enumerate(rows):
        end = len(row.ids)
        ro.tokens[b, :end] = torch.as_tensor(row.ids)
        ro.behav_logp[b, row.prompt_len : end] = torch.as_tensor(row.logp)
        ro.prompt_len[b] = row.prompt_len
        ro.seq_len[b] = end
        ro.truncated[b] = bool(row.truncated)
        ro.entropy[b] = row.entropy
    ro.prompt_idx = prompt_idx.long()
    ro.group = group.long()
    ro.born[:] = step
    ro.onpolicy[:] = True
    return ro


def pack_groups(rows: list[Row], tokenizer, counts: list[int], prompt_idx, step: int,
                group0: int | None) -> tuple[Rollouts, list[str]]:
    """Both engines' result: `rows` (counts[i] adjacent rows of prompt i) packed, one group id per
    prompt counted from `group0` (default step × prompts), and each completion's text before its
    end token."""
    n = len(counts)
    group = (step * n if group0 is None else group0) + torch.arange(n)
    idx = torch.tensor(prompt_idx if prompt_idx is not None else range(n))
    reps = torch.tensor(counts)
    texts = []
    for row in rows:
        completion = row.ids[row.prompt_len : len(row.ids) - (not row.truncated)]
        texts.append(tokenizer.decode(completion, skip_special_tokens=True))
    group = group.repeat_interleave(reps)
    return pack(rows, tokenizer.pad_token_id, idx.repeat_interleave(reps), group, step), texts
