"""Plot a comparison's compare.json (eval.py --compare): its accuracy curves, or its GPU-time model.

Usage:
  python bench/plot.py runs/repro/compare/compare.json docs/tiny_replay_arms_compare.png
  python bench/plot.py runs/cmp/compare.json docs/tiny_fair_cost.png --cost
  python bench/plot.py runs/cmp/compare.json out.png --cost --gpu docs/gpu/h100/gpu_run_2.json

Accuracy (the default): per arm the seed mean with its 95 % t interval as a band, on the token
range every seed covers (seeds evaluate at different token counts, so each curve is interpolated
onto one grid), in a colour of its own. Curves start at 0 tokens, flat at the step-0 accuracy while
RLEP's phase I generates, as the area counts them (captioned); the dashed line marks the area's
budget, the dotted and dash-dotted ones the two targets, with their values. A second panel gives
each arm's area with its interval.

--cost (analysis/cost.py's model, computed from CPU runs): each arm's time to the table's target ÷
the baseline's, against ρ = c_gen / c_train from 1/3 to 30; per arm its ratio of median times,
recomputed on a fine grid of ρ from the counters (gpu_time.pairs), its 95 % paired intervals at
cost.RATIOS as bars, its break-even ρ as a dot on the line at 1. Dotted verticals: the ratios
measured on a GPU (--gpu, a bench/gpu_run.py record): the default path, the warm update's tokens/s
÷ a whole rollout's useful tokens/s (whose time holds its prefill too), and the compiled decode
step, the update's ÷ the `static_packed` decode step's (every row live, no prefill).
Needs matplotlib (bench/requirements.txt).
"""

import json
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from analysis.cost import RATIOS, measured_ratios, time_ratio
from analysis.stats import t_quantile
from bench import cli

REPO = Path(__file__).resolve().parents[1]


def pyplot():
    """matplotlib's pyplot, drawing to files (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def seed_curves(runs: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """(grid, accuracies (seeds, 200)) over the token range every run covers."""
    curves = []
    for r in runs:
        xy = np.array(r["curve"], dtype=float)[:, 1:3]  # (evals, 2): tokens, accuracy
        if r["curve"][0][0] == 0:
            xy = np.vstack([[0.0, xy[0, 1]], xy])  # phase I: the initial policy's accuracy
        curves.append(xy.T)
    lo = max(x[0] for x, _ in curves)
    hi = min(x[-1] for x, _ in curves)
    grid = np.linspace(lo, max(lo, hi), 200)
    return grid, np.stack([np.interp(grid, x, y) for x, y in curves])


def colours(n: int) -> list:
    """n distinct colours: tab10 up to 10 arms; up to 20, tab20's ten dark shades (tab10's colours)
    and then its light ones, so that no two of the first ten arms share a hue; then a continuous
    map."""
    plt = pyplot()
    if n <= 20:
        order = [*range(0, 20, 2), *range(1, 20, 2)]  # tab20 pairs a dark and a light shade
        return [plt.get_cmap("tab20")(order[i]) for i in range(n)]
    return [plt.get_cmap("turbo")(i / (n - 1)) for i in range(n)]


def plot(compare: dict, path: str) -> None:
    """Left: each arm's seed-mean accuracy against generated tokens with its 95 % band, the area's
    budget and both targets labelled with their values. Right: each arm's area (mean accuracy
    over the budget) with its 95 % interval, the baseline's as a line."""
    plt = pyplot()
    arms = compare["strategies"]  # the baseline first, as the table
    colour = dict(zip([a["strategy"] for a in arms], colours(len(arms))))
    fig, (ax, bars) = plt.subplots(1, 2, figsize=(13, 5.5), width_ratios=[2.2, 1])
    for arm in arms:
        runs = [r for r in compare["runs"] if r["strategy"] == arm["strategy"] and r["curve"]]
        if not runs:
            continue
        grid, ys = seed_curves(runs)
        mean = 100 * ys.mean(0)
        c = colour[arm["strategy"]]
        ax.plot(grid, mean, color=c, label=f"{arm['strategy']} (n={len(runs)})")
        if len(runs) > 1:
            half = 100 * t_quantile(0.975, len(runs) - 1) * ys.std(0, ddof=1) / len(runs) ** 0.5
            ax.fill_between(grid, mean - half, mean + half, color=c, alpha=0.15)
    budget = f"area budget ({compare['budget']:,.0f} tokens)"
    ax.axvline(compare["budget"], color="black", linestyle="--", label=budget)
    target = f"target: {arms[0]['strategy']}'s final accuracy, {100 * compare['target']:.1f} %"
    ax.axhline(100 * compare["target"], color="grey", linestyle=":", label=target)
    if "gain_target" in compare:
        share = 100 * compare.get("gain_fraction", 0.9)
        gain = f"gain target: {share:.0f} % of its gain, {100 * compare['gain_target']:.1f} %"
        ax.axhline(100 * compare["gain_target"], color="grey", linestyle="-.", label=gain)
    ax.set(xlabel="generated tokens (phase I and dynamic-sampling rounds included)",
           ylabel="held-out accuracy (%)",
           title="eval accuracy vs generation cost (band: 95% t interval of the seed mean)")
    ax.legend(fontsize=7, ncol=2)
    area_panel(bars, arms, colour)
    if any(a["strategy"].startswith("rlep") for a in arms):
        fig.text(0.01, 0.01, "rlep starts flat: its curve holds the initial accuracy while phase "
                 "I generates the store it replays (one store, from none's first seed, serves "
                 "every seed; its tokens count for each)", fontsize=7)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def area_panel(ax, arms: list[dict], colour: dict) -> None:
    """Each arm's area with its 95 % interval (horizontal bars), the baseline's mean as a line."""
    shown = [a for a in arms if a["area_n"]]
    for y, arm in enumerate(shown):
        lo, hi = arm["area_ci"]
        mean = arm["area_mean"]
        err = [[100 * (mean - lo)], [100 * (hi - mean)]]
        ax.errorbar(100 * mean, y, xerr=err, fmt="o", color=colour[arm["strategy"]], capsize=3)
    ax.axvline(100 * arms[0]["area_mean"], color="grey", linestyle=":")
    ax.set_yticks(range(len(shown)), [a["strategy"] for a in shown], fontsize=8)
    ax.invert_yaxis()
    ax.set(xlabel="area: mean accuracy over the budget (%)", title="area, 95 % interval")


def plot_cost(compare: dict, path: str, gpu: list[tuple[str, float]]) -> None:
    """Time ratio against ρ per arm (the baseline is the line at 1), each with its interval at
    the ratios of the table; the y-axis ends a fifth above the highest curve."""
    plt = pyplot()
    arms = compare["strategies"]
    grid = np.geomspace(1 / 3, 30, 200)
    fig, ax = plt.subplots(figsize=(11, 5.5))
    colour = colours(len(arms))  # the palette `plot` takes for this many arms
    drawn = []  # (colour, the arm's ratios at RATIOS) of each arm with a curve
    highest = 1.0
    for i, arm in enumerate(arms[1:]):
        pairs = arm["gpu_time"]["pairs"]
        ys = [time_ratio(pairs, rho)[0] for rho in grid]
        if not pairs or not any(map(math.isfinite, ys)):
            ax.plot([], [], color=colour[i], label=f"{arm['strategy']} (never, or undefined)")
            continue
        ax.plot(grid, ys, color=colour[i], label=arm["strategy"])
        highest = max(highest, *filter(math.isfinite, ys))
        drawn.append((colour[i], arm["gpu_time"]["ratios"]))
        even = arm["gpu_time"]["break_even"][-1]
        if math.isfinite(even["ratio"]) and grid[0] <= even["ratio"] <= grid[-1]:
            ax.plot(even["ratio"], 1, "D", color=colour[i], markersize=6)
    top = max(2.0, 1.2 * highest)  # the curves decide the scale, not their intervals
    ax.set_ylim(0, top)
    for c, ratios in drawn:  # intervals above the top run to it; an unbounded one ends in ▲
        for rho, ratio, lo, hi in ratios:
            if not (math.isfinite(ratio) and math.isfinite(lo)):
                continue
            ax.errorbar(rho, ratio, yerr=[[ratio - lo], [min(hi, top) - ratio]], color=c,
                        capsize=3, fmt="o", markersize=3)
            if not math.isfinite(hi):
                ax.plot(rho, top, "^", color=c, markersize=7, clip_on=False)
    ax.axhline(1, color="black", linewidth=1, label=f"{arms[0]['strategy']} (baseline)")
    for label, rho in gpu:
        ax.axvline(rho, color="grey", linestyle=":")
        ax.text(rho, ax.get_ylim()[1], f" {label}", rotation=90, va="top", fontsize=8)
    ax.axvline(1 / 3, color="grey", linestyle="--", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xticks([1 / 3, *RATIOS[1:]], ["⅓ (FLOPs)", *[f"{r:g}" for r in RATIOS[1:]]])
    target = arms[0]["curve"][-1]["level"]
    ax.set(xlabel="ρ = c_gen / c_train (c_fwd = c_train / 3; prefill counted)",
           ylabel=f"GPU time ÷ {arms[0]['strategy']}'s",
           title=f"Time to {100 * target:.1f} % {compare.get('metric', 'accuracy')}: a model "
                 "computed from CPU runs (analysis/cost.py)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))  # beside: no line hidden
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main() -> None:
    ap = cli.Parser(__file__, __doc__)
    ap.add_argument("compare_json", help="a comparison's compare.json (eval.py --compare)")
    ap.add_argument("out_png", help="the figure")
    ap.add_argument("--cost", action="store_true", help="the GPU-time model, not the accuracy")
    ap.add_argument("--gpu", default=str(REPO / "docs" / "gpu" / "h100" / "gpu_run_2.json"),
                    help="--cost: a bench/gpu_run.py record whose measured ratios are marked")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing figure")
    a = ap.parse_args()
    ap.need("matplotlib")
    ap.check_file("out_png", a.out_png, a.overwrite)
    try:
        compare = json.loads(Path(a.compare_json).read_text())
        gpu = []
        if a.cost:
            gpu = measured_ratios(json.loads(Path(a.gpu).read_text()))
    except (OSError, ValueError, KeyError) as e:
        ap.error(f"{a.compare_json} or --gpu {a.gpu}: {e}")
    if a.cost and "gpu_time" not in compare["strategies"][0]:
        ap.error(f"{a.compare_json} has no gpu_time: a comparison made before #60's cost model")
    if a.cost:
        plot_cost(compare, a.out_png, gpu)
    else:
        plot(compare, a.out_png)
    print(f"wrote {a.out_png}")


if __name__ == "__main__":
    main()
