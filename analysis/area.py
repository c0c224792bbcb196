"""The comparison's primary measure (analysis/compare.py): the area, an eval curve's mean over the
first `budget` generated tokens, on the evals every run shares; the budget; and, given several arms
(one method at several learning rates), the tuned baseline the others are measured against: the
arm of highest mean area in avg@k, whatever `--metric` compares (#60).
"""

from __future__ import annotations

import itertools
import math

from analysis.stats import mean


def area(curve: list[tuple], budget: float) -> float | None:
    """Mean accuracy over the first `budget` generated tokens by trapezoids (over RLEP's phase I,
    the initial one); None, never extrapolated, for a run short of it or without a step-0 eval."""
    if not curve or curve[0][0] != 0 or curve[-1][1] < budget or budget <= 0:
        return None
    total = curve[0][2] * min(curve[0][1], budget)  # phase I, before the step-0 eval
    for (_, x0, y0, _), (_, x1, y1, _) in itertools.pairwise(curve):
        if x0 >= budget:
            break
        if x1 > budget:  # the last trapezoid ends at the budget
            y1 = y0 + (y1 - y0) * (budget - x0) / (x1 - x0)
            x1 = budget
        total += (x1 - x0) * (y0 + y1) / 2
    return total / budget


def common_grid(runs: list[dict]) -> None:
    """Cut every curve to the evals all runs share (each run's curve in place): a step stays if
    every run whose evals span it has an eval there. Runs evaluated every 5 and every 10 steps are
    then compared on the every-10 grid, since the trapezoids of a finer grid sit higher on a concave
    curve; a run cut short (or without its step-0 eval) does not thin the grid outside its span."""
    spans = []  # (first step, last step, every step) of each run with an eval
    for run in runs:
        steps = {c[0] for c in run["curve"]}
        if steps:
            spans.append((min(steps), max(steps), steps))
    for run in runs:
        kept = []
        for c in run["curve"]:
            if all(c[0] in s or not lo < c[0] < hi for lo, hi, s in spans):
                kept.append(c)
        run["curve"] = kept


def budget_of(runs: list[dict], base: list[dict], budget: float | str | None) -> float:
    """The area's budget in generated tokens: `budget` when a number; None: the smallest total of
    the baseline's runs `base` (every baseline seed then counts: their totals differ by 1-2 %, so
    their mean would leave about half out); "shortest": the smallest total of the finished runs
    (summary.json written), so that every finished run counts."""
    if budget is None:
        return min(run["tokens"] for run in base)
    if budget != "shortest":
        return budget
    finished = [run["tokens"] for run in runs if run["finished"]]
    if not finished:
        raise ValueError("--budget shortest: no finished run (summary.json) among them")
    return min(finished)


def filed_or_refused(runs: list[dict], arms: list[str]) -> None:
    """ValueError naming the first of `arms` (--baseline's) that no run is filed under (not "has no
    eval": no run is in that arm at all), and the arms the runs are in."""
    filed = sorted({run["strategy"] for run in runs})
    missing = [arm for arm in arms if arm not in filed]
    if missing:
        raise ValueError(f"no run is in the baseline arm {missing[0]!r} (--baseline names it); "
                         f"the runs' arms: {', '.join(filed)}")


def tuned(runs: list[dict], arms: list[str], budget: float | str | None) -> tuple:
    """(the baseline: the arm of `arms` whose runs have the highest mean area in avg@k, each arm's
    mean area, the budget: `budget_of` with the first arm's evaluated runs as the baseline's). An
    arm qualifies only if every one of its runs reaches the budget (else NaN: its mean would leave
    out the runs that generated least). ValueError when an arm has no run, or none qualifies."""
    filed_or_refused(runs, arms)
    first = [run for run in runs if run["strategy"] == arms[0] and run["curves"]["accuracy"]]
    if not first:
        raise ValueError(f"no run of the baseline {arms[0]!r} has an eval (--baseline names it)")
    budget = budget_of(runs, first, budget)
    curves = [{"curve": list(run["curves"]["accuracy"])} for run in runs]
    common_grid(curves)  # (on copies: the comparison cuts the curves of its own metric)
    areas = {}
    for arm in arms:
        mine = [area(c["curve"], budget) for c, run in zip(curves, runs) if run["strategy"] == arm]
        areas[arm] = math.nan
        if None not in mine:
            areas[arm] = mean(mine)
    known = {arm: a for arm, a in areas.items() if not math.isnan(a)}
    if not known:
        raise ValueError(f"--baseline {','.join(arms)}: no arm whose every run reaches the "
                         f"{budget:,.0f}-token budget (--budget sets it), so none has an area")
    return max(known, key=known.get), areas, budget


def tuned_line(baseline: str, areas: dict, budget: float) -> str:
    """What `tuned` chose, and from what, on one line."""
    cells = []
    for arm, a in areas.items():
        cell = f"{arm} {100 * a:.1f} %"
        if math.isnan(a):
            cell = f"{arm} none (a run short of the budget)"
        cells.append(cell)
    return (f"baseline {baseline}: the highest mean area in avg@k at {budget:,.0f} generated "
            f"tokens of {', '.join(cells)}")
