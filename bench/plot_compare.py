"""Plot eval accuracy against generated tokens from an `eval.py --compare` output (its compare.json).

Usage:
  python bench/plot_compare.py runs/repro/compare/compare.json docs/tiny_replay_compare.png

Per strategy: the mean over seeds with a min–max band, on the token range every seed covers (seeds evaluate at
different token counts, so each curve is interpolated onto one grid); the dotted line is the comparison's target.
Needs matplotlib (bench/requirements.txt).
"""

import json
import sys

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def plot(compare: dict, path: str) -> None:
    fig, ax = plt.subplots(figsize=(8, 5))
    order = [s["strategy"] for s in compare["strategies"]]  # the baseline first, as the table
    for i, name in enumerate(order):
        curves = [np.array(r["curve"], dtype=float)[:, 1:3].T for r in compare["runs"] if r["strategy"] == name and r["curve"]]
        if not curves:
            continue
        lo, hi = max(x[0] for x, _ in curves), min(x[-1] for x, _ in curves)
        grid = np.linspace(lo, max(lo, hi), 200)
        ys = 100 * np.stack([np.interp(grid, x, y) for x, y in curves])  # (seeds, 200)
        (line,) = ax.plot(grid, ys.mean(0), color=f"C{i}", label=f"{name} (n={len(curves)})")
        ax.fill_between(grid, ys.min(0), ys.max(0), color=line.get_color(), alpha=0.15)
    ax.axhline(100 * compare["target"], color="grey", linestyle=":", label="target (baseline's final mean)")
    ax.set(xlabel="generated tokens (phase I included)", ylabel="held-out accuracy (%)",
           title="eval accuracy vs generation cost (band: min–max over seeds)")
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
