"""A training step's metrics line (train.py's step 7): the fresh rows' statistics summed over
ranks, the update's metrics, each rank's own ones (advantages, verifier, replay, skipping, dynamic
sampling) averaged over ranks, the run's cumulative counts (kept in the checkpointed progress) and
the phase times. The update's metrics are computed here too (grpo.py calls them): a micro-batch's
loss terms as sums (`loss_metrics`), the update's summary over its optimizer steps, and the gap
between the trainer's and the sampler's log-probs.
"""

from __future__ import annotations

import json
import math
import time
from contextlib import contextmanager

import torch
from torch import Tensor

from batch import Rollouts
from support.parallel import MAX, all_ranks

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


class RunLog:
    """Where the metrics lines go: metrics.jsonl (`file`, open for appending: support/rundir.py's
    open_log) and the wandb run (None when off); both None on a rank other than 0. `wandb_id` is
    the run a resume continues."""

    def __init__(self, file, wandb_run, wandb_id: str | None):
        self.file = file
        self.wandb = wandb_run
        self.wandb_id = wandb_id
        if wandb_run is not None:
            self.wandb_id = wandb_run.id

    def write(self, line: dict) -> None:
        """One metrics line, flushed (a kill loses none written)."""
        if self.file is None:
            return
        self.file.write(json.dumps(line) + "\n")
        self.file.flush()
        if self.wandb:
            self.wandb.log(line, step=line["step"])

    def finish(self, summary: dict) -> None:
        """The run's end: wandb's summary and its finish."""
        if self.wandb:
            self.wandb.summary.update(summary)
            self.wandb.finish()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


@contextmanager
def timed(times: dict, name: str):
    """Add the seconds the block takes to times[name]."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        times[name] = times.get(name, 0.0) + time.perf_counter() - t0


# ------------------------------------------------------------------------ the update's metrics


def loss_metrics(loss: Tensor, m: Tensor, A: Tensor, ratio: Tensor, log_ratio: Tensor,
                 raw_w: Tensor, dual: Tensor, cfg) -> dict:
    """grpo.policy_loss's metrics (cfg its grpo.GRPOConfig): the loss, the token count and token
    sums over the mask m (B, L) (to divide by `tokens` once added over micro-batches and ranks);
    is_weight (π_prox/μ before truncation, (B, L)) also by its max and min."""
    r = ratio.detach()  # (B, L)

    def total(x: Tensor) -> Tensor:
        return torch.where(m, x.to(r.dtype), 0.0).sum()

    return {"loss": loss.detach(), "tokens": total(torch.ones_like(r)),
            "clip_dual": total(dual),
            "clip_low": total((A < 0) & (r < 1 - cfg.eps_low)),
            "clip_high": total((A > 0) & (r > 1 + cfg.eps_high)),
            "approx_kl": total((r - 1) - log_ratio.detach()),
            "is_weight_mean": total(raw_w),
            "is_capped": total(raw_w > cfg.is_cap) * (cfg.offpolicy == "decoupled"),
            "is_weight_max": torch.where(m, raw_w, -math.inf).amax(),
            "is_weight_min": torch.where(m, raw_w, math.inf).amin()}


def update_summary(steps: list[dict], reasons: list, gaps: list[Tensor],
                   minibatches: int) -> dict:
    """The update's metrics: each averaged over the optimizer steps that have it (a step with no
    trained row has only loss and grad_norm); tokens and rows summed over the steps applied."""
    keys = sorted({k for step in steps for k in step})
    metrics = {}
    for k in keys:
        have = [step[k] for step in steps if k in step]
        metrics[k] = sum(have) / len(have)
    metrics |= gap_metrics(gaps)
    applied = [step for step, why in zip(steps, reasons) if why != "gated"]
    metrics["tokens"] = sum(step.get("tokens", 0.0) for step in applied)
    metrics["rows"] = sum(step["rows"] for step in applied)  # rows with a gradient, every pass
    metrics["optim/epochs_run"] = len(applied) / minibatches
    metrics["optim/gated"] = float("gated" in reasons)
    return metrics


def logp_gap(logp: Tensor, behav_logp: Tensor, mask: Tensor) -> Tensor:
    """(3,) float64: sum, count and max of |trainer − behaviour log-prob| over `mask` (B, L)."""
    gap = (logp.detach().double().cpu() - behav_logp.double()).abs()[mask.cpu()]  # (n,)
    top = gap.max() if len(gap) else torch.tensor(0.0, dtype=torch.float64)
    return torch.stack([gap.sum(), torch.tensor(float(len(gap)), dtype=torch.float64), top])


def gap_metrics(gaps: list[Tensor]) -> dict:
    """rollout/logp_gap_mean and _max over every rank's fresh tokens that were run (NaN when none
    was): the training-inference mismatch at the weights that sampled them."""
    g = torch.stack(gaps) if gaps else torch.zeros(1, 3, dtype=torch.float64)  # (n, 3)
    total = all_ranks(g[:, :2].sum(0))
    top = all_ranks(g[:, 2].max(), MAX)
    if total[1] == 0:
        return {"rollout/logp_gap_mean": math.nan, "rollout/logp_gap_max": math.nan}
    mean = (total[0] / total[1]).item()
    return {"rollout/logp_gap_mean": mean, "rollout/logp_gap_max": float(top)}
