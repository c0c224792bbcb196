"""Plot held-out accuracy against generated tokens from a comparison's compare.json.

Usage:
  python bench/plot_compare.py runs/repro/compare/compare.json docs/tiny_replay_compare.png

Per arm: the seed mean with its 95 % t interval as a band, on the token range every seed covers
(seeds evaluate at different token counts, so each curve is interpolated onto one grid), in a
colour of its own. Curves start at 0 tokens, flat at the step-0 accuracy while RLEP's phase I
generates, as the area counts them (captioned); the dashed line marks the area's budget, the
dotted and dash-dotted ones the two targets, with their values. A second panel gives each arm's
area with its interval.
Needs matplotlib (bench/requirements.txt).
"""

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from analysis.stats import t_quantile
from bench import cli


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
    """n distinct colours: tab10 up to 10 arms, tab20 up to 20, then a continuous map."""
    import matplotlib.pyplot as plt

    if n <= 10:
        return [plt.get_cmap("tab10")(i) for i in range(n)]
    if n <= 20:
        return [plt.get_cmap("tab20")(i) for i in range(n)]
    return [plt.get_cmap("turbo")(i / (n - 1)) for i in range(n)]


def plot(compare: dict, path: str) -> None:
    """Left: each arm's seed-mean accuracy against generated tokens with its 95 % band, the area's
    budget and both targets labelled with their values. Right: each arm's area (mean accuracy
    over the budget) with its 95 % interval, the baseline's as a line."""
    import matplotlib

    matplotlib.use("Agg")  # (no display: a file)
    import matplotlib.pyplot as plt

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


def main() -> None:
    ap = cli.Parser(__file__, __doc__)
    ap.add_argument("compare_json", help="a comparison's compare.json (eval.py --compare)")
    ap.add_argument("out_png", help="the figure")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing figure")
    a = ap.parse_args()
    ap.need("matplotlib")
    ap.check_file("out_png", a.out_png, a.overwrite)
    try:
        with open(a.compare_json) as f:
            compare = json.load(f)
    except (OSError, ValueError) as e:
        ap.error(f"{a.compare_json}: {e}")
    plot(compare, a.out_png)
    print(f"wrote {a.out_png}")


if __name__ == "__main__":
    main()
