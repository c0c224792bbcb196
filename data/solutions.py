"""RLEP phase I's solutions file: JSONL rows as eval.py --save-correct writes them, read and checked
for replay.py's `rlep` strategy (replay.rlep_source), with the tokens it cost and its sha256."""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

import torch

from data.loaders import PARSED_BYTES, json_line, jsonl_rows, machine_memory, open_regular
from batch import Rollouts, Row, pack


def read_rlep_source(path: str, problems: list, tokenizer, max_new_tokens: int) -> list[tuple]:
    """RLEP phase I's solutions in `path` as (prompt index, completion ids), every field checked:
    ValueError naming file, line and field. Rows as eval.py --save-correct writes them
    ({"problem": text or "prompt_idx": i, "completion_ids": [...], "behav_logp": [...]}), the
    sampled tokens replayed exactly; a text-only row ({"completion": text}) is tokenized, the end
    token appended. A row over max_new_tokens is refused: cut, it is not the verified answer."""
    by_problem = {p.problem: i for i, p in enumerate(problems)}
    vocab = len(tokenizer) if tokenizer is not None else 2**63  # (None: every row carries its ids)
    size = os.stat(path).st_size if os.path.exists(path) else 0
    if size * PARSED_BYTES > machine_memory():
        raise ValueError(f"{path} is {size / 2**30:.1f} GB, more than this machine holds parsed")
    rows = []
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
        if len(ids) > max_new_tokens:
            raise ValueError(f"{where}: completion_ids holds {len(ids)} tokens, over "
                             f"rollout.max_new_tokens ({max_new_tokens}): it would be cut")
        rows.append((i, ids))
    if not rows:
        raise ValueError(f"replay.rlep_source {path} holds no solutions")
    return rows


def rlep_generated_tokens(path: str) -> int:
    """The tokens phase I generated, from `<path>.meta.json` (0 without one)."""
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


def file_sha256(path: str) -> str:
    """The file's sha256: a resumed rlep run checks it is reading the file it started from."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class PhaseOne:
    """RLEP's phase-I store: every verified success of `rlep_source`, kept whole beside the ring
    (`capacity` does not apply). Ragged: the completions' int32 ids in one flat tensor with row
    offsets, sorted by prompt so a prompt's rows are one range; no log-probs (RLEP replays them as
    on-policy). A checkpoint holds the file's sha256 and each row's replay count, not the rows."""

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
            logp = [0.0] * (len(seq) - len(prompt))
            row = Row(ids=seq, prompt_len=len(prompt), logp=logp, truncated=False, entropy=0.0)
            parts.append(row)
        out = pack(parts, pad_id, self.prompt_idx[rows], torch.full((n,), -1), 0)
        out.reward = torch.full((n,), reward)
        out.correct = torch.ones(n, dtype=torch.bool)
        out.replayed = torch.ones(n, dtype=torch.bool)
        self.used.index_add_(0, rows, torch.ones(n, dtype=torch.int32))
        return out
