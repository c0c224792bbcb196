"""Several optimizer passes over one rollout batch, then control the drift (`lookahead.method`):
SFPO's reposition and GXPO's gradient extrapolation. Each is an update that replaces
grpo.update_policy (train.py picks it at set-up): its own sequence of grpo.run_pass calls, with
the moves between them written here.

  none  plain GRPO (grpo.update_policy; optim.epochs and DGG's gate are the other reuse knobs)
  sfpo  Slow-Fast Policy Optimization (ICLR 2026, arXiv 2510.04072; code Urheen/SFPO):
        K fast passes θ0 → θK; reposition θ̃ = θ0 + α(θK − θ0); one slow pass at θ̃.
  gxpo  Gradient-Extrapolation Policy Optimization (arXiv 2605.06755; its first author's code,
        SwapniL-afk-now/final-gxpo): two fast passes θ0 → θ1 → θ2, a virtual K-pass point
        extrapolated per coordinate from how the gradient changed between them, a move of α
        toward it, one corrective pass (`GXPO`).

Every pass of a step clips against π_old, the policy that sampled the batch (the released SFPO
computes old log-probs once per batch, as grpo.py does for optim.epochs). The learning rate is the
step's for every pass. AdamW's moments and step count run on through every pass and across a
reposition, as in SFPO's release: the slow pass sees moments built from the fast passes'
gradients. A pass is optim.minibatches optimizer steps, as one `update_policy` call of the release
(its `ppo_mini_batch_size`).

Departures from the released GXPO (its paper-protocol run: K 5, α 0.5, δ 1e-8, τ 0.5, ω 0.1):
 4. Its second fast pass clips against log-probs recomputed at θ1; here every pass clips against
    π_old, as SFPO and optim.epochs do (no extra no-grad pass).
 5. A non-finite gradient is skipped as in every arm (grpo.py); the release restores θ0 and takes
    a plain step instead.
 6. Only optim.minibatches = 1 (the paper protocol's: one mini-batch a step); the release runs the
    three passes per mini-batch.

Departures from the released SFPO (Demo/fsdp_workers.py `sfpo_update_actor`, ray_trainer.py):
 1. The stop rule reads the mean token entropy of the step's last pass (the release: its actor's
    `entropy_loss` metric of the last update call, the same quantity on one mini-batch).
 2. The stop's entropy window and latch are saved in checkpoints, so a resumed run stops where an
    uninterrupted one would (the release keeps them in the trainer's memory only).
 3. The release also has a fixed-step stop (`stop_sfpo_step` in its Demo); here only the
    entropy z-score stop, which its training scripts use (zscore_w 30, zscore_threshold 1.0).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

import grpo
from support.parallel import local, say_once, trained


DELTA = 1e-8  # GXPO: |g0| below this is no signal; so is |1 + r|
RATIO = (-2.0, 3.0)  # GXPO: r = g1/g0 clamped to this, per coordinate
PASSES = "none with optim.epochs > 1, and not gxpo with optim.minibatches > 1 (it sets the passes)"


@dataclass
class LookaheadConfig:
    method: str = "none"
    """`none` (optim.epochs passes), `sfpo` (fast passes, reposition, slow) or `gxpo`"""
    fast_steps: int = 3
    """K. sfpo: fast passes before the reposition (sfpo_inner_steps: 3); gxpo: the virtual
    lookahead that two real passes extrapolate to (paper protocol: 5)"""
    alpha: float = 0.8
    """sfpo: θ̃ = θ0 + α(θK − θ0) (sfpo_step_size: 0.8; 0.9 for Qwen3-4B; not scheduled);
    gxpo: θ̃ = θ0 + α·q⊙(θ2 − θ0) (paper protocol: 0.5)"""
    stop_window: int = 30
    """sfpo: steps of entropy in its stop rule's z-score (zscore_w: 30; 0 = never stop)"""
    stop_z: float = 1.0
    """sfpo: stop for good once (entropy − window mean) / window std ≥ this (zscore_threshold)"""
    gate_z: float = 0.5
    """gxpo: fall back to GRPO for good once |z| of the corrective gradient norm ≥ this (τ)"""
    gate_ema: float = 0.1
    """gxpo: weight ω of the newest norm in the running mean and variance of that z"""
    max_zero_share: float = 0.5
    """gxpo: a batch with more than this share of zero rewards takes one plain pass"""
    gate_signal: str = "grad_norm"
    """gxpo's fall-back reads: `grad_norm` (|z| of the corrective gradient norm, gate_z, gate_ema)
    or `entropy` (SFPO's rule on each step's entropy: stop_window, stop_z; release a1db839a)"""

    def fits(self, optim) -> bool:
        """Whether optim.* leaves the passes to this method (the rule `PASSES` words)."""
        if self.method == "none":
            return True
        return optim.epochs == 1 and (self.method == "sfpo" or optim.minibatches == 1)

    def check(self) -> dict[str, tuple[bool, str]]:
        fast_min = 2 if self.method == "gxpo" else 0
        return {
            "method": (self.method in ("none", "sfpo", "gxpo"), "none, sfpo or gxpo"),
            "fast_steps": (fast_min <= self.fast_steps <= 64,
                           f"in [{fast_min}, 64] ({self.method})"),
            "alpha": (0 <= self.alpha <= 4, "in [0, 4]"),
            "stop_window": (0 <= self.stop_window <= 100_000, "in [0, 100000] (0 = never)"),
            "stop_z": (-1e6 < self.stop_z < 1e6, "finite"),
            "gate_z": (0 <= self.gate_z < 1e6, "≥ 0"),
            "gate_ema": (0 < self.gate_ema <= 1, "in (0, 1]"),
            "max_zero_share": (0 <= self.max_zero_share <= 1, "in [0, 1]"),
            "gate_signal": (self.gate_signal in ("grad_norm", "entropy"), "grad_norm or entropy"),
        }


@torch.no_grad()
def reposition(params: list[torch.Tensor], start: list[torch.Tensor], alpha: float) -> None:
    """θ ← θ0 + α(θ − θ0) in place, as SFPO's release writes it (α = 0: back to θ0 exactly)."""
    for p, p0 in zip(params, start, strict=True):
        p.copy_(p0 + alpha * (p - p0))


def lookahead_factor(g0: torch.Tensor, g1: torch.Tensor, K: int) -> torch.Tensor:
    """GXPO's q per coordinate: with r = g1/g0 (the gradient's change over one fast step, clamped
    to RATIO), K steps of a gradient shrinking by r each move S_K(r) = 1 + r + … + r^(K−1) times
    the first; two real steps moved S_2(r) = 1 + r, so θK ≈ θ0 + q⊙(θ2 − θ0), q = S_K/S_2, clamped
    to [1, K/2 + 1]. A coordinate without signal (|g0| ≤ DELTA) gets q = 1."""
    live = g0.abs() > DELTA
    r = g1 / (torch.sign(g0) * g0.abs().clamp(min=DELTA))
    r = torch.where(live, r.nan_to_num(1.0).clamp(*RATIO), 1.0)
    s_k = torch.ones_like(r)
    for _ in range(K - 1):  # Horner: S_K = 1 + r·(1 + r·(…))
        s_k = 1 + r * s_k
    s_2 = 1 + r
    q = torch.where(s_2.abs() > DELTA, s_k / s_2, 1.0).clamp(1.0, K / 2 + 1)
    return torch.where(live, q, 1.0)


class SFPO:
    """The update (replacing grpo.update_policy): K fast passes, the reposition, one slow pass;
    once the entropy stop fires, one plain pass (GRPO) for the rest of the run.

    The stop (the release's ray_trainer): before each step, with the last `stop_window` steps'
    entropies e (the newest last), z = (e[-1] − mean e) / (std e + 1e-9), std the population's;
    z ≥ stop_z switches SFPO off for the rest of the run (an entropy surge: the fast passes have
    begun to destabilise the policy)."""

    SHARED = True  # the same on every rank: checkpoints restore it on any number of processes

    def __init__(self, cfg: LookaheadConfig, minibatches: int = 1):
        self.cfg = cfg
        self.minibatches = minibatches  # optimizer steps per pass
        self.entropies = []  # the mean token entropy of each step's last pass, the newest last
        self.stopped = False

    def __call__(self, s, model, policy, optimizer, batch, device, compute=None, ref=None):
        if not self.stopped:
            self.stopped = entropy_surged(self.entropies, self.cfg.stop_window, self.cfg.stop_z)
        K = self.cfg.fast_steps
        if self.stopped:
            u = grpo.start_update(s, model, policy, optimizer, batch, device, compute, ref, 1)
            grpo.run_pass(u, 0)
        else:
            start = [p.detach().clone() for p in trained(model)]  # θ0
            u = grpo.start_update(s, model, policy, optimizer, batch, device, compute, ref, K + 1)
            for k in range(K):  # the fast passes: θ0 → θK
                grpo.run_pass(u, k)
            reposition(trained(model), start, self.cfg.alpha)  # θ̃ = θ0 + α(θK − θ0)
            del start  # θ0's copy is freed before the slow pass
            grpo.run_pass(u, K)  # the slow pass, from θ̃
        last = [step["entropy"] for step in u.steps[-self.minibatches :] if "entropy" in step]
        if last:  # (a pass that trained no token, every advantage 0, has no entropy)
            self.entropies.append(sum(last) / len(last))
            self.entropies = self.entropies[-max(1, self.cfg.stop_window) :]
        return grpo.finish_update(u, {"lookahead/active": float(not self.stopped)})

    def state_dict(self) -> dict:
        return {"entropies": torch.tensor(self.entropies, dtype=torch.float64),
                "stopped": self.stopped}

    def load_state_dict(self, state: dict) -> None:
        self.entropies = state["entropies"].tolist()
        self.stopped = bool(state["stopped"])


def entropy_surged(entropies: list[float], window: int, z_stop: float) -> bool:
    """SFPO's stop rule (and GXPO's entropy gate): with the last `window` entropies (the newest
    last), z = (newest − mean) / (population std + 1e-9) ≥ z_stop; False before `window` exist or
    with window 0."""
    recent = entropies[-window:]
    if not window or len(recent) < window:
        return False
    mean = sum(recent) / window
    std = math.sqrt(sum((e - mean) ** 2 for e in recent) / window) + 1e-9
    return (recent[-1] - mean) / std >= z_stop


class GXPO:
    """The update (replacing grpo.update_policy): pass 0 at θ0 keeps its raw (pre-clip) gradient
    g0, pass 1 at θ1 keeps g1; then θ̃ = θ0 + α·q⊙(θ2 − θ0) (`lookahead_factor`) and pass 2, the
    corrective one, steps from θ̃.

    Fall-back, lookahead.gate_signal = grad_norm (the release of e40b7ad): the corrective pass's
    pre-clip gradient norm H is scored z = (H − m)/(s + 1e-8) against running m, s (start 1, 1;
    s ≥ 0.01), which then move by ω: m ← (1−ω)m + ωH, s² ← (1−ω)s² + ω(H − m_old)²; |z| ≥ τ
    switches GXPO off for the rest of the run. A step whose passes all had nothing to learn (every
    advantage 0: no gradient, H = 0) is not scored. gate_signal = entropy (the release's final
    main-table launcher, a1db839a): SFPO's entropy rule (`entropy_surged`, stop_window, stop_z).
    A batch with more than max_zero_share zero rewards takes one plain pass and is not scored.
    Switching off is said once on stderr and logged (lookahead/active 0)."""

    SHARED = True  # the same on every rank: checkpoints restore it on any number of processes

    def __init__(self, cfg: LookaheadConfig, say=say_once):
        self.cfg = cfg
        self.mean, self.var, self.stopped = 1.0, 1.0, False
        self.entropies = []  # gate_signal entropy: each step's last-pass entropy, the newest last
        self.say = say  # one line when the gate switches GXPO off

    def __call__(self, s, model, policy, optimizer, batch, device, compute=None, ref=None):
        if not self.stopped and self.cfg.gate_signal == "entropy":
            self._switch(entropy_surged(self.entropies, self.cfg.stop_window, self.cfg.stop_z),
                         "its entropy's z-score reached lookahead.stop_z")
        zero_share = 1.0
        if len(batch):
            zero_share = float((batch.reward == 0).double().mean())
        active = not self.stopped and zero_share <= self.cfg.max_zero_share
        if not active:
            u = grpo.start_update(s, model, policy, optimizer, batch, device, compute, ref, 1)
            grpo.run_pass(u, 0)
            return grpo.finish_update(u, {"lookahead/active": 0.0})
        start = [p.detach().clone() for p in trained(model)]  # θ0
        u = grpo.start_update(s, model, policy, optimizer, batch, device, compute, ref, 3)
        grads = []  # g0, g1: each fast pass's gradient, before clipping
        for k in range(2):
            grpo.run_pass(u, k, functools.partial(self._keep_gradient, model, grads))
        self._extrapolate(model, start, *grads)
        del start
        grads.clear()  # θ0's and the gradients' copies are freed before the corrective pass
        grpo.run_pass(u, 2)  # the corrective pass
        out = {"lookahead/active": 1.0}
        if self.cfg.gate_signal == "entropy":
            self._record_entropy(u.steps[-1])
        elif any(why is None for why in u.skipped):  # a gradient was applied: score its norm
            out["lookahead/z"] = self._score(u.steps[-1]["grad_norm"])
        return grpo.finish_update(u, out)

    @staticmethod
    def _keep_gradient(model, grads: list, k: int) -> dict:
        """This pass's gradient (this rank's part), copied before the optimizer step clips it."""
        kept = []
        for p in model.parameters():
            if p.requires_grad:
                kept.append(torch.zeros_like(local(p)) if p.grad is None else local(p.grad).clone())
        grads.append(kept)
        return {}

    @torch.no_grad()
    def _extrapolate(self, model, start: list, g0: list, g1: list) -> None:
        """θ̃ = θ0 + α·q⊙(θ2 − θ0), per coordinate (`lookahead_factor`)."""
        for p, p0, a, b in zip(trained(model), start, g0, g1, strict=True):
            q = lookahead_factor(a.float(), b.float(), self.cfg.fast_steps)
            p.copy_(p0 + (self.cfg.alpha * q * (p.float() - p0.float())).to(p.dtype))

    def _score(self, norm: float) -> float:
        """z of the corrective gradient norm against the running statistics, which then move."""
        std = max(math.sqrt(self.var), 0.01)
        z = (norm - self.mean) / (std + 1e-8)
        old_mean = self.mean
        self.mean = (1 - self.cfg.gate_ema) * self.mean + self.cfg.gate_ema * norm
        self.var = (1 - self.cfg.gate_ema) * self.var + self.cfg.gate_ema * (norm - old_mean) ** 2
        self._switch(abs(z) >= self.cfg.gate_z, f"|z| of its corrective gradient norm {abs(z):.3g}"
                     f" ≥ lookahead.gate_z {self.cfg.gate_z:g}")
        return z

    def _record_entropy(self, step: dict) -> None:
        if "entropy" in step:  # (a pass that trained no token has none)
            self.entropies.append(step["entropy"])
            self.entropies = self.entropies[-max(1, self.cfg.stop_window) :]

    def _switch(self, off: bool, why: str) -> None:
        if off and not self.stopped:
            self.say(f"note: gxpo switched to plain GRPO for the rest of the run ({why})")
        self.stopped = self.stopped or off

    def state_dict(self) -> dict:
        return {"mean": self.mean, "var": self.var, "stopped": self.stopped,
                "entropies": torch.tensor(self.entropies, dtype=torch.float64)}

    def load_state_dict(self, state: dict) -> None:
        self.mean = float(state["mean"])
        self.var = float(state["var"])
        self.stopped = bool(state["stopped"])
        entropies = state.get("entropies")  # (absent in checkpoints before gate_signal)
        self.entropies = [] if entropies is None else entropies.tolist()


def make_lookahead(cfg: LookaheadConfig, optim):
    """The update that replaces grpo.update_policy for lookahead.method (optim: the run's optim.*
    section)."""
    if cfg.method == "sfpo":
        return SFPO(cfg, optim.minibatches)
    return GXPO(cfg)
