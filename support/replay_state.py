"""The replay buffer in a checkpoint: its state (the occupied rows and every slot's fields, so the
file grows with what is stored, not with the capacity), and resuming the buffers of another number
of processes (a checkpoint of 8 ranks on 4): every saved rank's rows merged and dealt out again by
prompt, so a prompt's rows stay on one rank.
"""

from __future__ import annotations

from dataclasses import fields

import torch

RAGGED = ("tokens", "behav_logp")  # the (rows, max_len) fields: a checkpoint holds occupied rows
# `replay.rows` is a batch.Rollouts; this module reads its class from it (no import of the
# reading path), as `type(replay.rows)`.


def state_dict(replay) -> dict:
    """Every per-slot field; the tokens and log-probs of occupied slots only, cut to their
    longest row (a write replaces whole rows: an empty slot's contents are never read)."""
    slots = replay.stored()
    L = int(replay.rows.seq_len[slots].max()) if len(slots) else 0
    flat = [f.name for f in fields(replay.rows) if f.name not in RAGGED]
    d = {k: getattr(replay.rows, k).clone() for k in flat}
    d["tokens"] = replay.rows.tokens[slots, :L]
    d["behav_logp"] = replay.rows.behav_logp[slots, :L]
    for k in ("valid", "used", "score", *replay.STATE):
        d[k] = _copy(getattr(replay, k))
    d["head"] = replay.head
    d["rng"] = replay.gen.get_state()
    d["evicted"] = dict(replay.evicted)
    d["last"] = dict(replay.last)
    d["max_len"] = replay.rows.tokens.shape[1]
    return d

def load_state_dict(replay, d: dict) -> None:
    shape, here = (len(d["valid"]), d["max_len"]), tuple(replay.rows.tokens.shape)
    if shape != here:
        raise ValueError(f"replay state holds {shape} rows × tokens, this buffer {here}")
    Rollouts = type(replay.rows)
    empty = Rollouts.empty(*shape, replay.pad_id)
    rows = {f.name: d[f.name].clone() for f in fields(Rollouts) if f.name not in RAGGED}
    replay.rows = Rollouts(**rows, tokens=empty.tokens.int(), behav_logp=empty.behav_logp)
    slots = d["valid"].nonzero().squeeze(1)
    L = d["tokens"].shape[1]
    replay.rows.tokens[slots, :L] = d["tokens"].int()
    replay.rows.behav_logp[slots, :L] = d["behav_logp"]
    for k in ("valid", "used", "score", *replay.STATE):
        setattr(replay, k, _copy(d[k]))
    replay.head = d["head"]
    replay.evicted = dict(d["evicted"])
    replay.last = dict(d["last"])
    replay.gen.set_state(d["rng"])


def load_split(replay, parts: list[dict], rank: int, world: int, seed: int) -> None:
    """Resume `replay` from the state_dicts of another number of processes (`parts`, one per saved
    rank): their rows merged and dealt out by prompt (the i-th prompt in id order to rank
    i mod world), written oldest first; scores and replay counts kept; STATE merged
    (`merge_state`); eviction totals the saved ranks' mean (the logged mean goes on); the sampler
    restarts from `seed`. A strategy with more state merges it in `merge_split(parts)`."""
    Rollouts = type(replay.rows)
    merged, score, used = [], [], []
    for d in parts:
        slots = d["valid"].nonzero().squeeze(1)
        flat = {f.name: d[f.name][slots] for f in fields(Rollouts) if f.name not in RAGGED}
        merged.append(Rollouts(**flat, tokens=d["tokens"].long(), behav_logp=d["behav_logp"]))
        score.append(d["score"][slots])
        used.append(d["used"][slots])
    rows = Rollouts.cat(merged, replay.pad_id)
    score = torch.cat(score)
    used = torch.cat(used)
    _, prompt_rank = torch.unique(rows.prompt_idx, return_inverse=True)
    mine = torch.nonzero(prompt_rank % world == rank).squeeze(1)
    mine = mine[torch.argsort(rows.born[mine], stable=True)]  # oldest first, then rank, slot
    if len(mine):
        slots = replay.write(rows.select(mine), score[mine])
        replay.used[slots] = used[mine][len(mine) - len(slots) :]
    for k in replay.STATE:
        setattr(replay, k, merge_state([d[k] for d in parts]))
    replay.evicted = {k: sum(d["evicted"][k] for d in parts) // len(parts) for k in replay.evicted}
    replay.last = dict(parts[0]["last"])
    replay.gen.manual_seed(seed)
    merge = getattr(replay, "merge_split", None)
    if merge is not None:
        merge(parts)


def merge_state(values: list):
    """One STATE attribute from the saved ranks' values: tensors of ids united, flags or-ed,
    anything else rank 0's."""
    if torch.is_tensor(values[0]):
        return torch.unique(torch.cat(values))
    if isinstance(values[0], bool):
        return any(values)
    return values[0]


def _copy(value):
    return value.clone() if torch.is_tensor(value) else value
