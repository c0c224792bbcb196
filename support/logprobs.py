"""The memory mechanism behind grpo.py's log-prob passes: token log-probs without a (tokens,
vocabulary) tensor. The output layer runs in chunks in at least float32 (`_ChunkedHead`, made the
layer's forward by `use_chunked_head`), asked through the model's own forward (so DDP, FSDP and
compile wrappers stay in charge), and `completion_logprobs` runs each distinct prompt once and
shares its KV cache with its rows (support/kvcache.py: generation's KV cache).
"""

from __future__ import annotations

from contextlib import contextmanager
from types import MethodType

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.profiler import record_function

from support.kvcache import cache_kwarg
from support.parallel import hf_module

HEAD_CHUNK = 2**25
"""Logits per chunk of the output layer (128 MiB in float32): no (tokens, V) tensor is whole."""


def use_chunked_head(model) -> None:
    """Replace the forward of the model's output layer (once; again does nothing) by
    `_head_forward`: float32 logits, or chunked log-probs while `_asking` holds a request.
    Generation and the log-prob passes call it first."""
    head = output_layer(model)
    if "forward" not in head.__dict__:
        head.forward = MethodType(_head_forward, head)


def output_layer(model):
    """The model's output layer (its output embeddings), refused where logits are changed after it
    (softcapping, scaling), which the chunked log-probs would miss."""
    m = hf_module(model)
    for key in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        if getattr(getattr(m, "config", None), key, None) not in (None, 1.0):
            raise ValueError(f"the model's config sets {key}: logits changed after the output "
                             "layer are not supported by the chunked log-probs")
    head = m.get_output_embeddings() if hasattr(m, "get_output_embeddings") else None
    if not isinstance(getattr(head, "weight", None), Tensor):
        raise TypeError(f"{type(m).__name__} has no output layer (get_output_embeddings)")
    return head


def head_precision(model, tf32: bool) -> None:
    """Whether the model's output layer runs its float32 GEMMs on TF32 tensor cores (CUDA)."""
    output_layer(model)._tf32 = tf32


@contextmanager
def _matmuls(tf32: bool):
    """float32 GEMMs on TF32 tensor cores while inside when `tf32` (CUDA's flag; the CPU ignores
    it); the flag as it was afterwards."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32 or before
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


@contextmanager
def float32_head(model):
    """While inside (one rollout), the output layer's logits use one float32 copy of its weight and
    bias, made here, instead of a conversion per decode step (a bf16 head of 151,936 × 1,536: about
    0.9 GB written per step); the same numbers. A float32 head needs no copy."""
    head = output_layer(model)
    w, b = head.weight, getattr(head, "bias", None)
    if w.dtype != torch.float32:
        head._float32 = _upcast(w.detach(), None if b is None else b.detach(), torch.float32)
    try:
        yield
    finally:
        head._float32 = None


@contextmanager
def _asking(model, targets: Tensor, valid: Tensor, temperature: float, with_entropy: bool):
    """While inside, the output layer returns (B, C, 2): the log-prob of `targets` (B, C) and the
    entropy at each of the first C positions, 0 where not `valid`. The request waits on the layer,
    so the forward that runs is the wrapper's: DDP's gradient sync, FSDP's unsharding of the root's
    weights (embeddings, final norm, output layer), the compiled graph."""
    use_chunked_head(model)
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
    tf32 = head.__dict__.get("_tf32", False)  # `head_precision`
    if request is None:
        with torch.autocast(hidden.device.type, enabled=False), _matmuls(tf32):
            dtype = torch.promote_types(hidden.dtype, torch.float32)
            weights = head.__dict__.get("_float32")  # a rollout's copy (`float32_head`)
            if weights is None or dtype != torch.float32:
                weights = _upcast(w, b, dtype)
            return F.linear(hidden.to(dtype), *weights)
    targets, valid, temperature, with_entropy = request  # (B, C), (B, C)
    listener = head.__dict__.get("_weight_grad_listener")  # `OutputGrad`'s
    h = hidden[:, : targets.shape[1]][valid]  # (N, H): padding never reaches the output layer
    logp, ent = _ChunkedHead.apply(h, w, b, targets[valid], temperature, with_entropy, listener,
                                   tf32)
    out = torch.zeros(*targets.shape, 2, dtype=logp.dtype, device=logp.device)  # (B, C, 2)
    return out.index_put((valid,), torch.stack([logp, ent], -1))


class _ChunkedHead(torch.autograd.Function):
    """logp (N,) of `targets` under softmax((hidden·Wᵀ + b) / T) and its entropy (N,), HEAD_CHUNK
    logits at a time in at least float32 (autocast off, bf16 weights upcast). Backward recomputes
    each chunk's logits: one (rows, V) chunk is alive at a time (≈ 1 byte per logit, not ~20).
    `listener`, when given, receives the weight's gradient from this layer alone (even frozen)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, with_entropy, listener=None,
                tf32=False):
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        n = max(1, HEAD_CHUNK // weight.shape[0])  # rows per chunk
        lse = torch.zeros(len(hidden), dtype=dtype, device=hidden.device)  # (N,)
        logp, ent = torch.zeros_like(lse), torch.zeros_like(lse)  # (N,)
        label = record_function("chunked_head_forward")  # what a profile calls this time
        with label, torch.autocast(hidden.device.type, enabled=False), _matmuls(tf32):
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
        ctx.temperature, ctx.listener, ctx.tf32 = temperature, listener, tf32
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, _):  # entropy is never differentiated
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        n, T = max(1, HEAD_CHUNK // weight.shape[0]), ctx.temperature
        g = grad_logp.to(lse.dtype) / T  # (N,) d loss / d z_target, z = logits / T
        label = record_function("chunked_head_backward")
        with label, torch.autocast(hidden.device.type, enabled=False), _matmuls(ctx.tf32):
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
        return gh.to(hidden.dtype), gw, gb, None, None, None, None, None


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


def completion_logprobs(model, tokens: Tensor, prompt_len: Tensor, seq_len: Tensor,
                        temperature: float, with_entropy: bool = False,
                        share_prompt: bool = True) -> tuple[Tensor, Tensor | None]:
    """`token_logprobs` of the completion tokens of rows `prompt | completion | pad` (B, L); 0
    elsewhere.

    Each distinct prompt (all but its last token) runs once and its KV cache is copied to its rows;
    the completion pass attends to it at the positions continuing the prompt, as one pass over the
    whole row would, and gradients flow back through the copies. share_prompt=False runs whole
    rows: gradient checkpointing drops the KV cache, and FSDP frees a layer's gathered weights after
    its forward, while backward through the cache needs them.
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
    keyed = torch.cat([n_prefix[:, None], prefix], 1)  # (B, 1 + P)
    distinct, row_prefix = torch.unique(keyed, dim=0, return_inverse=True)  # (n, 1 + P), (B,)
    prefix_mask = (ar[None, :P] < distinct[:, :1]).long()  # (n, P)
    key = cache_kwarg(model)
    prefix_out = model(input_ids=distinct[:, 1:], attention_mask=prefix_mask, use_cache=True,
                       logits_to_keep=1)
    cache = getattr(prefix_out, key)  # (an output drops None fields: `[key]` would raise)
    if cache is None or cache.get_seq_length() == 0:
        raise RuntimeError("the model returned no KV cache (gradient checkpointing?): "
                           "call with share_prompt=False")
    cache.batch_select_indices(row_prefix)
    j = ar[None, :C]  # (1, C)
    valid = j < comp_len[:, None]  # (B, C) input j predicts completion token j
    col = (n_prefix[:, None] + j).clamp(max=L - 2)  # (B, C) input j's column; its target's is + 1
    mask = torch.cat([prefix_mask[row_prefix], valid.long()], 1)  # (B, P + C)
    with _asking(model, tokens.gather(1, col + 1), valid, temperature, with_entropy):
        out = model(input_ids=tokens.gather(1, col), attention_mask=mask, **{key: cache},
                    position_ids=n_prefix[:, None] + j, use_cache=True).logits  # (B, C, 2)

    def to_rows(x: Tensor) -> Tensor:  # (B, C) -> (B, L): token j back at column prompt_len + j
        return torch.zeros(B, L, dtype=x.dtype, device=x.device).scatter_add(1, col + 1, x)

    if not with_entropy:
        return to_rows(out[..., 0]), None
    return to_rows(out[..., 0]), to_rows(out[..., 1].detach())


@contextmanager
def mode(model, training: bool):
    """Every module of `model` in train (`training`) or eval mode while inside, then each back in
    its own mode. Not `model.train(was)`: a wrapper's flag need not be its layers' (peft's LoRA
    wrapper says training while the loaded layers are in eval mode), and restoring it would flip
    every layer. grpo.py's training forwards and their backward run in train mode; loaded models
    stay in eval mode elsewhere (generation, the no-grad passes). HF recomputes activations
    (model.gradient_checkpointing) only in train mode, and LoRA's adapter dropout acts only then;
    a checkpoint's own dropout would act too, and the first step's ratio would not be 1 (the paper
    models set none: attention_dropout 0)."""
    modules = list(model.modules())
    was = [m.training for m in modules]
    model.train(training)
    try:
        yield
    finally:
        for m, flag in zip(modules, was, strict=True):
            m.training = flag
