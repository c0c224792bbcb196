"""The saving as a curve, not a point (#60): for each arm, generated tokens and total compute to
each fraction of the baseline's gain (FRACTIONS, 50 … 100 %) and to the table's target (the
baseline's final value unless --target), each the paired ratio of medians with its bootstrap
interval and verdicts at 0.5× and 0.3×. Every point is compare.py's single-target computation run
at its level (`gain_level`, `crossings`, `pairs`, `counted_ratio`): the point at fraction f is the
table's gain-target column under --gain-fraction f, number for number.

Beside it, GPU time as a stated model (analysis/cost.py): to the table's target, the time ratio at
each ρ = c_gen / c_train of cost.RATIOS with its interval; to every target, the break-even ρ.

Into compare.json (each arm's `curve` and `gpu_time`) and curve.md beside compare.csv, in the
comparison's --metric (analysis/evals.py).
"""

from __future__ import annotations

import math
from pathlib import Path

from analysis import cost
from analysis.compare import counted_ratio, crossings, gain_level, pairs
from analysis.compare_io import interval, ratio_cell
from analysis.stats import paired_ratio

FRACTIONS = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)  # of the baseline's gain (pre-stated, #60)


def levels(runs: list[dict], baseline: str, target: float) -> list[tuple[str, float]]:
    """(name, level) of every target of the curve: each fraction of the gain, then `target`."""
    base = [run for run in runs if run["strategy"] == baseline and run["final"] is not None]
    named = []
    for fraction in FRACTIONS:
        named.append((f"{100 * fraction:g} %", gain_level(base, fraction)))
    named.append(("final", target))
    return named


def at_level(runs: list[dict], baseline: str, level: float,
             continued: bool = False) -> tuple[dict, list[dict]]:
    """(a copy of each run by arm, in the order compare_runs groups them, the baseline's copies
    compare_runs measures against: those with an eval), each copy holding its crossings of `level`
    as the gain target (compare.crossings) and its counters there (cost.at_crossing); measured on
    a run's continued copy where it has one if `continued` (the table's target: its column)."""
    arms = {}
    for run in runs:
        copy = dict(run)  # (crossings sets its keys; the curves are shared, never changed)
        if continued:
            copy |= run.get("continued", {})
        crossings(copy, level, level, math.nan)
        copy["counters_at"] = cost.at_crossing(copy, level)
        arms.setdefault(run["strategy"], []).append(copy)
    return arms, [run for run in arms[baseline] if run["final"] is not None]


def add_curves(table: list[dict], runs: list[dict], baseline: str, target: float) -> None:
    """Each row of compare_runs' table gets its arm's `curve` (a point per target: its level,
    the generated tokens' and total compute's paired ratios) and `gpu_time` (the counters'
    pairs, the time ratios at cost.RATIOS to the table's target, the break-even per target)."""
    for row in table:
        row["curve"] = []
        row["gpu_time"] = {"ratios": [], "break_even": [], "pairs": None}
    for name, level in levels(runs, baseline, target):
        arms, base = at_level(runs, baseline, level, continued=name == "final")
        for row in table:
            arm = arms[row["strategy"]]
            row["curve"].append({"target": name, "level": level,
                                 "generated": paired_ratio(pairs(arm, base, "tokens_to_gain")),
                                 "compute": counted_ratio(arm, base, "compute_to_gain")})
            add_time(row["gpu_time"], name, arm, base)


def add_time(gpu_time: dict, name: str, arm: list[dict], base: list[dict]) -> None:
    """One target's GPU-time figures into an arm's `gpu_time` (NaN when a run logged no token
    passes: runs before #47)."""
    counter_pairs = pairs(arm, base, "counters_at")
    if not all(len(run["passes"]) > 1 for run in arm + base):
        counter_pairs = []
    gpu_time["break_even"].append({"target": name} | cost.break_even(counter_pairs))
    if name != "final":
        return
    gpu_time["pairs"] = counter_pairs  # (bench/plot.py --cost draws the ratio against ρ from them)
    for rho in cost.RATIOS:
        gpu_time["ratios"].append([rho, *cost.time_ratio(counter_pairs, rho, interval=True)])


def curve_markdown(table: list[dict], metric: str, baseline: str) -> str:
    """curve.md: the generated tokens' and total compute's curves, then the GPU-time model."""
    heads = [head(point) for point in table[0]["curve"]]
    lines = [f"# The saving as a curve ({metric}, against {baseline})", "",
             f"Each cell: the arm's median ÷ {baseline}'s, paired 95 % bootstrap interval, "
             f"[verdict at ≤ 0.5× / ≤ 0.3×]; targets: a fraction of {baseline}'s gain in "
             f"{metric}, and its final value.", ""]
    continued = [f"{row['strategy']} ({row['continued']} of {row['seeds']} seeds)"
                 for row in table if row["continued"]]
    if continued:
        lines += ["The final value of these arms is measured on continued copies of their runs "
                  f"(--continued; the other targets on the runs): {', '.join(continued)}.", ""]
    for key, what in (("generated", "Generated tokens"),
                      ("compute", "Total compute (2N·generated + 6N·fwd-bwd + 2N·no-grad)")):
        lines += [f"## {what} to each target", "", "| arm | " + " | ".join(heads) + " |",
                  "|---|" + "---:|" * len(heads)]
        for row in table:
            cells = [ratio_cell(point[key]) for point in row["curve"]]
            lines.append(f"| {row['strategy']} | " + " | ".join(cells) + " |")
        lines.append("")
    level = {point["target"]: point["level"] for point in table[0]["curve"]}
    if not level["100 %"] > level["50 %"]:  # no gain (NaN: no step-0 eval in the metric)
        lines += [f"{baseline} gains nothing in {metric} (or has no step-0 eval in it): the "
                  "fractions of its gain are not targets of a saving.", ""]
    return "\n".join(lines + time_markdown(table, heads))


def time_markdown(table: list[dict], heads: list[str]) -> list[str]:
    """The GPU-time model's two tables: ratios at cost.RATIOS to the table's target, and the
    break-even ρ to every target."""
    rhos = ["⅓ (FLOPs)" if rho < 1 else f"{rho:g}" for rho in cost.RATIOS]
    lines = ["## GPU time: a model computed from CPU runs (analysis/cost.py)", "",
             "time = generated × c_gen + fwd-bwd token passes × c_train + (no-grad passes + "
             "prompt prefill) × c_train / 3, prefill derived from the logged counters; each cell "
             f"the time ratio to {heads[-1]} at ρ = c_gen / c_train, paired 95 % interval.", "",
             "| arm | " + " | ".join(f"ρ = {r}" for r in rhos) + " |",
             "|---|" + "---:|" * len(rhos)]
    for row in table:
        cells = [f"{num(r)} ({interval((lo, hi))})" for _, r, lo, hi in row["gpu_time"]["ratios"]]
        lines.append(f"| {row['strategy']} | " + " | ".join(cells) + " |")
    lines += ["", "Break-even ρ (where the time ratio crosses 1, sought over 0.01 … 1000; the arm "
              "takes less time above or below it):", "",
              "| arm | " + " | ".join(heads) + " |", "|---|" + "---:|" * len(heads)]
    for row in table:
        cells = [even_cell(point) for point in row["gpu_time"]["break_even"]]
        lines.append(f"| {row['strategy']} | " + " | ".join(cells) + " |")
    return lines + [""]


def head(point: dict) -> str:
    """A target's column head: its name and level (none without the baseline's step-0 eval)."""
    if math.isnan(point["level"]):
        return f"{point['target']} (no step-0 eval)"
    return f"{point['target']} ({100 * point['level']:.1f} %)"


def even_cell(point: dict) -> str:
    if math.isnan(point["ratio"]):
        return point["cheaper"]
    return f"{point['ratio']:.2g} (cheaper {point['cheaper']})"


def num(x: float) -> str:
    if math.isnan(x):
        return ""  # (blank: no ratio, as compare_io's cells)
    return "∞" if math.isinf(x) else f"{x:.2f}"


def write_curve(out: Path, table: list[dict], metric: str, baseline: str) -> None:
    """curve.md beside compare.csv."""
    (out / "curve.md").write_text(curve_markdown(table, metric, baseline))
    print(f"wrote {out / 'curve.md'}")
