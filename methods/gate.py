"""Several plain passes over one batch (optim.epochs > 1, GRPO's μ iterations) with gradient gating
(optim.gate; DGG, arXiv 2605.19425): the update that replaces grpo.update_policy when optim.epochs
> 1 (train.py picks it at set-up). It measures the lm_head gradient of each optimizer step
(logged), and with optim.gate > 0 drops a reuse step whose gradient surged and runs no more passes
(grpo.py, departure 11).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

import grpo
from support.logprobs import output_layer, use_chunked_head
from support.parallel import MAX, all_ranks


class OutputGrad:
    """The gradient of the loss with respect to the output layer's weight (lm_head), summed over
    the micro-batches of an optimizer step, as `_ChunkedHead.backward` hands it to `_add`. Not the
    weight's .grad: with tied embeddings that also holds the input embedding's share, a frozen
    lm_head (LoRA) has none, and under FSDP it is a shard. Costs one (V, d) addition per
    micro-batch and one (V, d) all-reduce per optimizer step; changes no gradient."""

    def __init__(self, model):
        use_chunked_head(model)  # the layer whose backward hands its gradient to `_add`
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
    """optim.gate (DGG, arXiv 2605.19425): drop an optimizer step of a reuse pass (2..E) whose
    lm_head gradient norm exceeds gate × that of the step's first optimizer step with a gradient
    (the single-use gradient of this very batch). That reference needs no state across steps (so
    resume stays exact) and normalises away what changes between steps (batch size, advantage
    scale, flat groups). The paper's own rule (secondary summaries: a Z-score of the lm_head
    gradient energy over a sliding window) we could not read. Every rank takes the same decision.
    """

    def __init__(self, model, gate: float):
        self.head, self.gate, self.ref = OutputGrad(model), gate, 0.0

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


def reuse_update(s, model, policy, optimizer, batch, device, compute=None, ref=None) -> tuple:
    """optim.epochs passes over `batch`, as grpo.update_policy runs them, each optimizer step's
    lm_head gradient measured (`Gate.check`) and, with optim.gate > 0, a surge dropping the step
    and the passes left. Logs optim/lm_head_grad_norm (mean over steps) and
    optim/lm_head_grad_ratio_max (the largest ratio a reuse pass reached)."""
    gate = Gate(model, s.optim.gate)
    try:
        u = grpo.start_update(s, model, policy, optimizer, batch, device, compute, ref,
                              s.optim.epochs)
        for k in range(s.optim.epochs):
            if grpo.run_pass(u, k, gate.check):
                break
    finally:
        gate.close()  # the hooks go with the update
    metrics, entropy, skipped, times = grpo.finish_update(u)
    reuse_steps = u.steps[s.optim.minibatches :]
    ratios = [step.get("optim/lm_head_grad_ratio_max", 0.0) for step in reuse_steps]
    if ratios:
        metrics["optim/lm_head_grad_ratio_max"] = max(ratios)
    return metrics, entropy, skipped, times
