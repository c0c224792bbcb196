"""GRPO as functions on tensors (group advantages, token log-probs, the clipped loss; its metrics
are summed in metrics.py), and `update_policy`, which applies the loss to one batch in mini- and
micro-batches.

Per completion token t of rollout i (advantage A_i; log-probs at the sampling temperature):

    base_it = log μ_it       behaviour log-prob stored at generation (`behaviour`, replayed rows)
            = log π_prox,it  the policy at the start of the optimizer step (`decoupled`; on-policy)
    r_it    = exp(log π_θ,it − base_it)
    pg_it   = max(−A_i·r_it, −A_i·clip(r_it, 1 − eps_low, 1 + eps_high))
    pg_it   = min(pg_it, c·|A_i|)                 if dual_clip = c > 0 and A_i < 0
    w_it    = min(π_prox,it / μ_it, C), detached  `decoupled`, replayed rows; else 1
    L_it    = w_it·pg_it + beta·(exp(d_it) − d_it − 1),  d_it = log π_ref,it − log π_θ,it  (k3)

summed over the completion tokens as `aggregate` says.

Departures from textbook GRPO (DeepSeekMath: group-std advantages, per-sequence token mean,
symmetric clip against the sampling policy, k3 KL to a reference with beta > 0):
1. Stale data: replayed rows were sampled by an older policy μ, so their ratio is not 1 even at
   the first optimizer step. `behaviour` clips it against μ (TRL's multi-iteration GRPO, RePO):
   a token that drifted past the clip gives no gradient. `decoupled` clips against π_prox and
   weights by min(π_prox/μ, C) (decoupled PPO). `shaped` gives replayed tokens −A·r/(r + 0.1),
   r against μ, unclipped (ExGRPO's release).
2. On-policy rows (fresh ones, and RLEP replays, current by definition) take π_prox as base and
   w = 1: their stored μ differs from the training forward by KV-cache numerics and, with
   top_p < 1, the nucleus renormalisation, which would look like staleness. With one optimizer
   step per batch π_prox = π_θ, so r = 1: unlike nanochat we need the ratio, but only for stale
   rows.
3. Replayed rows keep that top-p mismatch (π at temperature T against μ after top-p): with
   top_p < 1 their weights are biased down even when the weights have not moved.
4. Asymmetric clip (DAPO's clip-higher, 0.2 / 0.28) and an optional dual clip at c·|A| for A < 0.
5. Loss aggregation is a key (`grpo` per-sequence mean, `dapo` token mean, `dr_grpo` token sum
   over a constant), normalised by totals over the whole optimizer batch (every micro-batch and
   rank), so gradient accumulation is exact.
6. The KL weight beta defaults to 0 (DAPO, Dr. GRPO, RLEP); when on, it is added per token.
7. Advantage scales `batch` and `none` (Dr. GRPO) besides `group` (unbiased std); groups with
   equal rewards get exactly 0 and are counted in the metrics.
8. Entropy is measured, never a bonus (never differentiated).
9. Truncated rows can be left out of the loss (rollout.mask_truncated, DAPO) and rewards shaped
   by length (rewards.overlong_penalty); both off by default.
10. Reuse (optim.epochs = E, GRPO's μ iterations; E, not μ, as μ is the behaviour policy; 1 by
   default): E passes over the batch, each reshuffled into optim.minibatches. π_prox = π_old, one
   no-grad pass at the start of the step (before the first optimizer step, the training forward
   itself: ratio exactly 1), so on-policy rows clip against the sampling policy in every pass.
   Replayed rows: `behaviour` clips against μ every pass, `decoupled` against π_old with
   min(π_old/μ, C) fixed for the step, `shaped` applies its unclipped term E times.
11. Gradient gating (optim.gate, off by default; DGG, arXiv 2605.19425): in passes 2..E an
   optimizer step whose lm_head gradient norm exceeds gate × that of the step's first optimizer
   step is dropped before AdamW sees it, and the remaining passes are not run (`Gate`).
12. Fresh rows an inference engine sampled (rollout.engine = vllm) are not exactly on-policy:
   with grpo.engine_is_cap = C > 0 their tokens get w = min(π_prox/μ, C), detached (TRL's vLLM
   importance correction; off by default: ≤ ~5e-5 nats on a CPU), with departure 3's bias.
13. Sampler and trainer log-probs of the same tokens differ even at the same weights: both run
   the output layer in float32, but the sampler attends one token at a time to a KV cache and the
   trainer runs whole rows, so sums are ordered differently: ~1e-6 in float32; with bf16 compute
   (a Qwen2.5-0.5B-shaped model on a CPU) mean 0.004, max 0.05 nats. Logged as
   rollout/logp_gap_mean and _max (`logp_gap`); replayed rows' ratios carry it, on-policy rows
   never see it (2).
14. Lookahead (lookahead.method, off by default; methods/lookahead.py): SFPO's K fast passes, a
   reposition θ0 + α(θK − θ0) and a slow pass, or GXPO's two fast passes, an extrapolated move and
   a corrective pass. Every pass clips against π_old as in 10; AdamW's moments run on through the
   passes and across the move (both releases). Their own departures are listed there.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.distributed.fsdp import FSDPModule

from metrics import logp_gap, loss_metrics, timed, update_summary
from support import parallel
from support.logprobs import completion_logprobs, mode
from support.parallel import hf_module
from support.parallel import MAX, all_ranks
from support.preempt import Interrupted, should_stop


@dataclass
class GRPOConfig:
    adv_scale: str = "group"
    """advantage divisor: `group` std, `batch` std of group-centred rewards, `none` (Dr. GRPO)"""
    adv_eps: float = 1e-6
    """added to the std before dividing"""
    loss_agg: str = "dapo"
    """`grpo` per-sequence mean, `dapo` token mean, `dr_grpo` token sum / (n_seqs·max_new_tokens)"""
    eps_low: float = 0.2
    """lower ratio clip 1 − eps_low"""
    eps_high: float = 0.28
    """upper ratio clip 1 + eps_high (DAPO clip-higher; = eps_low for PPO's symmetric clip)"""
    dual_clip: float = 0.0
    """0 = off; else c > 1 bounds the loss of tokens with A < 0 at c·|A| (verl 3, RLEP 10)"""
    offpolicy: str = "behaviour"
    """replayed rows: `behaviour` (clip vs μ), `decoupled` (π_prox, × min(π_prox/μ, C)), `shaped`"""
    is_cap: float = 2.0
    """C in min(π_prox/μ, C), decoupled mode only"""
    beta: float = 0.0
    """k3 KL weight; the reference model is not even loaded when 0"""
    engine_is_cap: float = 0.0
    """fresh rows of rollout.engine=vllm: × min(π_prox/μ, C), C this (0 = off; departure 12)"""

    def check(self) -> dict[str, tuple[bool, str]]:
        offpolicy = ("behaviour", "decoupled", "shaped")
        engine_cap = self.engine_is_cap == 0 or 1 <= self.engine_is_cap < 1e6
        return {
            "adv_scale": (self.adv_scale in ("group", "batch", "none"), "group, batch or none"),
            "adv_eps": (0 <= self.adv_eps < 1, "in [0, 1)"),
            "loss_agg": (self.loss_agg in ("grpo", "dapo", "dr_grpo"), "grpo, dapo or dr_grpo"),
            "offpolicy": (self.offpolicy in offpolicy, "behaviour, decoupled or shaped"),
            "eps_low": (0 <= self.eps_low < 1, "in [0, 1)"),
            "eps_high": (0 <= self.eps_high < 100, "in [0, 100)"),
            "dual_clip": (self.dual_clip == 0 or 1 < self.dual_clip < 1e6, "0 (off) or > 1"),
            "is_cap": (1 <= self.is_cap < 1e6, "≥ 1"),
            "beta": (0 <= self.beta < 1e6, "≥ 0"),
            "engine_is_cap": (engine_cap, "0 (off) or ≥ 1"),
        }


@dataclass(frozen=True)
class UpdateSettings:
    """What `update_policy` reads of the run's config (config.update_settings builds it)."""

    loss: GRPOConfig  # grpo.*
    optim: object  # optim.*: passes, mini- and micro-batches, the gate, grad_clip
    temperature: float  # rollout.temperature: every log-prob is taken at it
    max_new_tokens: int  # rollout.max_new_tokens: dr_grpo's constant
    mask_truncated: bool  # rollout.mask_truncated: truncated rows are left out of the loss
    engine: str  # rollout.engine: rows an inference engine sampled may be weighted (departure 12)
    gradient_checkpointing: bool  # model.gradient_checkpointing: no KV cache to share a prompt
    stoppable: bool  # several passes: a stop ends the update between optimizer steps (train.loop)


@dataclass
class GroupStats:
    """Per-group reductions of values (N,) over group ids (N,), in float64; K groups."""

    ids: Tensor  # (K,) the distinct group ids, sorted
    index: Tensor  # (N,) each row's group, 0..K-1
    count: Tensor  # (K,) rows
    total: Tensor  # (K,) sum of the values
    mean: Tensor  # (K,)
    std: Tensor  # (K,) unbiased, 0 for a single row
    flat: Tensor  # (K,) all values equal: exact, where std can be > 0 by round-off in the mean


def group_stats(values: Tensor, group: Tensor) -> GroupStats:
    """Count, sum, mean, std and flatness of each group. Rows of a group need not be adjacent and
    ids need not be contiguous."""
    ids, index = torch.unique(group, return_inverse=True)  # (K,), (N,)
    x = values.double()  # (N,)

    def per_group(v: Tensor, how: str = "sum", init: float = 0.0) -> Tensor:  # (N,) -> (K,)
        return torch.full((len(ids),), init, dtype=x.dtype).scatter_reduce(0, index, v, how)

    count = per_group(torch.ones_like(x))
    total = per_group(x)
    mean = total / count
    var = per_group((x - mean[index]) ** 2) / (count - 1).clamp(min=1)
    flat = per_group(x, "amax", -math.inf) == per_group(x, "amin", math.inf)
    return GroupStats(ids, index, count, total, mean, var.sqrt(), flat)


def group_advantages(rewards: Tensor, group: Tensor, scale: str = "group",
                     eps: float = 1e-6) -> tuple[Tensor, dict]:
    """A_i = (r_i − mean_g) / (std_g + eps), g the group of row i: advantages (N,) and metrics.

    scale="group": std_g, the unbiased std of group g's rewards (as TRL and verl).
    scale="batch": one std, of the group-centred rewards over the batch (so that differences in
                   difficulty between prompts do not inflate it).
    scale="none":  A_i = r_i − mean_g (Dr. GRPO: dividing by std_g up-weights prompts that are
                   too easy or too hard).
    A group whose rewards are all equal gets A = 0 exactly, despite round-off in its mean.
    """
    s = group_stats(rewards, group)
    centred = rewards.double() - s.mean[s.index]  # (N,)
    adv = centred
    if scale == "group":
        adv = centred / (s.std[s.index] + eps)
    elif scale == "batch":
        one_row = torch.tensor(0.0, dtype=centred.dtype)
        adv = centred / ((centred.std() if len(centred) > 1 else one_row) + eps)
    elif scale != "none":
        raise ValueError(f"adv_scale must be group | batch | none, got {scale!r}")
    adv = torch.where(s.flat[s.index], 0.0, adv)  # also replaces 0/0 when eps = 0
    metrics = {"adv/zero_std_frac": s.flat.double().mean().item(),
               "adv/groups": float(len(s.ids)),
               "adv/abs_mean": adv.abs().mean().item()}
    return adv.to(rewards.dtype), metrics


def policy_loss(logp: Tensor, behav_logp: Tensor, advantages: Tensor, mask: Tensor,
                onpolicy: Tensor, cfg: GRPOConfig, *, n_seqs: int, n_tokens: int,
                max_new_tokens: int, prox_logp: Tensor | None = None,
                ref_logp: Tensor | None = None, entropy: Tensor | None = None,
                engine_rows: Tensor | None = None) -> tuple[Tensor, dict]:
    """The loss of one micro-batch (L_it in the module docstring, `aggregate`d) and its metrics.

    logp (B, L) with grad; behav_logp (B, L) the stored μ; prox_logp (B, L) π at the start of the
    step (None: logp.detach(), exact while the weights have not moved); advantages (B,); mask
    (B, L) completion tokens; onpolicy (B,) rows whose μ counts as π_prox; engine_rows (B,) fresh
    rows an inference engine sampled. n_seqs and n_tokens count the whole optimizer batch.
    Metrics add up over micro-batches and ranks: the loss, `tokens`, and token sums to divide by
    `tokens`; is_weight_max / _min (π_prox/μ before truncation) take a max / min.
    """
    m = mask.bool()  # (B, L)

    def valid(x: Tensor) -> Tensor:  # padding (even NaN) gives loss and gradient 0
        return torch.where(m, x, 0.0)

    logp, behav = valid(logp), valid(behav_logp)  # (B, L)
    prox = valid(logp.detach() if prox_logp is None else prox_logp)  # (B, L)
    A = valid(advantages[:, None].to(logp.dtype))  # (B, L)
    fresh = onpolicy.bool()[:, None]  # (B, 1)
    log_w = torch.where(fresh, 0.0, prox - behav)  # (B, L) log π_prox/μ, 0 on on-policy rows
    decoupled = cfg.offpolicy == "decoupled"
    if decoupled:
        base, w = prox, log_w.exp().clamp(max=cfg.is_cap)
    else:
        base, w = torch.where(fresh, prox, behav), 1.0
    log_ratio = logp - base
    ratio = log_ratio.exp()  # (B, L)
    pg = torch.maximum(-A * ratio, -A * ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high))  # (B, L)
    dual = torch.zeros_like(m)
    if cfg.dual_clip > 0:
        dual = (A < 0) & (pg > -A * cfg.dual_clip)
    pg = torch.where(dual, -A * cfg.dual_clip, pg)
    if cfg.offpolicy == "shaped":  # ExGRPO: replayed tokens get −A·r/(r + 0.1), no clip
        pg = torch.where(fresh, pg, -A * ratio / (ratio + 0.1))
    per_tok = w * pg  # (B, L)
    engine_w = _engine_weight(prox, behav, engine_rows, cfg.engine_is_cap)  # (B, L) or None
    if engine_w is not None:
        per_tok = engine_w * per_tok
    if cfg.beta > 0:
        if ref_logp is None:
            raise ValueError("beta > 0 needs ref_logp")
        d = valid(ref_logp) - logp  # (B, L)
        kl = d.exp() - d - 1
        per_tok = per_tok + cfg.beta * kl
    loss = aggregate(per_tok, m, cfg.loss_agg, n_seqs, n_tokens, max_new_tokens)
    with torch.no_grad():
        metrics = loss_metrics(loss, m, A, ratio, log_ratio, log_w.exp(), dual, cfg)
        extra = {"entropy": entropy, "kl_ref": kl if cfg.beta > 0 else None,
                 "engine_is_weight_mean": engine_w}
        for key, x in extra.items():
            if x is not None:
                metrics[key] = valid(x.detach().to(logp.dtype)).sum()
    return loss, metrics


def aggregate(per_tok: Tensor, mask: Tensor, how: str, n_seqs: int, n_tokens: int,
              max_new_tokens: int) -> Tensor:
    """The loss of per-token terms (B, L) (departure 5). n_seqs and n_tokens count the whole
    optimizer batch, so the losses of its micro-batches add up to its loss."""
    if how == "grpo":  # Σ_i (Σ_t L_it / |o_i|) / n_seqs
        return (per_tok.sum(1) / mask.sum(1).clamp(min=1)).sum() / n_seqs
    if how == "dapo":  # Σ_it L_it / n_tokens
        return per_tok.sum() / n_tokens
    return per_tok.sum() / (n_seqs * max_new_tokens)  # dr_grpo: Σ_it L_it / (n_seqs · T_max)


def _engine_weight(prox: Tensor, behav: Tensor, rows: Tensor | None, cap: float) -> Tensor | None:
    """(B, L) min(π_prox/μ, cap) on `rows` (B,), 1 elsewhere, detached; None when off."""
    if rows is None or cap <= 0:
        return None
    w = (prox.detach() - behav).exp().clamp(max=cap)  # (B, L)
    return torch.where(rows.bool()[:, None], w, 1.0)


# ------------------------------------------------------------------ the update's log-prob passes


def policy_logprobs(model, rows, s: UpdateSettings, device,
                    with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """logp (b, l): log π(token | the tokens before it) at the sampling temperature of each
    completion token of `rows` (Rollouts) under `model`, 0 on prompt and padding; with_entropy:
    also the entropy (b, l) of the distribution that predicted it (no gradient). This is the loss's
    `logp`, with gradients when called under grad. The output layer and the log-softmax run in
    chunks in float32 (support/logprobs.py: no (b, l, V) tensor); each distinct prompt runs once
    and its KV cache serves its rows, unless gradient checkpointing drops the cache or an FSDP
    backward would need weights it has freed."""
    # FSDP: asked of the module, not of a parameter (an unsharded root holds plain tensors)
    sharded = isinstance(hf_module(model), FSDPModule)
    share = not s.gradient_checkpointing and not (torch.is_grad_enabled() and sharded)
    return completion_logprobs(model, rows.tokens.to(device), rows.prompt_len.to(device),
                               rows.seq_len.to(device), s.temperature, with_entropy,
                               share_prompt=share)


def no_grad_logprobs(model, batch, s, compute, device,
                     with_entropy=False) -> tuple[Tensor, Tensor]:
    """(B, L) log-probs (and entropies) of `batch`'s rows under `model`, without gradients,
    optim.logprob_batch_size rows at a time. Under FSDP each forward is collective, so a rank with
    fewer chunks repeats a chunk (discarded)."""
    logp, ent = torch.zeros(batch.tokens.shape), torch.zeros(batch.tokens.shape)  # (B, L)
    chunks = list(torch.argsort(batch.completion_len).split(s.optim.logprob_batch_size))
    for j in range(int(all_ranks(len(chunks), MAX))):
        rows = chunks[min(j, len(chunks) - 1)]
        with torch.no_grad(), compute:
            lp, e = policy_logprobs(model, batch.select(rows), s, device, with_entropy)
        if j < len(chunks):
            logp[rows, : lp.shape[1]] = lp.float().cpu()
            ent[rows, : lp.shape[1]] = e.float().cpu() if with_entropy else 0.0
    return logp, ent


def micro_batches(rows: Tensor, completion_len: Tensor, seq_len: Tensor, o) -> list[Tensor]:
    """`rows` (indices) sorted by completion length and cut into micro-batches (o is optim.*):
    of o.micro_batch_size rows, or, when o.micro_batch_tokens > 0, as many rows as fit in that
    many padded tokens (a longer row goes alone). The loss does not depend on the cut."""
    rows = rows[torch.argsort(completion_len[rows], stable=True)]
    if o.micro_batch_tokens == 0:
        return [m for m in rows.split(o.micro_batch_size) if len(m)]
    out, start, longest = [], 0, 0
    for k, i in enumerate(rows.tolist()):
        longest = max(longest, int(seq_len[i]))
        if k > start and (k + 1 - start) * longest > o.micro_batch_tokens:
            out.append(rows[start:k])
            start, longest = k, int(seq_len[i])
    if len(rows) > start:
        out.append(rows[start:])
    return out


# ------------------------------------------------------------------------------------ the update


def minibatch_plan(n: int, o, passes: int) -> list[tuple[int, Tensor]]:
    """(pass, rows) of every optimizer step of an update over n rows: `passes` passes, each a
    shuffle split into o.minibatches. The shuffles (torch's global RNG, saved in checkpoints) are
    all drawn first, so the RNG stream after the update does not depend on where a gate stopped
    it; with one mini-batch nothing is drawn."""
    plan = []
    for epoch in range(passes):
        order = torch.randperm(n) if o.minibatches > 1 else torch.arange(n)
        for rows in order.tensor_split(o.minibatches):
            plan.append((epoch, rows))
    return plan


@dataclass
class Update:
    """One step's update over this rank's batch: what its passes share (π_old, fixed at the start,
    the shuffles of every pass) and what its optimizer steps accumulate. `start_update` makes it,
    `run_pass` runs a pass, `finish_update` sums it up; `update_policy` is plain GRPO's sequence,
    and a method that replaces the update (methods/) writes its own."""

    s: UpdateSettings
    model: torch.nn.Module  # the HF module
    policy: torch.nn.Module  # what the training forward goes through (compiled, DDP)
    optimizer: torch.optim.Optimizer
    device: torch.device
    compute: object  # the autocast context, or a null one
    batch: object  # Rollouts: this rank's update batch
    plan: list  # per pass, the rows (indices) of each of its optimizer steps
    trained: Tensor  # (B,) rows the loss may use (rollout.mask_truncated leaves truncated out)
    prox: Tensor | None  # (B, L) π_old, when a later optimizer step needs it
    ref: Tensor | None  # (B, L) the reference's, when beta > 0
    fresh: Tensor  # (B, L) completion tokens sampled for this step (not replayed)
    entropy: Tensor  # (B,) each row's mean token entropy, NaN until trained on
    gaps: list  # logp_gap sums of the fresh tokens at the sampling weights
    cost: dict  # token passes: tokens/fwd_bwd, tokens/no_grad (this rank's)
    times: dict  # seconds per phase
    steps: list = field(default_factory=list)  # each optimizer step's metrics
    skipped: list = field(default_factory=list)  # why each step was not applied (None: it was)


def start_update(s: UpdateSettings, model, policy, optimizer, batch, device, compute, ref,
                 passes: int) -> Update:
    """An update of `passes` passes over `batch`: π_old once when any optimizer step follows the
    first (a no-grad pass), the reference's log-probs when beta > 0, and every pass's shuffle
    (`minibatch_plan`)."""
    times, cost = {}, {"tokens/fwd_bwd": 0, "tokens/no_grad": 0}
    compute = compute or nullcontext()
    trained = torch.ones(len(batch), dtype=torch.bool)
    if s.mask_truncated:
        trained = ~batch.truncated
    prox, ref_lp = None, None
    with timed(times, "prox_logprobs"):  # π_old at the start of the step, for the later steps
        if s.optim.minibatches > 1 or passes > 1:
            prox = no_grad_logprobs(model, batch, s, compute, device)[0]  # (B, L)
            cost["tokens/no_grad"] += int(batch.seq_len.sum())
    with timed(times, "ref_logprobs"):
        if ref is not None:
            ref_lp = no_grad_logprobs(ref, batch, s, compute, device)[0]  # (B, L)
            cost["tokens/no_grad"] += int(batch.seq_len.sum())
    fresh = batch.completion_mask() & ~batch.replayed[:, None]  # (B, L) sampled for this step
    gaps = []
    if prox is not None:
        gaps.append(logp_gap(prox, batch.behav_logp, fresh))
    plan = [[] for _ in range(passes)]
    for k, rows in minibatch_plan(len(batch), s.optim, passes):
        plan[k].append(rows)
    entropy = torch.full((len(batch),), math.nan)
    return Update(s, model, policy, optimizer, device, compute, batch, plan, trained, prox,
                  ref_lp, fresh, entropy, gaps, cost, times)


def run_pass(u: Update, k: int, inspect=None) -> bool:
    """Pass k over the batch: optim.minibatches optimizer steps, each a loss over its rows in
    micro-batches, accumulated, clipped and applied. `inspect(k)`, when given, runs between a
    step's backward and its optimizer step and returns metrics for the step's line; with
    "gated": True among them the step is dropped (AdamW never sees it), and run_pass returns True:
    the caller runs no more passes. Every rank takes the same steps."""
    s, batch = u.s, u.batch
    for rows in u.plan[k]:
        rows = rows[u.trained[rows]]
        # Before the first optimizer step of several passes the training forward is π_old itself
        # (ratio exactly 1).
        old = u.prox
        if len(u.plan) > 1 and not u.steps:
            old = None
        run = rows
        if s.loss.beta == 0:
            run = rows[batch.advantage[rows] != 0]  # A = 0 gives no gradient
        n_seqs, n_tokens, signal, stop = all_ranks(torch.tensor(
            [len(rows), float(batch.completion_len[rows].sum()),
             float((batch.advantage[rows] != 0).any()), float(should_stop())])).tolist()
        if stop and s.stoppable:  # (every rank at once; train.loop puts the step back)
            raise Interrupted
        u.optimizer.zero_grad(set_to_none=True)
        # train mode: gradient checkpointing and LoRA's dropout act only then (logprobs.mode)
        with timed(u.times, "forward_backward"), mode(u.policy, training=True):
            sums, hi, lo = _forward_backward(s, u.policy, u, run, old, n_seqs, n_tokens,
                                             signal > 0, u.device, u.compute)
        with timed(u.times, "optimizer"):
            measured = {}
            if inspect is not None:
                measured = inspect(k)
            gated = measured.pop("gated", False)
            step = _optimizer_step(s.optim.grad_clip, u.model, u.optimizer, sums, hi, lo,
                                   signal > 0, gated)
            u.steps.append(step | measured | {"rows": all_ranks(float(len(run)))})
            u.skipped.append(u.steps[-1].pop("skipped"))
        if gated:
            return True
    return False


def finish_update(u: Update, extra: dict | None = None) -> tuple:
    """(the update's metrics: metrics.update_summary of its steps, then `extra`, then its token
    passes summed over ranks; each row's mean token entropy (NaN if not trained on); why each step
    was skipped (None when taken); seconds per phase)."""
    metrics = update_summary(u.steps, u.skipped, u.gaps, u.s.optim.minibatches) | (extra or {})
    totals = all_ranks(torch.tensor(list(u.cost.values()), dtype=torch.float64))  # every rank's
    cost = dict(zip(u.cost, totals.tolist()))
    return metrics | cost, u.entropy, u.skipped, u.times


def update_policy(s: UpdateSettings, model, policy, optimizer, batch, device, compute=None,
                  ref=None) -> tuple:
    """Plain GRPO's update of `batch`: optim.epochs passes (GRPO's μ iterations), each
    optim.minibatches optimizer steps, every step clipped against π_old. `model` is the HF
    module, `policy` what the training forward goes through (compiled, DDP). Returns
    `finish_update`'s tuple. Raises FloatingPointError when a step leaves non-finite weights."""
    u = start_update(s, model, policy, optimizer, batch, device, compute, ref, s.optim.epochs)
    for k in range(s.optim.epochs):
        run_pass(u, k)
    return finish_update(u)


def _forward_backward(s, policy, at: Update, run: Tensor, old: Tensor | None, n_seqs: float,
                      n_tokens: float, signal: bool, device, compute) -> tuple:
    """The loss of rows `run` (indices into at.batch), micro-batch by micro-batch, and its
    gradient accumulated (n_seqs and n_tokens: the optimizer step's totals over every rank; no
    backward when no rank has a non-zero advantage). Returns the metrics' sums and the extreme
    importance weights; each row's entropy, the fresh tokens' logp gap and the token passes go
    into `at`."""
    o, batch = s.optim, at.batch
    micro = micro_batches(run, batch.completion_len, batch.seq_len, o)
    n_micro = int(all_ranks(max(1, len(micro)), MAX))  # every rank runs as many (collectives)
    sums, hi, lo = {}, torch.tensor(-math.inf), torch.tensor(math.inf)
    for j in range(n_micro):
        real = j < len(micro)
        idx = micro[j] if real else torch.arange(1)  # a stand-in of loss weight 0
        mb = batch.select(idx)
        mask, cols = mb.completion_mask().to(device), mb.tokens.shape[1]
        with parallel.micro_sync(policy, last=j == n_micro - 1), compute:
            logp, ent = policy_logprobs(policy, mb, s, device, with_entropy=True)  # (b, l)
            loss, m = policy_loss(
                logp, mb.behav_logp.to(device), mb.advantage.to(device), mask,
                mb.onpolicy.to(device), s.loss, n_seqs=max(1, int(n_seqs)),
                n_tokens=max(1, int(n_tokens)), entropy=ent,
                max_new_tokens=s.max_new_tokens,
                engine_rows=engine_rows(s.engine, mb, device),
                prox_logp=None if old is None else old[idx, :cols].to(device),
                ref_logp=None if at.ref is None else at.ref[idx, :cols].to(device))
            if signal:
                parallel.backward(loss, real)
        if not real:
            continue
        at.cost["tokens/fwd_bwd"] += int(mb.seq_len.sum())
        at.entropy[idx] = ((ent * mask).sum(1) / mask.sum(1).clamp(min=1)).float().cpu()
        if at.prox is None:  # one optimizer step: this forward is at the sampling weights
            at.gaps.append(logp_gap(logp, mb.behav_logp, at.fresh[idx, :cols]))
        hi = torch.maximum(hi, m.pop("is_weight_max").cpu())
        lo = torch.minimum(lo, m.pop("is_weight_min").cpu())
        sums = {k: sums.get(k, 0.0) + v.double().cpu() for k, v in m.items()}
    return sums, hi, lo


def engine_rows(engine: str, rows, device) -> Tensor | None:
    """(B,) the fresh rows of `rows` when an inference engine sampled them (departure 12)."""
    if engine == "hf":
        return None
    return (~rows.replayed).to(device)


def _optimizer_step(grad_clip: float, model, optimizer, sums: dict, hi: Tensor, lo: Tensor,
                    any_signal: bool, gated: bool = False) -> dict:
    """Combine the metrics over ranks, clip, and step unless there is nothing to learn (all-zero
    advantages: AdamW would still move the weights through momentum and decay), the loss or
    gradient is not finite, or the gate closed (AdamW's moments never see the gradient)."""
    keys = sorted(sums)
    ext = all_ranks(torch.stack([hi, -lo]).double(), MAX)
    out = {"loss": 0.0}
    if keys:
        out = dict(zip(keys, all_ranks(torch.stack([sums[k] for k in keys])).tolist()))
    out = {k: v if k in ("loss", "tokens") else v / max(out["tokens"], 1) for k, v in out.items()}
    grad_norm = torch.tensor(0.0)
    if any_signal:
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip or math.inf)
    grad_norm = float(parallel.full_tensor(grad_norm))
    skipped = None if any_signal else "zero_adv"
    if any_signal and not (math.isfinite(out["loss"]) and math.isfinite(grad_norm)):
        skipped = "nonfinite"  # the weights are left as they are
    if gated:
        skipped = "gated"
    if skipped is None:
        optimizer.step()
        trained = [p for p in model.parameters() if p.requires_grad]  # a frozen base never changes
        shards = [parallel.local(p) for p in trained]
        if all_ranks(float(not all(bool(torch.isfinite(p).all()) for p in shards))):
            raise FloatingPointError("non-finite weights after the optimizer step")
    optimizer.zero_grad(set_to_none=True)
    return out | {"grad_norm": grad_norm, "is_weight_max": ext[0].item(),
                  "is_weight_min": -ext[1].item(), "skipped": skipped}
