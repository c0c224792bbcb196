"""Plot held-out accuracy against generated tokens from a comparison's compare.json.

Usage:
  python bench/plot_compare.py runs/repro/compare/compare.json docs/tiny_replay_compare.png

Per arm: the seed mean with its 95 % t interval as a band, on the token range every seed covers
(seeds evaluate at different token counts, so each curve is interpolated onto one grid). Curves
start at 0 tokens, flat at the step-0 accuracy while RLEP's phase I generates, as the area counts
them; the dashed line marks the area's budget, the dotted one the tokens-to-target target.
Needs matplotlib (bench/requirements.txt).
"""

import json
import sys
from pathlib import Path

import numpy as np

try:
    import matplotlib
except ImportError:
    sys.exit("error: bench/plot_compare.py needs matplotlib: pip install -r bench/requirements.txt")
matplotlib.use("Agg")
import matplotlib.pyplot as plt

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support.stats import t_quantile


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


LINESTYLES = ["-", "--", ":"]


def plot(compare: dict, path: str) -> None:
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, arm in enumerate(compare["strategies"]):  # the baseline first, as the table
        runs = [r for r in compare["runs"] if r["strategy"] == arm["strategy"] and r["curve"]]
        if not runs:
            continue
        grid, ys = seed_curves(runs)
        mean = 100 * ys.mean(0)
        label = f"{arm['strategy']} (n={len(runs)})"
        # matplotlib's cycle has 10 colours: arms 11-20 repeat them dashed
        ax.plot(grid, mean, color=f"C{i}", linestyle=LINESTYLES[i // 10 % 3], label=label)
        if len(runs) > 1:
            half = 100 * t_quantile(0.975, len(runs) - 1) * ys.std(0, ddof=1) / len(runs) ** 0.5
            ax.fill_between(grid, mean - half, mean + half, color=f"C{i}", alpha=0.15)
    budget = f"area budget ({compare['budget']:.4g} tokens)"
    ax.axvline(compare["budget"], color="black", linestyle="--", label=budget)
    ax.axhline(100 * compare["target"], color="grey", linestyle=":", label="target")
    ax.set(xlabel="generated tokens (phase I and dynamic-sampling rounds included)",
           ylabel="held-out accuracy (%)",
           title="eval accuracy vs generation cost (band: 95% t interval of the seed mean)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python bench/plot_compare.py COMPARE_JSON OUT_PNG")
    with open(sys.argv[1]) as f:
        plot(json.load(f), sys.argv[2])
    print(f"wrote {sys.argv[2]}")
