"""A training step's metrics line (train.py's step 7): the fresh rows' statistics summed over
ranks, the update's metrics, each rank's own ones (advantages, verifier, replay, skipping, dynamic
sampling) averaged over ranks, the run's cumulative counts (kept in the checkpointed progress) and
the phase times.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from batch import Rollouts
from support.parallel import all_ranks

# The update's counts that progress sums: tokens and rows trained, tokens of its forward-backward
# passes (every pass over the batch) and of its no-grad passes (π_old, the reference)
COUNTERS = {"trained_tokens": "tokens", "trained_rows": "rows", "fwd_bwd_tokens": "tokens/fwd_bwd",
            "no_grad_tokens": "tokens/no_grad"}


def log_row(p, world: int, lr: float, step: int, fresh: Rollouts, batch: Rollouts,
            update: dict, local: dict, t: dict) -> dict:
    """One metrics line (`p` the run's train.Progress, read only): fresh rows' statistics summed
    over ranks, the update's metrics, this rank's own ones (advantages, verifier, replay, dynamic
    sampling) averaged over the `world` ranks, the learning rate, phase times."""
    n = fresh.completion_len.double()
    sums = {"tokens": n.sum(), "rows": torch.tensor(len(fresh)),
            "reward": fresh.reward.double().sum(), "correct": fresh.correct.sum(),
            "truncated": fresh.truncated.sum(), "entropy": (fresh.entropy.double() * n).sum(),
            "replayed": batch.replayed.sum(),
            "replayed_tokens": batch.completion_len[batch.replayed].sum(),
            "batch_tokens": batch.completion_len.sum()}
    s = dict(zip(sums, all_ranks(torch.stack(list(sums.values())).double())))
    keys = sorted(local)
    means = all_ranks(torch.tensor([float(local[k]) for k in keys])) / world
    row = {"step": step + 1,
           "generated_tokens": p.generated_tokens,
           "tokens/trained": p.trained_tokens,
           "tokens/fwd_bwd": p.fwd_bwd_tokens,
           "tokens/no_grad": p.no_grad_tokens,
           "tokens/generated_total": p.generated_tokens + p.source_tokens,
           "reward_mean": (s["reward"] / s["rows"]).item(),
           "correct_mean": (s["correct"] / s["rows"]).item(),
           "response_len": (s["tokens"] / s["rows"]).item(),
           "truncated_frac": (s["truncated"] / s["rows"]).item(),
           "entropy/fresh": (s["entropy"] / s["tokens"].clamp(min=1)).item(),
           "replay/rows": int(s["replayed"]),
           "replay/token_share": (s["replayed_tokens"] / s["batch_tokens"].clamp(min=1)).item()}
    row |= {k: v for k, v in update.items() if k not in COUNTERS.values()}
    row |= dict(zip(keys, means.tolist()))
    row["lr"] = lr
    row |= {f"skipped/{k}": v for k, v in p.skipped.items()}
    row |= {f"time/{k}": v for k, v in t.items()}
    row["time/step"] = sum(t.values())
    return row


@contextmanager
def timed(times: dict, name: str):
    """Add the seconds the block takes to times[name]."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        times[name] = times.get(name, 0.0) + time.perf_counter() - t0
