"""Compare training runs by arm (replay strategy), seeds as the unit of replication.

Usage: python eval.py --compare runs/repro/none-s0 runs/repro/aper-s0 ... --out-dir runs/cmp
  (LABEL=RUN_DIR puts a run in arm LABEL, e.g. half=runs/x/aper-s0; without one, a run's arm is
  read from its config: its replay strategy and methods. Each run counts once; --overwrite
  replaces an earlier comparison in --out-dir. --baseline none,none_lr2x,...: the baseline tuned
  over those arms, analysis/area.py. --continued DIR: the final value measured on copies of the
  runs resumed past their end, `crossings`.)

Primary, per run: the area, held-out accuracy averaged over the first `--budget` generated tokens.
Per arm: its mean, the difference to the baseline, Welch's p, Holm's p over every arm, a verdict
and the difference its seeds could detect at Holm's strictest level. Secondary: final accuracy
(the same tests); generated tokens to the baseline's final accuracy and to a target below its
plateau (90 % of its mean gain), each as the ratio of the arm's median to the baseline's with a
paired bootstrap interval (seeds resampled) and verdicts at 0.5× and 0.3×; the tokens trained on
(the update's compute) to the second target, as the same ratio; the token passes of the update
(forward-backward) and the total compute (`compute`) to the targets, the same; steps to the final
accuracy, O1-Pruner's AES, the eval entropy, tokens and rows trained in all. In one `--metric`:
avg@k (accuracy) or pass@k, maj@k, greedy (analysis/evals.py). Beside the table, curve.md: the
saving to every fraction of the gain (analysis/curve.py) and GPU time as a model (analysis/cost.py).
"""

import argparse
import math
import statistics
from pathlib import Path

from analysis.area import area, budget_of, common_grid, filed_or_refused, tuned, tuned_line
from analysis.compare_io import (arm_versions, compare_table, given_twice, load_run,
                                 out_dir_checked, positive_number, run_arg, write)
from analysis.evals import METRICS, use_metric
from analysis.pooling import incomparable, not_continued
from analysis.stats import (aes, bootstrap, detectable, holm, mean, mean_interval, mean_known,
                            paired_ratio, welch_p)
from support.locks import results_dir
from support.util import OneLineParser, RunError, command_errors


def compute(generated: float, fwd_bwd: float, no_grad: float) -> float:
    """Total compute in units of N FLOPs (N the parameter count, the same in every arm): ≈ 2N per
    generated token, 6N per token of a forward-backward, 2N per token of a no-grad forward. Left
    out: generation's prompt prefill and attention's term in the sequence length."""
    return 2 * generated + 6 * fwd_bwd + 2 * no_grad


def sustained_crossing(curve: list[tuple], target: float) -> float | None:
    """Generated tokens where the eval curve first reaches `target`, interpolated linearly between
    evals, counting a crossing only if every later eval stays ≥ target − its standard error; NaN
    for a NaN target (a baseline without a step-0 eval has no gain target)."""
    if math.isnan(target):
        return math.nan
    for j, (_, x, y, _) in enumerate(curve):
        if y < target or any(y2 < target - se for _, _, y2, se in curve[j + 1 :]):
            continue
        if j == 0 or y <= curve[j - 1][2]:
            return x
        x0, y0 = curve[j - 1][1], curve[j - 1][2]
        return x0 + (target - y0) / (y - y0) * (x - x0)
    return None


def unreached(x: float | None) -> float:
    return math.inf if x is None else x  # (0 is a crossing at the start, not "never")


def seed_mean_curve(runs: list[dict]) -> list[tuple]:
    """(step, step, mean accuracy, its standard error: mean se / √seeds) at every run's evals."""
    at = {}
    for run in runs:
        for step, _, acc, se in run["curve"]:
            at.setdefault(step, []).append((acc, se))
    curve = []
    for step, v in sorted(at.items()):
        if len(v) == len(runs):
            se = mean([e for _, e in v]) / len(v) ** 0.5
            curve.append((step, step, mean([a for a, _ in v]), se))
    return curve


def crossings(run: dict, target: float, gain_target: float, base_tokens: float) -> None:
    """Where `run` first holds each target (set in place): in generated tokens, tokens trained,
    token passes, total compute and steps. The table's target (its final value) is measured on
    the run's continued copy where it has one (--continued): #60's rule for an arm that ends below
    it."""
    run["tokens_to_gain"] = sustained_crossing(run["curve"], gain_target)
    by_trained = [(c[0], run["trained"][c[0]], *c[2:]) for c in run["curve"]
                  if c[0] in run["trained"]]  # the same rule over trained tokens
    run["trained_to_gain"] = sustained_crossing(by_trained, gain_target)
    by_passes = over_passes(run, lambda generated, fwd_bwd, no_grad: fwd_bwd)
    run["passes_to_gain"] = sustained_crossing(by_passes, gain_target)
    run["compute_to_gain"] = sustained_crossing(over_passes(run, compute), gain_target)
    longer = run | run.get("continued", {})  # (its curve and counters)
    crossing = sustained_crossing(longer["curve"], target)
    run["tokens_to_target"] = crossing
    run["tokens_ratio"] = None if crossing is None else crossing / base_tokens
    run["compute_to_target"] = sustained_crossing(over_passes(longer, compute), target)
    by_step = [(c[0], c[0], c[2], c[3]) for c in longer["curve"]]  # the same rule in steps
    run["steps_to_target"] = sustained_crossing(by_step, target)


def over_passes(run: dict, x) -> list[tuple]:
    """The run's eval curve at the evals that logged the token passes (runs before #47: none), over
    x(generated tokens, forward-backward token passes, no-grad token passes): total compute, say."""
    counted = [c for c in run["curve"] if c[0] in run["passes"]]
    return [(c[0], x(c[1], *run["passes"][c[0]]), *c[2:]) for c in counted]


def compare_runs(runs: list[dict], baseline: str, target: float | None,
                 budget: float | str | None, gain_fraction: float = 0.9):
    """(per-arm rows, target, budget) against the `baseline` runs, whose mean final accuracy is the
    default target (budget: analysis/area.budget_of). The second target, below the plateau
    the baseline's own seeds cross only near their end: its mean initial accuracy plus
    `gain_fraction` of its mean gain (each row's `gain_target`)."""
    filed_or_refused(runs, [baseline])
    base = [run for run in runs if run["strategy"] == baseline and run["final"] is not None]
    if not base:
        raise ValueError(f"no run of the baseline {baseline!r} has an eval (--baseline names it)")
    L_b, A_b, T_b = (mean([run[k] for run in base]) for k in ("length", "final", "tokens"))
    T_b = T_b or math.nan  # a baseline that generated nothing: no ratio to its total
    target = A_b if target is None else target
    gain_target = gain_level(base, gain_fraction)
    budget = budget_of(runs, base, budget)
    common_grid(runs + [run["continued"] for run in runs if "continued" in run])
    arms = {}
    for run in runs:
        crossings(run, target, gain_target, T_b)
        run["aes"] = math.nan
        if run["final"] is not None and run["length"] is not None:
            run["aes"] = aes(run["length"], run["final"], L_b, A_b)
        run["area"] = area(run["curve"], budget)
        arms.setdefault(run["strategy"], []).append(run)
    crossing = sustained_crossing(seed_mean_curve(base), target)
    steps_b = unreached(crossing) or math.nan  # a baseline at the target from step 0: no ratio
    level = 0.05 / max(1, len(arms) - 1)  # Holm's first step over the tested arms
    table = [arm_row(baseline, arms.pop(baseline), base, steps_b, tested=False)]
    for name in sorted(arms):
        table.append(arm_row(name, arms[name], base, steps_b, tested=True, level=level))
    for row in table:
        row["gain_target"] = gain_target
    for key in ("area_p", "p_vs_base"):
        for row, p in zip(table, holm([row[key] for row in table])):
            row[key + "_holm"] = p
    table[0]["verdict"] = "baseline"
    for row in table[1:]:
        row["verdict"] = "undecided"
        if row["area_p_holm"] < 0.05:  # (never for NaN)
            row["verdict"] = "better" if row["area_diff"] > 0 else "worse"
    return table, target, budget


def gain_level(base: list[dict], fraction: float) -> float:
    """The baseline runs' mean initial value (over those with a step-0 eval: NaN when none has
    one) plus `fraction` of their mean gain to their mean final value: the gain target, and each
    point of the saving curve (analysis/curve.py)."""
    initial = mean([run["curve"][0][2] for run in base if run["curve"][0][0] == 0])
    final = mean([run["final"] for run in base])
    return initial + fraction * (final - initial)


def arm_row(name: str, runs: list[dict], base: list[dict], steps_b: float, tested: bool,
            level: float = 0.05) -> dict:
    """One arm's row of the table, tested against the baseline's runs `base` if `tested`; the
    detectable difference at `level`."""
    acc = [run["final"] for run in runs if run["final"] is not None]
    areas = [run["area"] for run in runs if run["area"] is not None]
    base_areas = [run["area"] for run in base if run["area"] is not None]
    ratios = [unreached(run["tokens_ratio"]) for run in runs]
    steps = [unreached(run["steps_to_target"]) / steps_b for run in runs]
    aes_v = [run["aes"] for run in runs if not math.isnan(run["aes"])]
    entropy = [run["entropy"] for run in runs]
    return {"strategy": name, "seeds": len(runs), "area_n": len(areas), "area_mean": mean(areas),
            "area_ci": mean_interval(areas),
            "area_diff": mean(areas) - mean(base_areas) if tested else math.nan,
            "area_p": welch_p(areas, base_areas) if tested else math.nan,
            "detectable": detectable(areas, base_areas, level) if tested else math.nan,
            "acc_mean": mean(acc), "acc_ci": mean_interval(acc),
            "p_vs_base": welch_p(acc, [run["final"] for run in base]) if tested else math.nan,
            "ratios": ratios, "ratio_median": statistics.median(ratios),
            "ratio_ci": bootstrap(ratios), "reached": sum(math.isfinite(x) for x in ratios),
            "to_target": paired_ratio(pairs(runs, base, "tokens_to_target")),
            "to_gain": paired_ratio(pairs(runs, base, "tokens_to_gain")),
            "trained_to_gain": counted_ratio(runs, base, "trained_to_gain", "trained"),
            "passes_to_gain": counted_ratio(runs, base, "passes_to_gain"),
            "compute_to_gain": counted_ratio(runs, base, "compute_to_gain"),
            "compute_to_target": counted_ratio(runs, base, "compute_to_target"),
            "steps_ratio": statistics.median(steps), "steps_ratio_ci": bootstrap(steps),
            "aes_mean": mean(aes_v),
            "aes_ci": bootstrap(aes_v, statistics.fmean) if aes_v else (math.nan, math.nan),
            "entropy": math.nan if None in entropy else mean(entropy),
            "tokens": mean([run["tokens"] for run in runs]),
            "trained_tokens": mean_known([run["trained_tokens"] for run in runs]),
            "trained_rows": mean_known([run["trained_rows"] for run in runs]),
            "versions": arm_versions(runs),
            "continued": sum("continued" in run for run in runs)}  # runs with a copy (--continued)



def pairs(runs: list[dict], base: list[dict], key: str) -> list[tuple[float, float]]:
    """(the run's, the baseline run's) `key` for each seed both have; inf where never reached."""
    by_seed = {run["seed"]: run for run in base}
    return [(unreached(run[key]), unreached(by_seed[run["seed"]][key]))
            for run in runs if run["seed"] in by_seed]


def counted_ratio(runs: list[dict], base: list[dict], key: str, log: str = "passes") -> tuple:
    """The paired ratio of `key`, or NaNs when a run logged no `log` (trained tokens: runs before
    #42; token passes: before #47)."""
    if not all(len(run[log]) > 1 for run in runs + base):
        return (math.nan,) * 3
    return paired_ratio(pairs(runs, base, key))


def parser(prog: str) -> OneLineParser:
    """The command line of the comparison (eval.py --compare: `prog` eval.py)."""
    ap = OneLineParser(prog=prog, description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", metavar="[LABEL=]RUN_DIR", help="run folders")
    ap.add_argument("--out-dir", default="eval_results/compare", help="where the tables go")
    ap.add_argument("--baseline", default="none", help="the arm the others are measured against, "
                    "or arms to tune it over, comma-separated: the one of highest mean area in "
                    "avg@k at the budget (by default the first arm's) is the baseline")
    ap.add_argument("--target", type=float, help="accuracy (0-1) for tokens to target (default: "
                    "the baseline's mean final accuracy)")
    ap.add_argument("--gain-fraction", type=float, default=0.9, help="the second target: the "
                    "baseline's initial accuracy plus this fraction of its mean gain")
    ap.add_argument("--metric", choices=list(METRICS), default="accuracy", help="the eval "
                    "curve compared: avg@k (accuracy), pass@k, maj@k or greedy (analysis/evals.py)")
    ap.add_argument("--budget", help="generated tokens the area covers, or `shortest`: the "
                    "smallest total of the finished runs (default: of the baseline's runs)")
    ap.add_argument("--continued", metavar="DIR", help="continued copies of runs, each named "
                    "as its run's folder (the run resumed past its last step): the table's "
                    "target, its final value, is measured on the copy (#60's rule for an arm "
                    "that ends below it); every other figure on the run")
    ap.add_argument("--allow-mixed", action="store_true", help="pool the runs of an arm even "
                    "when their configs differ beyond the seed (see UNCOMPARED)")
    ap.add_argument("--overwrite", action="store_true", help="replace an earlier comparison in "
                    "--out-dir")
    ap.add_argument("--debug", action="store_true", help="bad input shows its traceback")
    return ap


def main(argv: list[str] | None = None, prog: str = "compare.py") -> None:
    args = parser(prog).parse_args(argv)
    from analysis.curve import add_curves, write_curve  # (it builds on this module's functions)

    with command_errors(f"{prog}: ", args.debug, (OSError, ValueError, RunError)):
        out_dir_checked(args.out_dir, args.overwrite)
        results_dir(Path(args.out_dir))  # never into a run's root: --resume would refuse the run
        if args.target is not None and not 0 <= args.target <= 1:  # (NaN is not)
            raise ValueError(f"--target must be an accuracy in [0, 1], got {args.target}")
        budget = args.budget
        if budget not in (None, "shortest"):
            budget = positive_number(budget)
        arms = args.baseline.split(",")
        runs = loaded_runs(args.runs, arms[0], args.allow_mixed, args.continued)
        if not 0 < args.gain_fraction <= 1:  # (NaN is not)
            raise ValueError(f"--gain-fraction must be in (0, 1], got {args.gain_fraction}")
        baseline, areas = arms[0], {}
        if len(arms) > 1:
            baseline, areas, budget = tuned(runs, arms, budget)
            print(tuned_line(baseline, areas, budget))
        runs, unlogged = use_metric(runs, args.metric, baseline)
        table, target, budget = compare_runs(runs, baseline, args.target, budget,
                                             args.gain_fraction)
        add_curves(table, runs, baseline, target)
        print(compare_table(table, target, budget, baseline))
        if args.metric != "accuracy":
            print(f"\nin {args.metric}: the area, final value and targets above (its own "
                  "verdicts, Holm's correction over the arms)")
        if unlogged:
            print(f"\nleft out (no eval/{args.metric} logged): {', '.join(unlogged)}")
        short = [run["path"] for run in runs if run["area"] is None]
        if short:
            print(f"\nnot in the area (short of the {budget:,.0f}-token budget, which --budget "
                  f"sets, or no step-0 eval): {', '.join(short)}")
        write(Path(args.out_dir), runs, {"target": target, "gain_target": table[0]["gain_target"],
                                         "gain_fraction": args.gain_fraction, "budget": budget,
                                         "metric": args.metric, "baseline": baseline,
                                         "tuned_over": areas, "strategies": table})
        write_curve(Path(args.out_dir), table, args.metric, baseline)


def loaded_runs(names: list[str], baseline: str, allow_mixed: bool,
                continued: str | None = None) -> list[dict]:
    """The runs `names` gives ([LABEL=]RUN_DIR), each of its label's arm or its config's, with
    its copy in `continued` (with_continued); a ValueError for a folder given twice, or for an arm
    whose runs' configs differ beyond the seed (unless `allow_mixed`)."""
    labelled = [run_arg(name) for name in names]
    twice = given_twice([folder for _, folder in labelled])
    if twice:
        raise ValueError(twice)
    runs = []
    for label, folder in labelled:
        run = load_run(folder) | {"labelled": label is not None}
        if label:
            run["strategy"] = label
        runs.append(run)
    mixed = incomparable(runs, baseline)
    if mixed and not allow_mixed:
        raise ValueError(mixed)
    if continued is not None:
        print(with_continued(runs, continued))
    for run in runs:
        run.pop("config")
        run.pop("labelled")
    return runs


def with_continued(runs: list[dict], folder: str) -> str:
    """Each run whose folder name `folder` holds too (a copy of the run resumed past its last
    step: `--resume --max_steps=300` in #60) gets the copy's curves and counters as
    run["continued"] and its path as run["continued_from"]; returns a line naming them. A
    ValueError for a copy that is not its run continued (pooling.not_continued), or for a folder
    with no copy of any run."""
    if not Path(folder).is_dir():
        raise ValueError(f"--continued {folder}: not a folder")
    arms = {}
    for run in runs:
        path = Path(folder) / Path(run["path"]).name
        if not path.is_dir():
            continue
        copy = load_run(path)
        why = not_continued(run, copy)
        if why:
            raise ValueError(why)
        run["continued"] = {key: copy[key] for key in ("curves", "trained", "passes")}
        run["continued_from"] = str(path)
        arms.setdefault(run["strategy"], []).append(run["seed"])
    if not arms:
        raise ValueError(f"--continued {folder}: no copy of a compared run there (a copy is named "
                         "as its run's folder)")
    seeds = [f"{arm} (seeds {', '.join(map(str, s))})" for arm, s in arms.items()]
    return f"the final value's crossings on continued copies in {folder}: {'; '.join(seeds)}"


if __name__ == "__main__":
    main()
