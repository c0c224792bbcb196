"""The GRPO objective as small functions on tensors (advantages, token log-probs, the clipped loss and its metrics),
and `update_policy`, which applies it to one batch in mini-batches × micro-batches.

Per completion token t of rollout i (advantage A_i; every log-prob is taken at the sampling temperature):

    base_it = log μ_it        behaviour log-prob stored at generation   (offpolicy="behaviour", replayed rows)
            = log π_prox,it   policy at the start of the optimizer step (offpolicy="decoupled"; on-policy rows always)
    r_it    = exp(log π_θ,it − base_it)
    pg_it   = max(−A_i·r_it, −A_i·clip(r_it, 1 − eps_low, 1 + eps_high))
    pg_it   = min(pg_it, c·|A_i|)                  if dual_clip = c > 0 and A_i < 0
    w_it    = min(π_prox,it / μ_it, C), detached   offpolicy="decoupled"; w = 1 otherwise and on on-policy rows
    L_it    = w_it·pg_it + beta·(exp(d_it) − d_it − 1),  d_it = log π_ref,it − log π_θ,it   (k3 KL estimator)

and the loss aggregates L over the completion tokens (see `policy_loss`).

Where this departs from textbook GRPO (DeepSeekMath: group-std advantages, per-sequence token mean, symmetric
clip against the sampling policy, k3 KL to a reference with beta > 0):
1. Stale data. Replayed rollouts were sampled by an older policy μ, so the ratio is not 1 even on the first
   optimizer step. `behaviour` mode clips the ratio against μ (TRL's multi-iteration GRPO, RePO), which drops the
   gradient of any token whose policy has drifted past the clip; `decoupled` mode clips against π_prox and
   multiplies by the truncated importance weight min(π_prox/μ, C), so the trust region is measured from the current
   policy while staleness is corrected separately (decoupled PPO); `shaped` gives replayed tokens −A·r/(r + 0.1),
   r against μ and unclipped (ExGRPO's released loss).
2. On-policy rows (fresh rollouts, and RLEP replays whose log-probs count as current by definition) use π_prox as
   their base and get w = 1 exactly. Their stored μ differs from the training forward by KV-cache numerics (~1e-6)
   and, when top_p < 1, by the nucleus renormalisation, which would otherwise look like staleness. With one
   optimizer step per batch π_prox = π_θ (the default `prox_logp=None`), so r = 1, the clip is inert and the
   gradient is the plain policy gradient of −A·log π: unlike nanochat we need the ratio, but only for stale rows.
3. Replayed rows keep that top-p mismatch: π at temperature T is compared with μ after top-p, so with top_p < 1
   their weights are biased downward even when the weights have not moved.
4. Asymmetric clip (DAPO's clip-higher, 0.2 / 0.28 by default) and an optional dual clip bounding the loss of
   negative-advantage tokens at c·|A|.
5. Loss aggregation is a config key: `grpo` (per-sequence mean), `dapo` (mean over all tokens, the default) or
   `dr_grpo` (token sum over a constant); each normalises by totals over the whole optimizer batch (every
   micro-batch and every rank), so accumulation is exact.
6. KL weight beta defaults to 0 (as DAPO, Dr. GRPO, RLEP); when on, it is added per token, not to the reward.
7. Advantages: `none` (Dr. GRPO) and `batch` scales besides `group` (unbiased std); groups with equal rewards get
   exactly 0 and are counted in the metrics.
8. Entropy is measured, never added as a bonus (and never differentiated).
9. Truncated rows can be left out of the loss (rollout.mask_truncated, DAPO's overlong filtering), and rewards can
   be shaped by length (rewards.overlong_penalty); both are off by default.
10. Reuse inside a step (optim.epochs = E, GRPO's μ iterations, TRL's num_iterations, verl's
   ppo_epochs; E = 1 by default; E, not μ, here, as μ is the behaviour policy): E passes over the
   update batch, each reshuffled into optim.minibatches. π_prox is π_old, taken once at the start
   of the step (a no-grad pass), so on-policy rows clip against the policy that sampled them in
   every pass; before the first optimizer step it is the training forward itself, so their ratio
   is exactly 1. Replayed rows keep their mode's terms and are now used E times per step on top of
   their replays: `behaviour` clips them against the stored μ in every pass (a row outside the
   clip gives no gradient in any pass); `decoupled` clips them against π_old, with min(π_old/μ, C)
   fixed for the step; `shaped` bounds nothing, so its unclipped term is applied E times. (With
   E = 1 and several mini-batches the first one keeps the no-grad π_prox, as before, so E = 1
   reproduces earlier runs bit for bit.)
11. Gradient gating (optim.gate, off by default; DGG, arXiv 2605.19425): in passes 2..E, an
   optimizer step whose output-layer (lm_head) gradient norm exceeds gate × that of the step's
   first optimizer step is dropped before AdamW sees it, and the step's remaining passes are not
   run (`OutputGrad` says how the norm is measured, `Gate` why that reference).
12. Fresh rows sampled by an inference engine (rollout.engine = vllm) are not exactly on-policy:
   its kernels differ from the training forward's. With grpo.engine_is_cap = C > 0 their tokens get
   the truncated importance weight w_it = min(π_prox,it / μ_it, C), detached (TRL's vLLM
   importance-sampling correction; off by default: the mismatch measured on a CPU is ~5e-5 nats at
   most, rollout/logp_gap_max). With top_p < 1 the weight also carries departure 3's top-p bias.
13. Sampler and trainer log-probs of the same tokens at the same weights still differ. Both run
   the output layer and the log-softmax in float32 (bf16 logits were rounded by up to 1/16 nat at
   |z| ~ 10), the trainer in chunks of the sequence (`_ChunkedHead`). What remains is upstream of
   the output layer: the sampler attends one token at a time to a KV cache, the trainer runs whole
   rows, so sums are ordered differently: ~1e-6 in float32, but with bf16 compute every layer rounds
   them to bf16 (CPU autocast, a Qwen2.5-0.5B-shaped 2-layer model at the real vocabulary: mean
   0.004, p99 0.03, max 0.05 nats; 0.005 / 0.06 / 0.11 with the bf16 output layer). Logged every
   step as rollout/logp_gap_mean and _max over fresh tokens (`logp_gap`). On-policy rows never see
   it (item 2); replayed rows' ratios and weights carry it.
"""

from __future__ import annotations

import math
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from types import MethodType

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from util import MAX, all_ranks, timed


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
    """replayed rows: `behaviour` (clip vs stored μ), `decoupled` (clip vs π_prox, × min(π_prox/μ, C)), `shaped`"""
    is_cap: float = 2.0
    """C in min(π_prox/μ, C), decoupled mode only"""
    beta: float = 0.0
    """k3 KL weight; the reference model is not even loaded when 0"""
    engine_is_cap: float = 0.0
    """fresh rows of rollout.engine=vllm: × min(π_prox/μ, C), C this (0 = off; departure 12)"""

    def check(self) -> dict[str, tuple[bool, str]]:
        return {"adv_scale": (self.adv_scale in ("group", "batch", "none"), "group, batch or none"),
                "adv_eps": (0 <= self.adv_eps < 1, "in [0, 1)"),
                "loss_agg": (self.loss_agg in ("grpo", "dapo", "dr_grpo"), "grpo, dapo or dr_grpo"),
                "offpolicy": (self.offpolicy in ("behaviour", "decoupled", "shaped"), "behaviour, decoupled or shaped"),
                "eps_low": (0 <= self.eps_low < 1, "in [0, 1)"), "eps_high": (0 <= self.eps_high < 100, "in [0, 100)"),
                "dual_clip": (self.dual_clip == 0 or 1 < self.dual_clip < 1e6, "0 (off) or > 1"),
                "is_cap": (1 <= self.is_cap < 1e6, "≥ 1"), "beta": (0 <= self.beta < 1e6, "≥ 0"),
                "engine_is_cap": (self.engine_is_cap == 0 or 1 <= self.engine_is_cap < 1e6,
                                  "0 (off) or ≥ 1")}


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


def group_advantages(rewards: Tensor, group: Tensor, scale: str = "group", eps: float = 1e-6) -> tuple[Tensor, dict]:
    """A_i = (r_i − mean_g) / (std_g + eps), g the group of row i. Returns advantages (N,) and metrics.

    scale="group": std_g is the unbiased std of group g's rewards (torch.std's default, as in TRL and verl).
    scale="batch": one std for all rows, the unbiased std of the group-centred rewards r_i − mean_g over the batch
                   (of the centred rewards, so that differences in difficulty between prompts do not inflate it).
    scale="none":  A_i = r_i − mean_g (Dr. GRPO: dividing by std_g up-weights prompts that are too easy or too hard).
    A group whose rewards are all equal (a single-row group included) gets A = 0 exactly, despite round-off in its mean.
    """
    s = group_stats(rewards, group)
    centred = rewards.double() - s.mean[s.index]  # (N,)
    std = {"group": s.std[s.index],
           "batch": centred.std() if len(centred) > 1 else torch.tensor(0.0, dtype=centred.dtype), "none": None}
    if scale not in std:
        raise ValueError(f"adv_scale must be group | batch | none, got {scale!r}")
    adv = centred if std[scale] is None else centred / (std[scale] + eps)
    adv = torch.where(s.flat[s.index], 0.0, adv)  # also replaces 0/0 when eps = 0
    metrics = {"adv/zero_std_frac": s.flat.double().mean().item(), "adv/groups": float(len(s.ids)),
               "adv/abs_mean": adv.abs().mean().item()}
    return adv.to(rewards.dtype), metrics


def flat_groups(rewards: Tensor, group: Tensor) -> Tensor:
    """(N,) rows whose group's rewards are all equal: zero advantage, nothing to learn from (a single row included)."""
    s = group_stats(rewards, group)
    return s.flat[s.index]


HEAD_CHUNK = 2**25
"""Logits per chunk of the output layer (128 MiB in float32): no (tokens, V) tensor is whole."""


def hf_module(model):
    """The HF model inside DDP and torch.compile wrappers (an FSDP2 model is its own class)."""
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):  # torch.compile's OptimizedModule
            model = model._orig_mod
        elif hasattr(model, "get_base_model"):  # peft's LoRA wrapper
            model = model.get_base_model()
        elif not isinstance(model, torch.nn.Module):  # a plain wrapper (lora.AdaptersOff)
            model = model.model
        else:
            return model


def output_layer(model):
    """The model's output layer, its forward replaced (once) by `_head_forward`: float32 logits, or
    chunked log-probs while `_asking` holds a request. Generation and the log-prob passes call
    it."""
    m = hf_module(model)
    for key in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        if getattr(getattr(m, "config", None), key, None) not in (None, 1.0):
            raise ValueError(f"the model's config sets {key}: logits changed after the output "
                             "layer are not supported by the chunked log-probs")
    head = m.get_output_embeddings() if hasattr(m, "get_output_embeddings") else None
    if not isinstance(getattr(head, "weight", None), Tensor):
        raise TypeError(f"{type(m).__name__} has no output layer (get_output_embeddings)")
    if "forward" not in head.__dict__:
        head.forward = MethodType(_head_forward, head)
    return head


@contextmanager
def _asking(model, targets: Tensor, valid: Tensor, temperature: float, with_entropy: bool):
    """While inside, the output layer returns (B, C, 2): the log-prob of `targets` (B, C) and the
    entropy at each of the first C positions, 0 where not `valid`. The request waits on the layer,
    so the forward that runs is the wrapper's: DDP's gradient sync, FSDP's unsharding of the root's
    weights (embeddings, final norm, output layer), the compiled graph."""
    head = output_layer(model)
    head._logprob_request = (targets, valid, temperature, with_entropy)
    try:
        yield
    finally:
        head._logprob_request = None


@torch.compiler.disable  # a compiled policy breaks its graph here: the chunks run eagerly
def _head_forward(head, hidden: Tensor) -> Tensor:
    """The output layer's forward on hidden states (B, C', H): float32 logits (B, C', V) without a
    request (generation, the prompt pass), else `_asking`'s (B, C, 2) from the valid positions."""
    request = head.__dict__.get("_logprob_request")
    w, b = head.weight, getattr(head, "bias", None)
    if request is None:
        with torch.autocast(hidden.device.type, enabled=False):
            dtype = torch.promote_types(hidden.dtype, torch.float32)
            return F.linear(hidden.to(dtype), *_upcast(w, b, dtype))
    targets, valid, temperature, with_entropy = request  # (B, C), (B, C)
    listener = head.__dict__.get("_weight_grad_listener")  # `OutputGrad`'s
    h = hidden[:, : targets.shape[1]][valid]  # (N, H): padding never reaches the output layer
    logp, ent = _ChunkedHead.apply(h, w, b, targets[valid], temperature, with_entropy, listener)
    out = torch.zeros(*targets.shape, 2, dtype=logp.dtype, device=logp.device)  # (B, C, 2)
    return out.index_put((valid,), torch.stack([logp, ent], -1))


class _ChunkedHead(torch.autograd.Function):
    """logp (N,) of `targets` under softmax((hidden·Wᵀ + b) / T) and its entropy (N,), HEAD_CHUNK
    logits at a time in at least float32 (autocast off, bf16 weights upcast). Backward recomputes
    each chunk's logits: one (rows, V) chunk is alive at a time (≈ 1 byte per logit, not ~20).
    `listener`, when given, receives the weight's gradient from this layer alone (even frozen)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, with_entropy, listener=None):
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        n = max(1, HEAD_CHUNK // weight.shape[0])  # rows per chunk
        lse = torch.zeros(len(hidden), dtype=dtype, device=hidden.device)  # (N,)
        logp, ent = torch.zeros_like(lse), torch.zeros_like(lse)  # (N,)
        with torch.autocast(hidden.device.type, enabled=False):
            w, b = _upcast(weight, bias, dtype)
            for s in range(0, len(hidden), n):
                rows = slice(s, s + n)
                z = F.linear(hidden[rows].to(dtype), w, b).div_(temperature)  # (n, V)
                lse[rows] = torch.logsumexp(z, dim=-1)
                logp[rows] = z.gather(1, targets[rows, None]).squeeze(1) - lse[rows]
                if with_entropy:  # H = lse − Σ p·z, the sum a batched dot: no third (n, V)
                    p = (z - lse[rows, None]).exp_()  # (n, V)
                    ent[rows] = lse[rows] - (p[:, None] @ z[:, :, None]).view(-1)
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.temperature, ctx.listener = temperature, listener
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, _):  # entropy is never differentiated
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        n, T = max(1, HEAD_CHUNK // weight.shape[0]), ctx.temperature
        g = grad_logp.to(lse.dtype) / T  # (N,) d loss / d z_target, z = logits / T
        with torch.autocast(hidden.device.type, enabled=False):
            w, b = _upcast(weight, bias, lse.dtype)
            gh = torch.empty(hidden.shape, dtype=w.dtype, device=w.device)  # (N, H)
            want_gw = ctx.needs_input_grad[1] or ctx.listener is not None
            gw = torch.zeros_like(w) if want_gw else None  # (V, H)
            gb = None if b is None else torch.zeros_like(b)  # (V,)
            for s in range(0, len(hidden), n):
                rows = slice(s, s + n)
                x = hidden[rows].to(w.dtype)  # (n, H)
                dz = F.linear(x, w, b).div_(T).sub_(lse[rows, None]).exp_()  # (n, V) softmax p
                dz.mul_(-g[rows, None])  # d logp / d logits = (onehot − p) / T, times g
                dz.scatter_add_(1, targets[rows, None], g[rows, None])
                gh[rows] = dz @ w
                if gw is not None:
                    gw.addmm_(dz.T, x)
                if gb is not None:
                    gb += dz.sum(0)
        if ctx.listener is not None:
            ctx.listener(gw)
        gw = gw.to(weight.dtype) if ctx.needs_input_grad[1] else None
        gb = gb.to(bias.dtype) if gb is not None and ctx.needs_input_grad[2] else None
        return gh.to(hidden.dtype), gw, gb, None, None, None, None


def _upcast(weight: Tensor, bias: Tensor | None, dtype: torch.dtype) -> tuple:
    return weight.to(dtype), None if bias is None else bias.to(dtype)


def _row_logprobs(model, tokens, attention_mask, valid, temperature, with_entropy):
    """(B, L) log-probs (and entropies) of whole rows, 0 where `valid` (B, L−1) is False."""
    with _asking(model, tokens[:, 1:], valid, temperature, with_entropy):
        out = model(input_ids=tokens, attention_mask=attention_mask).logits  # (B, L−1, 2)
    logp = F.pad(out[..., 0], (1, 0))  # (B, L): shifted right, position t−1 predicts token t
    ent = F.pad(out[..., 1].detach(), (1, 0))
    return logp, ent if with_entropy else None


def token_logprobs(model, tokens: Tensor, attention_mask: Tensor, temperature: float,
                   with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """Log-probs of each token under the model at temperature T, aligned with `tokens`; optionally
    the entropy.

    With z = logits[:, t−1] / T:  logp[:, t] = z[tokens[:, t]] − logsumexp(z),  logp[:, 0] = 0, and
    0 on padding. entropy[:, t] = logsumexp(z) − Σ_v p_v z_v, p = softmax(z): of the distribution
    that predicted t (no gradient). The output layer and the log-softmax run in chunks in at least
    float32 (`_ChunkedHead`), whatever the compute dtype: no (B, L, V) tensor exists. Gradients flow
    to logp when called under grad.
    """
    valid = attention_mask[:, 1:].bool()  # (B, L−1)
    return _row_logprobs(model, tokens, attention_mask, valid, temperature, with_entropy)


def completion_logprobs(model, tokens: Tensor, prompt_len: Tensor, seq_len: Tensor, temperature: float,
                        with_entropy: bool = False, share_prompt: bool = True) -> tuple[Tensor, Tensor | None]:
    """`token_logprobs` of the completion tokens of rows `prompt | completion | pad` (B, L); 0 elsewhere.

    The G rows of a group share their prompt, so each distinct prompt (all but its last token) is run through the
    model once and its KV cache copied to its rows; the completion pass (the prompt's last token, then the
    completion) attends to that cache at positions continuing the prompt, exactly as one pass over the whole row
    would, and gradients flow back through the copies. Each pass is padded to its own longest part.
    share_prompt=False runs whole rows: gradient checkpointing drops the KV cache, and FSDP frees a layer's gathered
    weights after its forward, while backward through the cache needs them.
    """
    B, L = tokens.shape
    ar = torch.arange(L, device=tokens.device)
    in_completion = (ar[None] >= prompt_len[:, None]) & (ar[None] < seq_len[:, None])  # (B, L)
    if not share_prompt or int(prompt_len.min()) < 2:
        am = (ar[None] < seq_len[:, None]).long()  # (B, L)
        return _row_logprobs(model, tokens, am, in_completion[:, 1:], temperature, with_entropy)

    n_prefix, comp_len = prompt_len - 1, seq_len - prompt_len  # (B,)
    P, C = int(n_prefix.max()), int(comp_len.max())
    prefix = torch.where(ar[None, :P] < n_prefix[:, None], tokens[:, :P], 0)  # (B, P), right-padded
    distinct, row_prefix = torch.unique(torch.cat([n_prefix[:, None], prefix], 1), dim=0, return_inverse=True)
    prefix_mask = (ar[None, :P] < distinct[:, :1]).long()  # (n, P)
    cache = model(input_ids=distinct[:, 1:], attention_mask=prefix_mask, use_cache=True,
                  logits_to_keep=1).past_key_values
    if cache is None or cache.get_seq_length() == 0:
        raise RuntimeError("the model returned no KV cache (gradient checkpointing?): call with share_prompt=False")
    cache.batch_select_indices(row_prefix)
    j = ar[None, :C]  # (1, C)
    valid = j < comp_len[:, None]  # (B, C) input j predicts completion token j
    col = (n_prefix[:, None] + j).clamp(max=L - 2)  # (B, C) column of input j; its target sits at col + 1
    mask = torch.cat([prefix_mask[row_prefix], valid.long()], 1)  # (B, P + C)
    with _asking(model, tokens.gather(1, col + 1), valid, temperature, with_entropy):
        out = model(input_ids=tokens.gather(1, col), attention_mask=mask, past_key_values=cache,
                    position_ids=n_prefix[:, None] + j, use_cache=True).logits  # (B, C, 2)

    def to_rows(x: Tensor) -> Tensor:  # (B, C) -> (B, L): completion token j back at column prompt_len + j
        return torch.zeros(B, L, dtype=x.dtype, device=x.device).scatter_add(1, col + 1, x)

    return to_rows(out[..., 0]), to_rows(out[..., 1].detach()) if with_entropy else None


def policy_loss(logp: Tensor, behav_logp: Tensor, advantages: Tensor, mask: Tensor, onpolicy: Tensor,
                cfg: GRPOConfig, *, n_seqs: int, n_tokens: int, max_new_tokens: int, prox_logp: Tensor | None = None,
                ref_logp: Tensor | None = None, entropy: Tensor | None = None,
                engine_rows: Tensor | None = None) -> tuple[Tensor, dict]:
    """Clipped GRPO loss of one micro-batch (per-token objective in the module docstring) and its metrics.

    logp (B, L) current policy, with grad; behav_logp (B, L) stored μ; prox_logp (B, L) π at the start of the step,
    None → logp.detach(), exact when each batch gets one optimizer step (the weights have not moved yet); advantages
    (B,); mask (B, L) completion tokens; onpolicy (B,) rows whose μ is by definition π_prox
    (base = π_prox, w = 1); engine_rows (B,) fresh rows an inference engine sampled
    (× min(π_prox/μ, engine_is_cap) when that is on).
    n_seqs and n_tokens count the WHOLE optimizer batch, so summing this loss over micro-batches gives the full loss:
        grpo: Σ_i (Σ_t L_it / |o_i|) / n_seqs    dapo: Σ_it L_it / n_tokens
        dr_grpo: Σ_it L_it / (n_seqs · max_new_tokens)
    Metrics, all tensors that add up over micro-batches and ranks: the loss, the token count `tokens`, and token sums
    (clip fractions, approx_kl, is_weight_mean, entropy, kl_ref: divide by `tokens` once added); only is_weight_max
    and is_weight_min take a max / min. is_weight is π_prox/μ before truncation (1 on on-policy rows).
    """
    m = mask.bool()  # (B, L)

    def valid(x: Tensor) -> Tensor:  # zero every input off the mask first: padding (even NaN) gives loss and grad 0
        return torch.where(m, x, 0.0)

    logp, behav = valid(logp), valid(behav_logp)  # (B, L)
    prox = valid(logp.detach() if prox_logp is None else prox_logp)  # (B, L)
    A, fresh = valid(advantages[:, None].to(logp.dtype)), onpolicy.bool()[:, None]  # (B, L), (B, 1)
    log_w = torch.where(fresh, 0.0, prox - behav)  # (B, L) log π_prox/μ, exactly 0 on on-policy rows
    decoupled = cfg.offpolicy == "decoupled"
    base, w = (prox, log_w.exp().clamp(max=cfg.is_cap)) if decoupled else (torch.where(fresh, prox, behav), 1.0)
    log_ratio = logp - base
    ratio = log_ratio.exp()  # (B, L)
    pg = torch.maximum(-A * ratio, -A * ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high))  # (B, L)
    dual = (A < 0) & (pg > -A * cfg.dual_clip) if cfg.dual_clip > 0 else torch.zeros_like(m)
    pg = torch.where(dual, -A * cfg.dual_clip, pg)
    if cfg.offpolicy == "shaped":  # ExGRPO: replayed tokens get −A·r/(r + 0.1), r against μ, no clip
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
    loss = {"grpo": lambda: (per_tok.sum(1) / m.sum(1).clamp(min=1)).sum() / n_seqs,
            "dapo": lambda: per_tok.sum() / n_tokens, "dr_grpo": lambda: per_tok.sum() / (n_seqs * max_new_tokens)}
    loss = loss[cfg.loss_agg]()
    with torch.no_grad():
        r, raw_w = ratio.detach(), log_w.exp()

        def total(x: Tensor) -> Tensor:
            return valid(x.to(logp.dtype)).sum()

        metrics = {"loss": loss.detach(), "tokens": total(torch.ones_like(r)), "clip_dual": total(dual),
                   "clip_low": total((A < 0) & (r < 1 - cfg.eps_low)),
                   "clip_high": total((A > 0) & (r > 1 + cfg.eps_high)),
                   "approx_kl": total((r - 1) - log_ratio.detach()), "is_weight_mean": total(raw_w),
                   "is_capped": total(raw_w > cfg.is_cap) * decoupled,
                   "is_weight_max": raw_w[m].max() if m.any() else torch.tensor(-math.inf),
                   "is_weight_min": raw_w[m].min() if m.any() else torch.tensor(math.inf)}
        metrics |= {"entropy": total(entropy)} if entropy is not None else {}
        metrics |= {"kl_ref": total(kl.detach())} if cfg.beta > 0 else {}
        if engine_w is not None:
            metrics["engine_is_weight_mean"] = total(engine_w)
    return loss, metrics


def _engine_weight(prox: Tensor, behav: Tensor, rows: Tensor | None, cap: float) -> Tensor | None:
    """(B, L) min(π_prox/μ, cap) on `rows` (B,), 1 elsewhere, detached; None when off."""
    if rows is None or cap <= 0:
        return None
    w = (prox.detach() - behav).exp().clamp(max=cap)  # (B, L)
    return torch.where(rows.bool()[:, None], w, 1.0)


# ----------------------------------------------------------------------------------------------------- the update


def _logprobs(model, mb, cfg, device, with_entropy=False):
    # FSDP: asked of the module, not of a parameter (an unsharded root holds plain tensors)
    sharded = isinstance(hf_module(model), FSDPModule)
    share = not cfg.model.gradient_checkpointing and not (torch.is_grad_enabled() and sharded)
    return completion_logprobs(model, mb.tokens.to(device), mb.prompt_len.to(device), mb.seq_len.to(device),
                               cfg.rollout.temperature, with_entropy, share_prompt=share)


def no_grad_logprobs(model, batch, cfg, compute, device, with_entropy=False) -> tuple[Tensor, Tensor]:
    """(B, L) log-probs (and entropies) of `batch`'s rows under `model`, without gradients, optim.logprob_batch_size
    rows at a time. Under FSDP each forward is collective, so a rank with fewer chunks repeats a chunk (discarded)."""
    logp, ent = torch.zeros(batch.tokens.shape), torch.zeros(batch.tokens.shape)
    chunks = list(torch.argsort(batch.completion_len).split(cfg.optim.logprob_batch_size))
    for j in range(int(all_ranks(len(chunks), MAX))):
        rows = chunks[min(j, len(chunks) - 1)]
        with torch.no_grad(), compute:
            lp, e = _logprobs(model, batch.select(rows), cfg, device, with_entropy)
        if j < len(chunks):
            logp[rows, : lp.shape[1]] = lp.float().cpu()
            ent[rows, : lp.shape[1]] = e.float().cpu() if with_entropy else 0.0
    return logp, ent


def micro_batches(rows: Tensor, completion_len: Tensor, seq_len: Tensor, o) -> list[Tensor]:
    """`rows` (indices) sorted by completion length and cut into micro-batches (o is
    config.OptimConfig): of o.micro_batch_size rows, or, when o.micro_batch_tokens > 0, each as many
    rows as fit in that many padded tokens (rows × the longest row; a row longer than the budget
    goes alone). Which rows share a micro-batch never changes the loss (its normalisers are batch
    totals): only memory and the number of passes."""
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


def minibatch_plan(n: int, o) -> list[tuple[int, Tensor]]:
    """(pass, rows) of every optimizer step of an update over n rows: o.epochs passes, each a
    shuffle of the rows split into o.minibatches. The shuffles come from torch's global RNG (saved
    in checkpoints), all drawn before the first step, so that the stream after the update does not
    depend on where a gate stopped it. With one mini-batch nothing is drawn (the order of the rows
    inside it changes nothing), as before optim.epochs existed."""
    plan = []
    for epoch in range(o.epochs):
        order = torch.randperm(n) if o.minibatches > 1 else torch.arange(n)
        for rows in order.tensor_split(o.minibatches):
            plan.append((epoch, rows))
    return plan


class OutputGrad:
    """The gradient of the loss with respect to the output projection's weight (lm_head), summed
    over the micro-batches of an optimizer step: `_ChunkedHead.backward` hands this layer's share
    to `_add` (also when the layer is frozen).

    Not read off the weight's .grad: with tied embeddings (the tiny model, Qwen2.5-0.5B/1.5B) that
    .grad also holds the input embedding's share (the rows of the tokens read); a frozen lm_head
    (LoRA) has no .grad; under FSDP the .grad is a DTensor shard. The hook changes no gradient.
    Passes without grad (no-grad log-probs, generation) never reach backward and add nothing.
    Cost: one (V, d) addition per micro-batch, one (V, d) all-reduce per optimizer step.
    """

    def __init__(self, model):
        self.head = output_layer(model)
        self.shape = tuple(self.head.weight.shape)  # (V, d); DTensor: the global shape
        self.device = self.head.weight.device
        self.acc = None
        self.head._weight_grad_listener = self._add

    def _add(self, g: Tensor) -> None:  # (V, d), this forward's output-layer share
        if self.acc is None:  # a copy: g itself may become the weight's .grad and grow in place
            self.acc = g.float().clone()
        else:
            self.acc = self.acc + g.float()

    def pop_norm(self) -> float:
        """‖G^T·H‖ of the gradient DDP/FSDP apply (the ranks' sum ÷ world, as each rank's loss is
        × world), then start again from zero."""
        acc = self.acc if self.acc is not None else torch.zeros(self.shape, device=self.device)
        self.acc = None
        if not dist.is_initialized():
            return float(acc.norm())
        dist.all_reduce(acc)
        return float(acc.norm()) / dist.get_world_size()

    def close(self) -> None:
        self.head._weight_grad_listener = None


class Gate:
    """optim.gate (DGG, arXiv 2605.19425): the lm_head gradient norm of every optimizer step of an
    update, and the decision to drop a step of a reuse pass (2..E) whose norm exceeds gate × the
    reference: the norm of the step's first optimizer step with a gradient, the single-use
    gradient of this very batch.

    Why that reference: it needs no state across steps (nothing to checkpoint, so resume stays
    exact), and it normalises away what changes from step to step (batch size, advantage scale,
    how many groups are flat), so the ratio isolates what reuse adds. The paper's own rule is not
    in its abstract, and we could not read its text; secondary summaries describe a Z-score of the
    lm_head gradient energy and its increment over a sliding window, active from the second use of
    a batch on, with at most 4 uses and a threshold of 0.1-0.5. Every rank takes the same decision
    (a MAX all-reduce).
    """

    def __init__(self, model, o):
        self.head, self.gate, self.ref = OutputGrad(model), o.gate, 0.0

    def check(self, epoch: int) -> dict:
        norm = self.head.pop_norm()
        if epoch == 0 and self.ref == 0:
            self.ref = norm
        out = {"optim/lm_head_grad_norm": norm}
        if epoch == 0:
            return out
        no_ref = math.inf if norm > 0 else 0.0  # the first pass had no gradient at all
        out["optim/lm_head_grad_ratio_max"] = norm / self.ref if self.ref > 0 else no_ref
        crossed = self.gate > 0 and norm > self.gate * self.ref
        agreed = all_ranks(float(crossed), MAX)
        return out | {"gated": agreed > 0}

    def close(self) -> None:
        self.head.close()


def update_policy(cfg, model, policy, optimizer, batch, device, compute=None, ref=None) -> tuple:
    """optim.epochs passes over `batch` (this rank's rows; cfg is config.Config), each of
    optim.minibatches optimizer steps accumulating micro-batches of optim.micro_batch_size rows
    (`minibatch_plan`); with several passes a `Gate` measures the lm_head gradient of every step
    and may stop the update. `model` is the HF module (no-grad passes, clipping, the weight check),
    `policy` what the training forward goes through (the model, compiled, or DDP-wrapped).

    Loss normalisers are totals over every rank, so the gradient DDP/FSDP average (hence `loss · world`) is the
    whole batch's. None of the following changes the gradient: rows with A = 0 are not run when beta = 0 (their
    gradient is exactly 0), micro-batches hold rows of similar length, and each prompt is run once for its rows.
    Under FSDP every rank runs as many forward/backward passes (a short rank adds one-row passes of weight 0).
    Returns (metrics averaged over the optimizer steps, each row's mean token entropy under the
    policy in its last pass (NaN if not trained on), why each step was skipped (None when taken),
    seconds per phase). Raises FloatingPointError when an optimizer step leaves non-finite weights.
    """
    gate = Gate(model, cfg.optim) if cfg.optim.epochs > 1 else None
    try:
        return _update(cfg, model, policy, optimizer, batch, device, compute, ref, gate)
    finally:
        if gate is not None:
            gate.close()  # the hooks go with the update


def _update(cfg, model, policy, optimizer, batch, device, compute, ref, gate) -> tuple:
    times, world = {}, dist.get_world_size() if dist.is_initialized() else 1
    compute = compute or nullcontext()  # the bf16 autocast, or nothing
    trained = ~batch.truncated if cfg.rollout.mask_truncated else torch.ones(len(batch), dtype=torch.bool)
    with timed(times, "prox_logprobs"):  # π_old at the start of the step, for the later steps
        reuse = cfg.optim.minibatches > 1 or cfg.optim.epochs > 1
        prox = no_grad_logprobs(model, batch, cfg, compute, device)[0] if reuse else None
    with timed(times, "ref_logprobs"):
        ref_lp = no_grad_logprobs(ref, batch, cfg, compute, device)[0] if ref is not None else None
    fresh = batch.completion_mask() & ~batch.replayed[:, None]  # (B, L) sampled for this step
    gaps = [logp_gap(prox, batch.behav_logp, fresh)] if prox is not None else []
    steps, reasons, entropy = [], [], torch.full((len(batch),), math.nan)
    for epoch, rows in minibatch_plan(len(batch), cfg.optim):  # the same steps on every rank
        rows = rows[trained[rows]]
        # Before the first optimizer step the training forward is π_old itself (ratio exactly 1).
        old = None if cfg.optim.epochs > 1 and not steps else prox
        total = all_ranks(torch.tensor([len(rows), float(batch.completion_len[rows].sum()),
                                        float((batch.advantage[rows] != 0).any())]))
        run = rows[batch.advantage[rows] != 0] if cfg.grpo.beta == 0 else rows
        micro = micro_batches(run, batch.completion_len, batch.seq_len, cfg.optim)
        n_micro = int(all_ranks(max(1, len(micro)), MAX))
        optimizer.zero_grad(set_to_none=True)
        sums, hi, lo = {}, torch.tensor(-math.inf), torch.tensor(math.inf)
        with timed(times, "forward_backward"):
            for j in range(n_micro):
                idx = micro[j] if j < len(micro) else torch.arange(1)  # a stand-in whose loss is multiplied by 0
                mu = batch.select(idx)
                mask, cols = mu.completion_mask().to(device), mu.tokens.shape[1]
                sync = policy.no_sync() if hasattr(policy, "no_sync") and j < n_micro - 1 else nullcontext()
                with sync, compute:
                    logp, ent = _logprobs(policy, mu, cfg, device, with_entropy=True)
                    loss, m = policy_loss(
                        logp, mu.behav_logp.to(device), mu.advantage.to(device), mask, mu.onpolicy.to(device), cfg.grpo,
                        n_seqs=max(1, int(total[0])), n_tokens=max(1, int(total[1])), entropy=ent,
                        max_new_tokens=cfg.rollout.max_new_tokens,
                        engine_rows=engine_rows(cfg, mu, device),
                        prox_logp=None if old is None else old[idx, :cols].to(device),
                        ref_logp=None if ref_lp is None else ref_lp[idx, :cols].to(device))
                    if total[2] > 0:
                        (loss * (world if j < len(micro) else 0.0)).backward()
                if j < len(micro):
                    entropy[idx] = ((ent * mask).sum(1) / mask.sum(1).clamp(min=1)).float().cpu()
                    if prox is None:  # one optimizer step: this forward is at the sampling weights
                        gaps.append(logp_gap(logp, mu.behav_logp, fresh[idx, :cols]))
                    hi = torch.maximum(hi, m.pop("is_weight_max").cpu())
                    lo = torch.minimum(lo, m.pop("is_weight_min").cpu())
                    sums = {k: sums.get(k, 0.0) + v.double().cpu() for k, v in m.items()}
        with timed(times, "optimizer"):
            measured = gate.check(epoch) if gate else {}
            gated = measured.pop("gated", False)
            step = _optimizer_step(cfg, model, optimizer, sums, hi, lo, total[2] > 0, gated)
            steps.append(step | measured)
            reasons.append(steps[-1].pop("skipped"))
        if gated:  # the lm_head gradient surged: stop reusing this batch
            break
    keys = sorted({k for s in steps for k in s})  # a step with no trained row has only loss and grad_norm
    metrics = {k: sum(s[k] for s in steps if k in s) / sum(k in s for s in steps) for k in keys}
    ratios = [s.get("optim/lm_head_grad_ratio_max", 0.0) for s in steps[cfg.optim.minibatches:]]
    if ratios:  # the largest ratio the gate compared, not their mean
        metrics["optim/lm_head_grad_ratio_max"] = max(ratios)
    metrics |= _gap_metrics(gaps)
    applied = [s for s, why in zip(steps, reasons) if why != "gated"]
    return metrics | {"tokens": sum(s.get("tokens", 0.0) for s in applied),
                      "optim/epochs_run": len(applied) / cfg.optim.minibatches,
                      "optim/gated": float("gated" in reasons)}, entropy, reasons, times


def logp_gap(logp: Tensor, behav_logp: Tensor, mask: Tensor) -> Tensor:
    """(3,) float64: sum, count and max of |trainer − behaviour log-prob| over `mask` (B, L)."""
    gap = (logp.detach().double().cpu() - behav_logp.double()).abs()[mask.cpu()]  # (n,)
    top = gap.max() if len(gap) else torch.tensor(0.0, dtype=torch.float64)
    return torch.stack([gap.sum(), torch.tensor(float(len(gap)), dtype=torch.float64), top])


def _gap_metrics(gaps: list[Tensor]) -> dict:
    """rollout/logp_gap_mean and _max over every rank's fresh tokens that were run (NaN when none
    was): the training-inference mismatch at the weights that sampled them."""
    g = torch.stack(gaps) if gaps else torch.zeros(1, 3, dtype=torch.float64)  # (n, 3)
    total = all_ranks(g[:, :2].sum(0))
    top = all_ranks(g[:, 2].max(), MAX)
    mean = (total[0] / total[1]).item() if total[1] > 0 else math.nan
    top = float(top) if total[1] > 0 else math.nan
    return {"rollout/logp_gap_mean": mean, "rollout/logp_gap_max": top}


def engine_rows(cfg, rows, device) -> Tensor | None:
    """(B,) the fresh rows of `rows` when an inference engine sampled them (departure 12)."""
    if cfg.rollout.engine == "hf":
        return None
    return (~rows.replayed).to(device)


def _optimizer_step(cfg, model, optimizer, sums: dict, hi: Tensor, lo: Tensor, any_signal: bool,
                    gated: bool = False) -> dict:
    """Combine the metrics over ranks, clip, and step unless there is nothing to learn (all-zero
    advantages: AdamW would still move the weights through momentum and decay), the loss or
    gradient is not finite, or the gate closed (`gated`: AdamW's moments never see the gradient)."""
    keys = sorted(sums)
    ext = all_ranks(torch.stack([hi, -lo]).double(), MAX)
    out = dict(zip(keys, all_ranks(torch.stack([sums[k] for k in keys])).tolist())) if keys else {"loss": 0.0}
    out = {k: v if k in ("loss", "tokens") else v / max(out["tokens"], 1) for k, v in out.items()}
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip or math.inf) if any_signal \
        else torch.tensor(0.0)
    grad_norm = float(grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm)
    skipped = None if any_signal else "zero_adv"
    if any_signal and not (math.isfinite(out["loss"]) and math.isfinite(grad_norm)):
        skipped = "nonfinite"  # the weights are left as they are
    if gated:
        skipped = "gated"
    if skipped is None:
        optimizer.step()
        trained = [p for p in model.parameters() if p.requires_grad]  # a frozen base never changes
        shards = [p.to_local() if isinstance(p, DTensor) else p for p in trained]
        if all_ranks(float(not all(bool(torch.isfinite(p).all()) for p in shards))):
            raise FloatingPointError("non-finite weights after the optimizer step")
    optimizer.zero_grad(set_to_none=True)
    return out | {"grad_norm": grad_norm, "is_weight_max": ext[0].item(), "is_weight_min": -ext[1].item(),
                  "skipped": skipped}
