"""GPU time as a stated cost model (#60), beside compare.compute's FLOPs (which stays as it is):
a model computed from CPU runs, not a measurement on a GPU.

  time = generated tokens × c_gen + forward-backward token passes × c_train
         + (no-grad token passes + prompt prefill tokens) × c_fwd

in units of c_train (= 1), as a function of ρ = c_gen / c_train, with c_fwd = c_train / 3 (a
forward is 2N of a forward-backward's 6N FLOPs; prefill is a forward over the prompt). At ρ = 1/3
the model is FLOPs with prefill counted: (2N·generated + 6N·fwd-bwd + 2N·(no-grad + prefill)) / 6N.
On a GPU decoding is memory-bound, so ρ is larger (docs/gpu.md; bench/plot.py --cost marks the
H100's measured figures).

Time to a target: each counter where the run first holds it (compare.sustained_crossing over the
evals that logged the token passes, as total compute's crossing; each counter interpolated
between two evals as the generated tokens are). Per arm: the paired ratio of medians over seeds
against the baseline's time (compare's `pairs`), at each ρ; and the break-even ρ, where that
ratio crosses 1.

Prefill is not logged. Each generated row's prompt is prefilled once (HF generate keeps no prefix
cache across rows), so prefill tokens = generated rows × their prompts' length, and neither is
logged per eval. It is derived from what is: prefill ≈ generated tokens × (prompt ÷ completion
tokens of the rows trained on), that ratio from the run's last counters, (tokens/fwd_bwd −
tokens/trained) / tokens/trained: a forward-backward pass runs a trained row's prompt and
completion, tokens/trained counts its completion. It is exact when the trained rows' (those with
a non-zero advantage, every pass) prompt-to-completion ratio is the generated rows'. On #60's
none-s0 it gives 529,200 prefill tokens against 543,900 from 150 × 256 rows × the trained rows'
mean prompt of 14.16 tokens (2.7 % fewer: trained completions run longer than the batch mean).
A pass an lm_head gate discarded (optim.gate) counts in tokens/fwd_bwd and not in
tokens/trained, so the share is overstated for gated arms.
"""

from __future__ import annotations

import math

from analysis.compare import over_passes, sustained_crossing
from analysis.stats import paired_ratio, ratio_of_medians

C_FWD = 1 / 3  # a no-grad forward (and prefill) token, in forward-backward tokens
RATIOS = (1 / 3, 1, 3, 10, 30)  # ρ = c_gen / c_train with intervals (1/3: FLOPs, prefill counted)
GRID = [10 ** (i / 50) for i in range(-100, 151)]  # 0.01 … 1000: where a break-even is sought


def prefill_share(run: dict) -> float:
    """Prompt tokens prefilled per generated token: (fwd_bwd − trained) / trained at the run's
    last step that logged both (NaN when none did, or nothing was trained)."""
    steps = [step for step in run["passes"] if step in run["trained"] and step > 0]
    if not steps:
        return math.nan
    fwd_bwd, trained = run["passes"][max(steps)][0], run["trained"][max(steps)]
    if trained <= 0:
        return math.nan
    return (fwd_bwd - trained) / trained


def at_crossing(run: dict, level: float) -> tuple | None:
    """(generated, forward-backward, no-grad, prefill) tokens where `run` first holds `level`
    over its evals that logged the token passes (None: never)."""
    generated = sustained_crossing(over_passes(run, lambda g, fwd_bwd, no_grad: g), level)
    if generated is None:
        return None
    fwd_bwd = sustained_crossing(over_passes(run, lambda g, fwd_bwd, no_grad: fwd_bwd), level)
    no_grad = sustained_crossing(over_passes(run, lambda g, fwd_bwd, no_grad: no_grad), level)
    return generated, fwd_bwd, no_grad, generated * prefill_share(run)


def gpu_time(counters: tuple | float, ratio: float, c_fwd: float = C_FWD) -> float:
    """The model's time for `counters` (at_crossing's) at ρ = `ratio`, in units of c_train; inf
    for a target never reached (compare.pairs' inf in place of the counters)."""
    if isinstance(counters, float):
        return math.inf
    generated, fwd_bwd, no_grad, prefill = counters
    return ratio * generated + fwd_bwd + c_fwd * (no_grad + prefill)


def time_ratio(counter_pairs: list, ratio: float, interval: bool = False) -> tuple:
    """(the ratio of median times at ρ = `ratio`, its paired 95 % interval when `interval`, else
    NaNs) over (the run's counters, its baseline seed's): compare.pairs of at_crossing."""
    times = [(gpu_time(a, ratio), gpu_time(b, ratio)) for a, b in counter_pairs]
    if interval:
        return paired_ratio(times)
    if not times:
        return math.nan, math.nan, math.nan
    return ratio_of_medians(times), math.nan, math.nan


def break_even(counter_pairs: list) -> dict:
    """Where the arm's time to the target equals the baseline's as ρ grows over GRID: `ratio`,
    the last ρ at which the ratio of median times crosses 1 (bisected between grid points), and
    `cheaper`: "above" or "below" it, "always", "never", "same" (the baseline itself) or
    "undefined" (the baseline's median never reaches the target)."""
    ratios = [time_ratio(counter_pairs, rho)[0] for rho in GRID]
    if any(map(math.isnan, ratios)):
        return {"ratio": math.nan, "cheaper": "undefined"}
    cheaper = [r < 1 for r in ratios]
    if all(r == 1 for r in ratios):
        return {"ratio": math.nan, "cheaper": "same"}
    if all(cheaper) or not any(cheaper):
        return {"ratio": math.nan, "cheaper": "always" if all(cheaper) else "never"}
    i = max(j for j in range(len(GRID) - 1) if cheaper[j] != cheaper[j + 1])
    lo, hi = GRID[i], GRID[i + 1]
    for _ in range(40):  # on a log scale, to well below the grid's 5 % steps
        mid = math.sqrt(lo * hi)
        if (time_ratio(counter_pairs, mid)[0] < 1) == cheaper[i]:
            lo = mid
        else:
            hi = mid
    return {"ratio": math.sqrt(lo * hi), "cheaper": "above" if cheaper[-1] else "below"}


def measured_ratios(record: dict) -> list[tuple[str, float]]:
    """(label, c_gen / c_train) measured by a bench/gpu_run.py record: the default path (the warm
    update's forward-backward tokens/s ÷ a whole rollout's useful tokens/s, its prefill inside)
    and the compiled decode step (the update's ÷ the `static_packed` step's, every row live)."""
    full = record["steps"]["full"]
    update = full["update"]["warm_tokens_per_s"]  # prompt and completion tokens, as fwd_bwd
    default = update / full["generation"]["useful_tokens_per_s"]
    compiled = update / record["steps"]["decode"]["arms"]["static_packed"]["tokens_per_s"]
    return [(f"default path {default:.1f}", default), (f"compiled decode {compiled:.2f}", compiled)]
