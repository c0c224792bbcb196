"""The GRPO objective as small pure functions on tensors (advantages, token log-probs, the clipped loss, metrics),
and `update_policy`, which applies it to one batch in mini-batches × micro-batches.

Per completion token t of rollout i (advantage A_i; every log-prob is taken at the sampling temperature):

    base_it = log μ_it        behaviour log-prob stored at generation   (offpolicy="behaviour", replayed rows)
            = log π_prox,it   policy at the start of the optimizer step (offpolicy="decoupled"; on-policy rows always)
    r_it    = exp(log π_θ,it − base_it)
    pg_it   = max(−A_i·r_it, −A_i·clip(r_it, 1 − eps_low, 1 + eps_high))
    pg_it   = min(pg_it, c·|A_i|)                  if dual_clip = c > 0 and A_i < 0
    w_it    = min(π_prox,it / μ_it, C), detached   offpolicy="decoupled"; w = 1 in "behaviour" mode and on on-policy rows
    L_it    = w_it·pg_it + beta·(exp(d_it) − d_it − 1),  d_it = log π_ref,it − log π_θ,it   (k3 KL estimator)

and the loss aggregates L over the completion tokens (see `policy_loss`).

Where this departs from textbook GRPO (DeepSeekMath: group-std advantages, per-sequence token mean, symmetric
clip against the sampling policy, k3 KL to a reference with beta > 0):
1. Stale data. Replayed rollouts were sampled by an older policy μ, so the ratio is not 1 even on the first
   optimizer step. `behaviour` mode clips the ratio against μ (TRL's multi-iteration GRPO, RePO), which drops
   the gradient of any token whose policy has drifted past the clip; `decoupled` mode clips against π_prox and
   multiplies by the truncated importance weight min(π_prox/μ, C), so the trust region is measured from the
   current policy while staleness is corrected separately (decoupled PPO).
2. On-policy rows (fresh rollouts, and RLEP replays whose log-probs count as current by definition) use
   π_prox as their base and get w = 1 exactly. Their stored μ differs from the training forward by KV-cache
   numerics (~1e-6) and, when top_p < 1, by the nucleus renormalisation, which would otherwise look like staleness.
   With one optimizer step per batch, π_prox = π_θ (the default `prox_logp=None`), so r = 1, the clip is
   inert, and the gradient is the plain policy gradient of −A·log π; the ratio only matters for stale rows.
3. Replayed rows keep that top-p mismatch: π at temperature T is compared with μ after top-p, so with
   top_p < 1 their weights are biased downward even when the weights have not moved.
4. Asymmetric clip (DAPO's clip-higher, 0.2 / 0.28 by default) and an optional dual clip bounding the loss of
   negative-advantage tokens at c·|A|.
5. Loss aggregation is a config key: `grpo` (per-sequence mean), `dapo` (mean over all tokens, the default) or
   `dr_grpo` (token sum over a constant); each normalises by totals over the whole optimizer batch so that
   micro-batch accumulation is exact.
6. KL weight beta defaults to 0 (as DAPO, Dr. GRPO, RLEP); when on, it is added per token, not to the reward.
7. Advantages: `none` (Dr. GRPO) and `batch` scales besides `group` (unbiased std); groups with equal rewards
   get exactly 0 and are counted in the metrics.
8. Entropy is measured, never added as a bonus.
9. Rows of a truncated completion can be left out of the loss (rollout.mask_truncated, DAPO's overlong filtering),
   and rewards can be shaped by length (rewards.overlong_penalty); both are off by default.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch import Tensor


@dataclass
class GRPOConfig:
    adv_scale: str = "group"
    """advantage divisor: `group` std, `batch` std of group-centred rewards, `none` (Dr. GRPO)"""
    adv_eps: float = 1e-6
    """added to the std before dividing"""
    loss_agg: str = "dapo"
    """`grpo` per-sequence token mean, `dapo` mean over all tokens, `dr_grpo` token sum / (n_seqs·max_new_tokens)"""
    eps_low: float = 0.2
    """lower ratio clip 1 − eps_low"""
    eps_high: float = 0.28
    """upper ratio clip 1 + eps_high (DAPO clip-higher; set = eps_low for PPO's symmetric clip)"""
    dual_clip: float = 0.0
    """0 = off; else c > 1 bounds the loss of negative-advantage tokens at c·|A| (verl uses 3, RLEP 10)"""
    offpolicy: str = "behaviour"
    """correction for replayed rows: `behaviour` (clip ratio vs stored μ) or `decoupled` (clip vs π_prox, × min(π_prox/μ, C))"""
    is_cap: float = 2.0
    """C in min(π_prox/μ, C), decoupled mode only"""
    beta: float = 0.0
    """k3 KL weight; the reference model is not even loaded when 0"""

    def check(self) -> list[tuple[bool, str]]:
        return [(self.adv_scale in ("group", "batch", "none"), f"grpo.adv_scale must be group, batch or none, "
                                                               f"got {self.adv_scale!r}"),
                (0 <= self.adv_eps < 1, f"grpo.adv_eps must be in [0, 1), got {self.adv_eps}"),
                (self.loss_agg in ("grpo", "dapo", "dr_grpo"), f"grpo.loss_agg must be grpo, dapo or dr_grpo, "
                                                               f"got {self.loss_agg!r}"),
                (self.offpolicy in ("behaviour", "decoupled"), f"grpo.offpolicy must be behaviour or decoupled, "
                                                               f"got {self.offpolicy!r}"),
                (0 <= self.eps_low < 1 and 0 <= self.eps_high < 100, "grpo.eps_low must be in [0, 1) and "
                                                                     "grpo.eps_high in [0, 100)"),
                (self.dual_clip == 0 or 1 < self.dual_clip < 1e6, f"grpo.dual_clip must be 0 (off) or > 1, "
                                                                  f"got {self.dual_clip}"),
                (1 <= self.is_cap < 1e6, f"grpo.is_cap must be ≥ 1, got {self.is_cap}"),
                (0 <= self.beta < 1e6, f"grpo.beta must be ≥ 0, got {self.beta}")]


def group_advantages(rewards: Tensor, group: Tensor, scale: str = "group", eps: float = 1e-6) -> tuple[Tensor, dict]:
    """A_i = (r_i − mean_g) / (std_g + eps), g the group of row i. Returns advantages (N,) and metrics.

    scale="group": std_g is the unbiased std of group g's rewards (torch.std's default, as in TRL and verl).
    scale="batch": one std for all rows, the unbiased std of the group-centred rewards r_i − mean_g over the batch
                   (of the centred rewards, so that differences in difficulty between prompts do not inflate it).
    scale="none":  A_i = r_i − mean_g (Dr. GRPO: dividing by std_g up-weights prompts that are too easy or too hard).
    A group whose rewards are all equal (a single-row group included) gets A = 0 exactly, despite round-off in its mean.
    Rows of a group need not be adjacent and ids need not be contiguous.
    """
    r = rewards.double()  # (N,)
    _, g = torch.unique(group, return_inverse=True)  # (N,) ids 0..K-1
    K = int(g.max()) + 1

    def per_group(x: Tensor) -> Tensor:  # (N,) -> (K,) sums
        return torch.zeros(K, dtype=r.dtype, device=r.device).index_add(0, g, x)

    n = per_group(torch.ones_like(r))  # (K,)
    centred = r - (per_group(r) / n)[g]  # (N,)
    std_g = (per_group(centred**2) / (n - 1).clamp(min=1)).sqrt()  # (K,)
    hi = torch.full((K,), -torch.inf, dtype=r.dtype, device=r.device).scatter_reduce(0, g, r, "amax")
    lo = torch.full((K,), torch.inf, dtype=r.dtype, device=r.device).scatter_reduce(0, g, r, "amin")
    flat = hi == lo  # (K,) zero reward variance
    if scale == "group":
        adv = centred / (std_g[g] + eps)
    elif scale == "batch":
        adv = centred / ((centred.std() if len(r) > 1 else 0.0) + eps)
    elif scale == "none":
        adv = centred
    else:
        raise ValueError(f"adv_scale must be group | batch | none, got {scale!r}")
    adv = torch.where(flat[g], 0.0, adv)  # also replaces 0/0 when eps = 0
    metrics = {"adv/zero_std_frac": flat.double().mean().item(), "adv/groups": float(K), "adv/abs_mean": adv.abs().mean().item()}
    return adv.to(rewards.dtype), metrics


def token_logprobs(model, tokens: Tensor, attention_mask: Tensor, temperature: float, with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """Log-probs of each token under the model at temperature T, aligned with `tokens`; optionally the entropy.

    With z = logits[:, t−1] / T:  logp[:, t] = z[tokens[:, t]] − logsumexp(z),  logp[:, 0] = 0, and 0 on padding.
    entropy[:, t] = −Σ_v p_v log p_v = logsumexp(z) − Σ_v p_v z_v, p = softmax(z): the distribution that predicted t.
    Gathering one logit and subtracting logsumexp avoids a second (B, L, V) log-softmax tensor. Computed in at least
    float32 (float64 stays float64). Gradients flow when called under grad.
    """
    logits = model(input_ids=tokens, attention_mask=attention_mask).logits  # (B, L, V)
    z = logits[:, :-1].to(torch.promote_types(logits.dtype, torch.float32)) / temperature  # (B, L-1, V)
    lse = torch.logsumexp(z, dim=-1)  # (B, L-1)
    valid = attention_mask[:, 1:].bool()  # (B, L-1)

    def align(x: Tensor) -> Tensor:  # (B, L-1) -> (B, L): shift right by one, zero padding
        return F.pad(torch.where(valid, x, 0.0), (1, 0))

    logp = align(z.gather(-1, tokens[:, 1:, None]).squeeze(-1) - lse)  # (B, L)
    entropy = align(lse - (torch.softmax(z, dim=-1) * z).sum(-1)) if with_entropy else None  # (B, L)
    return logp, entropy


def completion_logprobs(
    model, tokens: Tensor, prompt_len: Tensor, seq_len: Tensor, temperature: float, with_entropy: bool = False, share_prompt: bool = True
) -> tuple[Tensor, Tensor | None]:
    """`token_logprobs` of the completion tokens of rows `prompt | completion | pad` (B, L); 0 elsewhere.

    The G rows of a group share their prompt, so each distinct prompt (all but its last token) is run through the
    model once and its KV cache copied to its rows; the completion pass (the prompt's last token, then the completion)
    attends to that cache at positions continuing the prompt, exactly as one pass over the whole row would, and
    gradients flow back through the copies. Each pass is padded to its own longest part, not the longest row.
    share_prompt=False runs the whole rows instead: gradient checkpointing drops the KV cache, so it needs that.
    """
    B, L = tokens.shape
    comp_len = seq_len - prompt_len  # (B,)
    ar = torch.arange(L, device=tokens.device)
    in_completion = (ar[None] >= prompt_len[:, None]) & (ar[None] < seq_len[:, None])  # (B, L)
    if not share_prompt or int(prompt_len.min()) < 2:
        logp, ent = token_logprobs(model, tokens, (ar[None] < seq_len[:, None]).long(), temperature, with_entropy)
        return torch.where(in_completion, logp, 0.0), (torch.where(in_completion, ent, 0.0) if with_entropy else None)

    n_prefix = prompt_len - 1  # (B,)
    P, C = int(n_prefix.max()), int(comp_len.max())
    prefix = torch.where(ar[None, :P] < n_prefix[:, None], tokens[:, :P], 0)  # (B, P), right-padded
    distinct, row_prefix = torch.unique(torch.cat([n_prefix[:, None], prefix], 1), dim=0, return_inverse=True)  # (n, 1+P), (B,)
    prefix_mask = (ar[None, :P] < distinct[:, :1]).long()  # (n, P)
    cache = model(input_ids=distinct[:, 1:], attention_mask=prefix_mask, use_cache=True, logits_to_keep=1).past_key_values
    if cache is None or cache.get_seq_length() == 0:
        raise RuntimeError("the model returned no KV cache (gradient checkpointing?): call with share_prompt=False")
    cache.batch_select_indices(row_prefix)

    j = ar[None, :C]  # (1, C)
    valid = j < comp_len[:, None]  # (B, C) input j predicts completion token j
    col = (n_prefix[:, None] + j).clamp(max=L - 2)  # (B, C) column of input j; its target sits at col + 1
    out = model(input_ids=tokens.gather(1, col), attention_mask=torch.cat([prefix_mask[row_prefix], valid.long()], 1),
                position_ids=n_prefix[:, None] + j, past_key_values=cache, use_cache=True)
    z = out.logits.to(torch.promote_types(out.logits.dtype, torch.float32)) / temperature  # (B, C, V)
    lse = torch.logsumexp(z, dim=-1)  # (B, C)

    def to_rows(x: Tensor) -> Tensor:  # (B, C) -> (B, L): completion token j back at column prompt_len + j
        return torch.zeros(B, L, dtype=x.dtype, device=x.device).scatter_add(1, col + 1, torch.where(valid, x, 0.0))

    logp = to_rows(z.gather(-1, tokens.gather(1, col + 1)[..., None]).squeeze(-1) - lse)
    entropy = to_rows(lse - (torch.softmax(z, dim=-1) * z).sum(-1)) if with_entropy else None
    return logp, entropy


def policy_loss(
    logp: Tensor,
    behav_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    onpolicy: Tensor,
    cfg: GRPOConfig,
    *,
    n_seqs: int,
    n_tokens: int,
    max_new_tokens: int,
    prox_logp: Tensor | None = None,
    ref_logp: Tensor | None = None,
    entropy: Tensor | None = None,
) -> tuple[Tensor, dict]:
    """Clipped GRPO loss of one micro-batch (per-token objective in the module docstring) and its metrics.

    logp (B, L) current policy, with grad; behav_logp (B, L) stored μ; prox_logp (B, L) π at the start of the step,
    None → logp.detach(), exact when each batch gets one optimizer step (the weights have not moved yet); advantages
    (B,); mask (B, L) completion tokens; onpolicy (B,) rows whose μ is by definition π_prox (base = π_prox, w = 1).
    n_seqs and n_tokens count the WHOLE optimizer batch, so summing this loss over micro-batches gives the full loss:
        grpo:    Σ_i (Σ_t L_it / |o_i|) / n_seqs      dapo: Σ_it L_it / n_tokens      dr_grpo: Σ_it L_it / (n_seqs · max_new_tokens)
    `entropy` (B, L) is only measured.
    """
    m = mask.bool()  # (B, L)

    # Zero every input off the mask first: padding (even NaN) then gives a per-token loss of exactly 0 and
    # a zero gradient, where multiplying by the mask afterwards would still turn 0·NaN into NaN.
    def valid(x: Tensor) -> Tensor:
        return torch.where(m, x, 0.0)

    logp = valid(logp)  # (B, L)
    prox = valid(logp.detach() if prox_logp is None else prox_logp)  # (B, L)
    behav = valid(behav_logp)  # (B, L)
    A = valid(advantages[:, None].to(logp.dtype))  # (B, L)
    fresh = onpolicy.bool()[:, None]  # (B, 1)

    # Replayed data is stale, so unlike nanochat we need the ratio. log_w = log π_prox/μ, exactly 0 on on-policy rows.
    log_w = torch.where(fresh, 0.0, prox - behav)  # (B, L)
    if cfg.offpolicy == "behaviour":
        base, w = torch.where(fresh, prox, behav), torch.ones_like(logp)
    elif cfg.offpolicy == "decoupled":
        base, w = prox, log_w.exp().clamp(max=cfg.is_cap)
    else:
        raise ValueError(f"offpolicy must be behaviour | decoupled, got {cfg.offpolicy!r}")

    log_ratio = logp - base  # (B, L)
    ratio = log_ratio.exp()
    pg1 = -A * ratio
    pg2 = -A * ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high)
    pg = torch.maximum(pg1, pg2)  # (B, L)
    dual = torch.zeros_like(m)
    if cfg.dual_clip > 0:
        dual = (A < 0) & (pg > -A * cfg.dual_clip)
        pg = torch.where(dual, -A * cfg.dual_clip, pg)
    per_tok = w * pg  # (B, L)
    if cfg.beta > 0:
        if ref_logp is None:
            raise ValueError("beta > 0 needs ref_logp")
        d = valid(ref_logp) - logp  # (B, L)
        kl = d.exp() - d - 1
        per_tok = per_tok + cfg.beta * kl

    if cfg.loss_agg == "grpo":
        loss = (per_tok.sum(1) / m.sum(1).clamp(min=1)).sum() / n_seqs
    elif cfg.loss_agg == "dapo":
        loss = per_tok.sum() / n_tokens
    elif cfg.loss_agg == "dr_grpo":
        loss = per_tok.sum() / (n_seqs * max_new_tokens)
    else:
        raise ValueError(f"loss_agg must be grpo | dapo | dr_grpo, got {cfg.loss_agg!r}")

    # Metrics, every one a tensor that adds up over micro-batches and ranks: the loss (already normalised), the token
    # count `tokens`, and token sums (clip fractions, approx_kl, is_weight, entropy, kl_ref: divide by `tokens`
    # once added up); only the importance-weight extremes take a max / min instead. is_weight is π_prox/μ before
    # truncation (1 on on-policy rows), in both modes.
    with torch.no_grad():
        r, raw_w = ratio.detach(), log_w.exp()

        def total(x: Tensor) -> Tensor:
            return valid(x.to(logp.dtype)).sum()

        metrics = {"loss": loss.detach(), "tokens": total(torch.ones_like(r)),
                   "clip_low": total((A < 0) & (r < 1 - cfg.eps_low)), "clip_high": total((A > 0) & (r > 1 + cfg.eps_high)),
                   "clip_dual": total(dual), "approx_kl": total((r - 1) - log_ratio.detach()), "is_weight_mean": total(raw_w),
                   "is_capped": total(raw_w > cfg.is_cap) * (cfg.offpolicy == "decoupled"),
                   "is_weight_max": raw_w[m].max() if m.any() else torch.tensor(-torch.inf),
                   "is_weight_min": raw_w[m].min() if m.any() else torch.tensor(torch.inf)}
        if entropy is not None:
            metrics["entropy"] = total(entropy.detach())
        if cfg.beta > 0:
            metrics["kl_ref"] = total(kl.detach())
    return loss, metrics



# ----------------------------------------------------------------------------------------------------- the update


@contextmanager
def timed(times: dict, name: str):
    """Add the seconds the block takes to times[name]."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        times[name] = times.get(name, 0.0) + time.perf_counter() - t0


def all_ranks(x, op=None):
    """`x` (a number or a float tensor) reduced over the processes, sum by default; `x` itself in one process."""
    if not dist.is_initialized():
        return x
    t = torch.as_tensor(x, dtype=torch.float64).clone()
    dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
    return t if isinstance(x, Tensor) else t.item()


def _rows_logprobs(model, mb, cfg, device, with_entropy=False):
    # Each prompt runs once for its rows (a shared KV cache) unless backward would have to go through that cache:
    # gradient checkpointing drops it, and FSDP frees a layer's gathered weights after its forward.
    share = not cfg.model.gradient_checkpointing and not (torch.is_grad_enabled() and isinstance(model, FSDPModule))
    return completion_logprobs(model, mb.tokens.to(device), mb.prompt_len.to(device), mb.seq_len.to(device),
                               cfg.rollout.temperature, with_entropy, share_prompt=share)


def no_grad_logprobs(model, batch, cfg, compute, device) -> Tensor:
    """(B, L) log-probs of every row of `batch` under `model`, without gradients, optim.logprob_batch_size rows at a
    time. Under FSDP each forward is collective, so a rank with fewer chunks repeats its first one (discarded)."""
    out = torch.zeros(batch.tokens.shape)
    chunks = list(torch.argsort(batch.completion_len).split(cfg.optim.logprob_batch_size))
    for j in range(int(all_ranks(len(chunks), dist.ReduceOp.MAX))):
        rows = chunks[min(j, len(chunks) - 1)]
        with torch.no_grad(), compute:
            lp, _ = _rows_logprobs(model, batch.select(rows), cfg, device)
        if j < len(chunks):
            out[rows, : lp.shape[1]] = lp.float().cpu()
    return out


def update_policy(cfg, model, policy, optimizer, batch, device, compute=nullcontext(), ref=None) -> tuple:
    """`cfg.optim.minibatches` optimizer steps on `batch` (this rank's rows; cfg is config.Config), each
    accumulating micro-batches of optim.micro_batch_size rows. `model` is the HF module (no-grad passes, clipping,
    the weight check), `policy` what the training forward goes through (the model, compiled, or DDP-wrapped).

    Loss normalisers are totals over every rank, so the gradient DDP/FSDP average (hence `loss · world`) is the
    whole batch's. None of the following changes the gradient: rows with A = 0 are not run when beta = 0 (their
    gradient is exactly 0), micro-batches hold rows of similar length, and each prompt is run once for its rows.
    Returns (metrics averaged over the optimizer steps, each row's mean token entropy under the policy (NaN if not
    trained on), why each step was skipped (None when taken), seconds per phase). Raises FloatingPointError when an
    optimizer step leaves non-finite weights.
    """
    times, world = {}, dist.get_world_size() if dist.is_initialized() else 1
    trained = ~batch.truncated if cfg.rollout.mask_truncated else torch.ones(len(batch), dtype=torch.bool)
    prox_all = ref_all = None
    with timed(times, "prox_logprobs"):  # π at the start of the step, for the later mini-batches
        prox_all = no_grad_logprobs(model, batch, cfg, compute, device) if cfg.optim.minibatches > 1 else None
    with timed(times, "ref_logprobs"):
        ref_all = no_grad_logprobs(ref, batch, cfg, compute, device) if ref is not None else None
    order = torch.randperm(len(batch)) if cfg.optim.minibatches > 1 else torch.arange(len(batch))
    steps, reasons, entropy = [], [], torch.full((len(batch),), float("nan"))
    for rows in order.tensor_split(cfg.optim.minibatches):  # every rank takes the same number of steps
        rows = rows[trained[rows]]
        total = all_ranks(torch.tensor([len(rows), float(batch.completion_len[rows].sum()),
                                        float((batch.advantage[rows] != 0).any())]))
        run = rows[batch.advantage[rows] != 0] if cfg.grpo.beta == 0 else rows
        micro = [m for m in run[torch.argsort(batch.completion_len[run], stable=True)].split(cfg.optim.micro_batch_size)
                 if len(m)]
        n_micro = int(all_ranks(max(1, len(micro)), dist.ReduceOp.MAX))  # FSDP: as many forwards on every rank
        optimizer.zero_grad(set_to_none=True)
        sums, hi, lo = {}, torch.tensor(-torch.inf), torch.tensor(torch.inf)
        with timed(times, "forward_backward"):
            for j in range(n_micro):
                real = j < len(micro)  # else a one-row stand-in whose loss is multiplied by 0
                mu = batch.select(micro[j] if real else torch.arange(1))
                cols, mask = mu.tokens.shape[1], mu.completion_mask().to(device)
                sync = policy.no_sync() if hasattr(policy, "no_sync") and j < n_micro - 1 else nullcontext()
                with sync, compute:
                    logp, ent = _rows_logprobs(policy, mu, cfg, device, with_entropy=True)
                    idx = micro[j] if real else torch.arange(1)
                    loss, m = policy_loss(
                        logp, mu.behav_logp.to(device), mu.advantage.to(device), mask, mu.onpolicy.to(device), cfg.grpo,
                        n_seqs=max(1, int(total[0])), n_tokens=max(1, int(total[1])), entropy=ent,
                        max_new_tokens=cfg.rollout.max_new_tokens,
                        prox_logp=None if prox_all is None else prox_all[idx, :cols].to(device),
                        ref_logp=None if ref_all is None else ref_all[idx, :cols].to(device))
                    if total[2] > 0:
                        (loss * (world if real else 0.0)).backward()
                if real:
                    entropy[idx] = ((ent.detach() * mask).sum(1) / mask.sum(1).clamp(min=1)).float().cpu()
                    hi = torch.maximum(hi, m.pop("is_weight_max").cpu())
                    lo = torch.minimum(lo, m.pop("is_weight_min").cpu())
                    sums = {k: sums.get(k, 0.0) + v.detach().double().cpu() for k, v in m.items()}
        with timed(times, "optimizer"):
            keys, ext = sorted(sums), all_ranks(torch.stack([hi, -lo]).double(), dist.ReduceOp.MAX)
            sums = dict(zip(keys, all_ranks(torch.stack([sums[k] for k in keys])).tolist())) if keys else {"loss": 0.0}
            sums = {k: v if k in ("loss", "tokens") else v / max(sums["tokens"], 1) for k, v in sums.items()}
            reason = "zero_adv" if total[2] == 0 else None
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip or math.inf) \
                if reason is None else torch.tensor(0.0)
            grad_norm = float(grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm)
            if reason is None and not (math.isfinite(sums["loss"]) and math.isfinite(grad_norm)):
                reason = "nonfinite"  # a NaN/inf loss or gradient: the weights are left as they are
            if reason is None:
                optimizer.step()
                shards = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
                if all_ranks(float(not all(bool(torch.isfinite(p).all()) for p in shards))):
                    raise FloatingPointError("non-finite weights after the optimizer step")
            optimizer.zero_grad(set_to_none=True)
        steps.append(sums | {"grad_norm": grad_norm, "is_weight_max": ext[0].item(), "is_weight_min": -ext[1].item()})
        reasons.append(reason)
    keys = sorted({k for s in steps for k in s})  # a step with no trained row has only loss and grad_norm
    metrics = {k: sum(s[k] for s in steps if k in s) / sum(k in s for s in steps) for k in keys}
    return metrics | {"tokens": sum(s.get("tokens", 0.0) for s in steps)}, entropy, reasons, times
