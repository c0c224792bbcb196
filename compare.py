"""Compare training runs by arm (replay strategy), seeds as the unit of replication.

Usage: python compare.py runs/repro/none-s0 runs/repro/aper-s0 ... --out-dir runs/repro/compare
  (or python eval.py --compare ...; LABEL=RUN_DIR puts a run in arm LABEL, e.g. half=runs/x/aper-s0)

Primary, per run: the area, held-out accuracy averaged over the first `--budget` generated tokens.
Per arm: its mean, the difference to the baseline, Welch's p, Holm's p over every arm, a verdict
and the difference its seeds could detect. Secondary: final accuracy (the same tests), tokens and
steps to the baseline's final accuracy, O1-Pruner's AES, the eval entropy.
"""

import argparse
import csv
import itertools
import json
import math
import random
import statistics
import sys
from pathlib import Path

import mpmath

from data.loaders import json_line, jsonl_rows, open_regular, read_yaml_file

FIELDS = ["path", "strategy", "seed", "final", "length", "tokens", "entropy", "tokens_to_target",
          "tokens_ratio", "steps_to_target", "aes", "area"]


def load_run(path: str | Path) -> dict:
    """A run folder: arm (`dynamic`: none with rollout.dynamic_sampling; `epochs2`: none with
    optim.epochs = 2, `epochs4+gate` with optim.gate), seed, final figures, eval curve
    [(step, generated tokens, accuracy, standard error)]; step 0 after RLEP's phase I."""
    path = Path(path)
    summary, config, rows = read_run(path)
    rows = rows or [{}]  # an empty row: no eval, nothing generated
    strategy = summary.get("strategy") or (config.get("replay") or {}).get("strategy")
    if strategy is None:
        raise ValueError(f"{path}: no replay strategy in summary.json or config.yaml")
    if (config.get("rollout") or {}).get("dynamic_sampling"):  # its own arm, never the baseline
        strategy = "dynamic" if strategy == "none" else f"{strategy}+dynamic"
    optim = config.get("optim") or {}
    if optim.get("epochs", 1) > 1:  # reuse too: epochs2, epochs4+gate, aper+epochs2
        tag = f"epochs{optim['epochs']}" + "+gate" * bool(optim.get("gate"))
        strategy = tag if strategy == "none" else f"{strategy}+{tag}"
    phase1 = rows[0].get("tokens/generated_total", 0) - rows[0].get("generated_tokens", 0)
    curve = [(0, phase1, summary.get("eval_accuracy_initial"), 0.0)]
    for r in rows:
        tokens = r.get("tokens/generated_total", r.get("generated_tokens"))
        curve.append((r.get("step"), tokens, r.get("eval/accuracy"), r.get("eval/accuracy_se", 0)))
    curve = [c for c in curve if c[2] is not None]
    last = rows[-1]  # an unfinished run's figures
    seed = summary.get("seed", config.get("seed"))
    return {"path": str(path), "strategy": strategy, "seed": seed, "curve": curve,
            "final": curve[-1][2] if curve else None,
            "length": summary.get("eval_response_len_final", last.get("eval/response_len")),
            "tokens": summary.get("tokens_generated_total", tokens),
            "entropy": summary.get("eval_entropy_final", last.get("eval/entropy"))}


NUMBER = (int, float)
SUMMARY = {"strategy": str, "seed": int, "eval_accuracy_initial": NUMBER,
           "eval_response_len_final": NUMBER, "tokens_generated_total": NUMBER,
           "eval_entropy_final": NUMBER}  # the fields load_run reads; null allowed
ROW = {"step": int, "generated_tokens": NUMBER, "tokens/generated_total": NUMBER,
       "eval/accuracy": NUMBER, "eval/accuracy_se": NUMBER, "eval/response_len": NUMBER,
       "eval/entropy": NUMBER}


def read_run(path: Path) -> tuple[dict, dict, list[dict]]:
    """(summary.json, config.yaml, metrics.jsonl rows) of a run folder: one of summary and metrics
    at least. Only regular files are read, under size and depth bounds, and every field load_run
    uses is checked: ValueError naming the file (and line) otherwise."""
    files = {name: path / name for name in ("summary.json", "config.yaml", "metrics.jsonl")}
    if not files["metrics.jsonl"].exists() and not files["summary.json"].exists():
        raise FileNotFoundError(f"{path}: not a run folder (no metrics.jsonl or summary.json)")
    summary, config, numbered = {}, {}, []
    if files["summary.json"].exists():
        with open_regular(files["summary.json"], 1 << 20) as f:
            summary = json_line(f.read(), files["summary.json"], 1) or {}
        check_fields(summary, SUMMARY, str(files["summary.json"]))
    if files["config.yaml"].exists():
        config = read_yaml_file(files["config.yaml"]) or {}
        sections = isinstance(config, dict) and all(
            isinstance(config.get(k, {}), dict) for k in ("replay", "rollout"))
        if not sections:
            raise ValueError(f"{files['config.yaml']}: not a run's config (a mapping with replay "
                             "and rollout sections)")
    if files["metrics.jsonl"].exists():
        numbered = jsonl_rows(files["metrics.jsonl"])
    for lineno, row in numbered:
        check_fields(row, ROW, f"{files['metrics.jsonl']}:{lineno}")
        if row.get("step") is None or row.get("generated_tokens") is None:
            where = f"{files['metrics.jsonl']}:{lineno}"
            raise ValueError(f"{where}: a row without step or generated_tokens")
    return summary, config, [row for _, row in numbered]


def check_fields(row: dict, schema: dict, where: str) -> None:
    """ValueError naming `where` and the field, for a field of `schema` in `row` of another type
    (null is allowed; a bool is not a number)."""
    for key, types in schema.items():
        value = row.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, types)):
            want = "a number" if types is NUMBER else types.__name__
            raise ValueError(f"{where}: {key} must be {want}, got {json.dumps(value)[:40]}")


def area(curve: list[tuple], budget: float) -> float | None:
    """Mean accuracy over the first `budget` generated tokens: the trapezoid rule between evals,
    the accuracy at the budget interpolated linearly, the initial accuracy while RLEP's phase I
    generates (the policy is the initial one). None, never extrapolated, if the run ends short of
    the budget or lacks a step-0 eval."""
    if not curve or curve[0][0] != 0 or curve[-1][1] < budget:
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


def sustained_crossing(curve: list[tuple], target: float) -> float | None:
    """Generated tokens where the eval curve first reaches `target`, interpolated linearly between
    evals, counting a crossing only if every later eval stays ≥ target − its standard error."""
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
    for r in runs:
        for step, _, acc, se in r["curve"]:
            at.setdefault(step, []).append((acc, se))
    curve = []
    for step, v in sorted(at.items()):
        if len(v) == len(runs):
            se = mean([e for _, e in v]) / len(v) ** 0.5
            curve.append((step, step, mean([a for a, _ in v]), se))
    return curve


def aes(L, A, L_b, A_b, alpha: float = 1.0, beta: float = 3.0, gamma: float = 5.0) -> float:
    """O1-Pruner's accuracy-efficiency score of (length L, accuracy A) against a baseline
    (L_b, A_b): shorter is rewarded by alpha, a gain by beta, a loss by gamma. NaN if L_b or A_b
    is 0."""
    if L_b <= 0 or A_b <= 0:
        return math.nan
    dA = (A - A_b) / A_b
    return alpha * (L_b - L) / L_b + (beta if dA >= 0 else gamma) * dA


def bootstrap(values: list[float], stat=statistics.median) -> tuple[float, float]:
    """95 % percentile bootstrap interval of `stat` over `values` (seeds), linear between neighbours
    (inf stays inf): every resample when there are ≤ 6 values, else 20,000 with a fixed seed."""
    draws = itertools.product(values, repeat=len(values))
    if len(values) > 6:
        rng = random.Random(0)
        draws = (rng.choices(values, k=len(values)) for _ in range(20_000))
    stats = sorted(map(stat, draws))
    bounds = []
    for q in (0.025, 0.975):
        i, f = divmod(q * (len(stats) - 1), 1)
        a, b = stats[int(i)], stats[min(int(i) + 1, len(stats) - 1)]
        bounds.append(a if f == 0 or a == b else a + f * (b - a))
    return bounds[0], bounds[1]


def t_sf(t: float, df: float) -> float:
    """P(T > t) for Student's t with `df` degrees of freedom (regularized incomplete beta)."""
    p = 0.5 * float(mpmath.betainc(df / 2, 0.5, 0, df / (df + t * t), regularized=True))
    return p if t >= 0 else 1 - p


def t_quantile(p: float, df: float) -> float:
    """The p-quantile (p ≥ 0.5) of Student's t with `df` degrees of freedom, by bisection."""
    lo, hi = 0.0, 1e3
    for _ in range(100):
        mid = (lo + hi) / 2
        if t_sf(mid, df) < 1 - p:
            hi = mid
        else:
            lo = mid
    return hi


def mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else math.nan


def mean_interval(xs: list[float]) -> tuple[float, float]:
    """95 % Student-t interval of the mean."""
    if len(xs) < 2:
        return math.nan, math.nan
    half = t_quantile(0.975, len(xs) - 1) * statistics.stdev(xs) / len(xs) ** 0.5
    return mean(xs) - half, mean(xs) + half


def welch(a: list[float], b: list[float]) -> tuple[float, float]:
    """Standard error of mean(a) − mean(b) and its Welch–Satterthwaite degrees of freedom."""
    if len(a) < 2 or len(b) < 2:
        return math.nan, math.nan
    va = statistics.variance(a) / len(a)
    vb = statistics.variance(b) / len(b)
    if va + vb == 0:
        return 0.0, math.nan
    return math.sqrt(va + vb), (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))


def welch_p(a: list[float], b: list[float]) -> float:
    """Two-sided p-value of Welch's t-test that the means of `a` and `b` differ."""
    se, df = welch(a, b)
    if not se > 0:  # NaN: too few values; 0: no spread
        return math.nan if math.isnan(se) else float(mean(a) == mean(b))
    return 2 * t_sf(abs(mean(a) - mean(b)) / se, df)


def detectable(a: list[float], b: list[float]) -> float:
    """The smallest difference of means that Welch's two-sided test at α = 0.05 finds with 80 %
    power, from the samples' own SDs s and sizes n: (t_{0.975,ν} + t_{0.8,ν}) · SE, where
    SE = √(s_a²/n_a + s_b²/n_b) and ν is Welch's degrees of freedom. This is the normal
    approximation (z_{0.975} + z_{0.8}) · SE with t quantiles, as a few seeds estimate the SDs."""
    se, df = welch(a, b)
    if not se > 0:
        return math.nan
    return (t_quantile(0.975, df) + t_quantile(0.8, df)) * se


def holm(ps: list[float]) -> list[float]:
    """Holm's step-down adjustment (NaN: no test, not counted in m): with p_(1) ≤ … ≤ p_(m),
    adjusted p_(i) = max over j ≤ i of min(1, (m − j + 1) p_(j))."""
    order = sorted((i for i, p in enumerate(ps) if not math.isnan(p)), key=lambda i: ps[i])
    adjusted = [math.nan] * len(ps)
    running = 0.0
    for j, i in enumerate(order):  # j = rank − 1, so m − j is (m − rank + 1)
        running = max(running, min(1.0, (len(order) - j) * ps[i]))
        adjusted[i] = running
    return adjusted


def compare_runs(runs: list[dict], baseline: str = "none", target: float | None = None,
                 aes_weights=(1.0, 3.0, 5.0), budget: float | None = None):
    """(per-run rows, per-arm rows, target, budget) against the `baseline` runs, whose mean final
    accuracy and mean total generated tokens are the default target and budget."""
    base = [r for r in runs if r["strategy"] == baseline and r["final"] is not None]
    if not base:
        raise ValueError(f"no run of the baseline {baseline!r} has an eval (--baseline names it)")
    L_b, A_b, T_b = (mean([r[k] for r in base]) for k in ("length", "final", "tokens"))
    target = A_b if target is None else target
    budget = T_b if budget is None else budget
    arms = {}
    for r in runs:
        r["tokens_to_target"] = sustained_crossing(r["curve"], target)
        r["tokens_ratio"] = None
        if r["tokens_to_target"] is not None:
            r["tokens_ratio"] = r["tokens_to_target"] / T_b
        by_step = [(c[0], c[0], c[2], c[3]) for c in r["curve"]]  # the same rule in steps
        r["steps_to_target"] = sustained_crossing(by_step, target)
        r["aes"] = math.nan
        if r["final"] is not None and r["length"] is not None:
            r["aes"] = aes(r["length"], r["final"], L_b, A_b, *aes_weights)
        r["area"] = area(r["curve"], budget)
        arms.setdefault(r["strategy"], []).append(r)
    steps_b = unreached(sustained_crossing(seed_mean_curve(base), target))
    summary = []
    for name in sorted(arms, key=lambda s: (s != baseline, s)):  # the baseline first
        summary.append(arm_row(name, arms[name], base, steps_b, name != baseline))
    for key in ("area_p", "p_vs_base"):
        for s, p in zip(summary, holm([s[key] for s in summary])):
            s[key + "_holm"] = p
    for s in summary:
        s["verdict"] = "undecided" if s["strategy"] != baseline else "baseline"
        if s["area_p_holm"] < 0.05:  # (never for NaN)
            s["verdict"] = "better" if s["area_diff"] > 0 else "worse"
    return runs, summary, target, budget


def arm_row(name: str, runs: list[dict], base: list[dict], steps_b: float, other: bool) -> dict:
    """One arm's row of the table, tested against the baseline's runs `base` if `other`."""
    acc = [r["final"] for r in runs if r["final"] is not None]
    areas = [r["area"] for r in runs if r["area"] is not None]
    base_areas = [r["area"] for r in base if r["area"] is not None]
    ratios = [unreached(r["tokens_ratio"]) for r in runs]
    steps = [unreached(r["steps_to_target"]) / steps_b if steps_b > 0 else math.nan for r in runs]
    aes_v = [r["aes"] for r in runs if not math.isnan(r["aes"])]
    entropy = [r["entropy"] for r in runs]
    return {"strategy": name, "seeds": len(runs), "area_n": len(areas), "area_mean": mean(areas),
            "area_ci": mean_interval(areas),
            "area_diff": mean(areas) - mean(base_areas) if other else math.nan,
            "area_p": welch_p(areas, base_areas) if other else math.nan,
            "detectable": detectable(areas, base_areas) if other else math.nan,
            "acc_mean": mean(acc), "acc_ci": mean_interval(acc),
            "p_vs_base": welch_p(acc, [r["final"] for r in base]) if other else math.nan,
            "ratios": ratios, "ratio_median": statistics.median(ratios),
            "ratio_ci": bootstrap(ratios), "reached": sum(math.isfinite(x) for x in ratios),
            "steps_ratio": statistics.median(steps), "steps_ratio_ci": bootstrap(steps),
            "aes_mean": mean(aes_v),
            "aes_ci": bootstrap(aes_v, statistics.fmean) if aes_v else (math.nan, math.nan),
            "entropy": math.nan if None in entropy else mean(entropy),
            "tokens": mean([r["tokens"] for r in runs])}


def compare_table(summary: list[dict], target: float, budget: float, baseline: str = "none") -> str:
    """The markdown table: the area, final accuracy, then the secondary columns."""
    crossing = f"tokens to {100 * target:.1f}% ÷ {baseline}'s: median (95% CI) [per seed]"
    columns = ["strategy", "seeds", f"area to {budget:,.0f} tokens % (95% CI) [runs]", "Δ pp",
               "p", "Holm p", "verdict", "detectable Δ pp (80% power)", "final acc % (95% CI)",
               "p", "Holm p", crossing, "reached", f"steps to it ÷ {baseline}'s (95% CI)",
               "AES (95% CI)", "eval entropy", "tokens generated"]
    lines = ["| " + " | ".join(columns) + " |", "|---|" + "---:|" * (len(columns) - 1)]
    for s in summary:
        ratio = "never reached" if math.isinf(s["ratio_median"]) else f"{s['ratio_median']:.2f}"
        seeds = " / ".join("–" if math.isinf(x) else f"{x:.2f}" for x in s["ratios"])
        area_ci = interval(*s["area_ci"], 100, ".1f")
        cells = [s["strategy"], s["seeds"],
                 f"{100 * s['area_mean']:.1f} ({area_ci}) [{s['area_n']}]",
                 num(s["area_diff"], "+.1f", 100), num(s["area_p"]), num(s["area_p_holm"]),
                 s["verdict"], num(s["detectable"], ".1f", 100),
                 f"{100 * s['acc_mean']:.1f} ({interval(*s['acc_ci'], 100, '.1f')})",
                 num(s["p_vs_base"]), num(s["p_vs_base_holm"]),
                 f"{ratio} ({interval(*s['ratio_ci'])}) [{seeds}]",
                 f"{s['reached']}/{s['seeds']}",
                 f"{s['steps_ratio']:.2f} ({interval(*s['steps_ratio_ci'])})",
                 f"{s['aes_mean']:.3f} ({interval(*s['aes_ci'], fmt='.3f')})",
                 f"{s['entropy']:.3f}", f"{s['tokens']:.3g}"]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def interval(lo: float, hi: float, scale: float = 1.0, fmt: str = ".2f") -> str:
    return "–".join("∞" if math.isinf(x) else f"{scale * x:{fmt}}" for x in (lo, hi))


def num(x: float, fmt: str = ".2g", scale: float = 1.0) -> str:
    return "" if math.isnan(x) else f"{scale * x:{fmt}}"  # blank: no test


def main(argv: list[str] | None = None, prog: str = "compare.py") -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", metavar="[LABEL=]RUN_DIR", help="run folders")
    ap.add_argument("--out-dir", default="eval_results/compare", help="where the tables go")
    ap.add_argument("--baseline", default="none", help="the arm the others are measured against")
    ap.add_argument("--target", type=float, help="accuracy (0-1) for tokens to target (default: "
                    "the baseline's mean final accuracy)")
    ap.add_argument("--budget", type=float, help="generated tokens the area covers (default: the "
                    "baseline's mean total)")
    ap.add_argument("--aes-weights", type=float, nargs=3, default=[1.0, 3.0, 5.0],
                    metavar=("A", "B", "G"), help="AES's length, gain and loss weights")
    ap.add_argument("--debug", action="store_true", help="bad input shows its traceback")
    args = ap.parse_args(argv)
    try:
        if args.budget is not None and not args.budget > 0:
            raise ValueError(f"--budget must be > 0, got {args.budget}")
        runs = []
        for d in args.runs:
            label, sep, folder = d.partition("=")
            if sep and "/" not in label:  # LABEL=RUN_DIR names the arm
                runs.append(load_run(folder) | {"strategy": label})
            else:
                runs.append(load_run(d))
        rows, summary, target, budget = compare_runs(runs, args.baseline, args.target,
                                                     args.aes_weights, args.budget)
        print(compare_table(summary, target, budget, args.baseline))
        short = [r["path"] for r in rows if r["area"] is None]
        if short:
            print(f"\nnot in the area (short of the {budget:,.0f}-token budget, which --budget "
                  f"sets, or no step-0 eval): {', '.join(short)}")
        write(Path(args.out_dir), rows, {"target": target, "budget": budget, "strategies": summary})
    except (OSError, ValueError) as e:
        if args.debug:
            raise
        print(f"{prog}: error: {' '.join(str(e).split())}", file=sys.stderr)
        raise SystemExit(2) from None


def write(out: Path, rows: list[dict], result: dict) -> None:
    """compare.csv (per run; the area blank where left out) and compare.json (per arm, per run)."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "compare.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    (out / "compare.json").write_text(json.dumps(result | {"runs": rows}, indent=1))
    print(f"\nwrote {out / 'compare.csv'} and {out / 'compare.json'}")


if __name__ == "__main__":
    main()
