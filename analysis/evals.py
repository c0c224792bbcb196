"""Which eval curve the run comparison reads (analysis/compare.py's `--metric`): the periodic
eval's avg@k (`accuracy`, the default and the pre-stated primary), pass@k, maj@k or greedy
accuracy. One metric per comparison: its area, final value, targets, saving curve and verdicts
(Holm's correction over the arms, within that metric); run it once per metric.

Where each comes from: metrics.jsonl's `eval/<metric>` at every eval; the step-0 eval from
summary.json's `eval_<name>_initial` (eval_accuracy_initial, eval_pass_at_k_initial, ...), without
which a curve has no step-0 point, so no area and no gain target (a NaN level: no fraction of a
gain is defined). A standard error: accuracy's is logged (`eval/accuracy_se`); pass@k, maj@k and
greedy are 0/1 per problem, so theirs is the same formula over `eval/n` problems,
√(p (1 − p) / (n − 1)). A value a run did not log (greedy before #60, or `eval.greedy: false`) is
missing, never 0: that eval drops out of the curve; a run without any is left out of the
comparison in that metric, named in one line.
"""

from __future__ import annotations

import math

from support.checkpoint import INITIAL_EVALS

# --metric: each one's folder name in bench/reproduce_tiny.py's compare/
METRICS = {"accuracy": "accuracy", "pass@k": "pass_at_k", "maj@k": "maj_at_k",
           "greedy": "greedy"}
INITIAL = {metric: key for key, metric in INITIAL_EVALS.items()}  # summary.json's step-0 key


def eval_curve(metric: str, summary: dict, rows: list[dict], phase1: float) -> list[tuple]:
    """[(step, generated tokens, the metric, its standard error)] at the step-0 eval (after RLEP's
    phase I, `phase1` tokens) and at each row that logged the metric."""
    curve = [(0, phase1, summary.get(INITIAL[metric]), 0.0)]
    for row in rows:
        tokens = row.get("tokens/generated_total", row.get("generated_tokens"))
        curve.append((row.get("step"), tokens, row.get(f"eval/{metric}"), standard_error(metric,
                                                                                         row)))
    return [c for c in curve if c[2] is not None]


def standard_error(metric: str, row: dict) -> float:
    """The row's standard error of the metric over the eval's problems (0 where unknown)."""
    if metric == "accuracy":
        return row.get("eval/accuracy_se", 0)
    p, n = row.get(f"eval/{metric}"), row.get("eval/n") or 0
    if p is None or n < 2:
        return 0.0
    return math.sqrt(p * (1 - p) / (n - 1))


def use_metric(runs: list[dict], metric: str, baseline: str) -> tuple[list[dict], list[str]]:
    """(the runs compared in `metric`, the paths of those left out): each run's curve and final
    value set to the metric's in place and its other curves dropped. A run evaluated (an accuracy
    at one eval at least) that never logged the metric is left out; a run not yet evaluated stays,
    as in accuracy (no final value). ValueError when every run of the `baseline` is left out."""
    kept, left_out = [], []
    for run in runs:
        curves = run.pop("curves")
        curve = curves[metric]
        if curves["accuracy"] and not curve:
            left_out.append(run["path"])
            continue
        run["curve"] = curve
        run["final"] = curve[-1][2] if curve else None
        if "continued" in run:  # its copy past the run's end (compare.py --continued)
            run["continued"]["curve"] = run["continued"].pop("curves")[metric]
        kept.append(run)
    base = [run for run in runs if run["strategy"] == baseline]
    if base and all(run["path"] in left_out for run in base):
        raise ValueError(f"no run of the baseline {baseline!r} logged eval/{metric} (--metric "
                         f"{metric}; greedy is logged since #60, with eval.greedy)")
    return kept, left_out
