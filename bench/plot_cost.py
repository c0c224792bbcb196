"""Plot a comparison's GPU-time model (analysis/cost.py): each arm's time to the table's target ÷
the baseline's, against ρ = c_gen / c_train from 1/3 to 30. A model computed from CPU runs.

Usage:
  python bench/plot_cost.py runs/cmp/compare.json docs/tiny_fair_cost.png
  python bench/plot_cost.py runs/cmp/compare.json out.png --gpu docs/gpu/h100/gpu_run_2.json

Per arm: its ratio of median times, recomputed on a fine grid of ρ from compare.json's counters
(gpu_time.pairs), its 95 % paired intervals at cost.RATIOS as bars, its break-even ρ as a dot on
the line at 1. Dotted verticals: the ratios measured on a GPU (--gpu, a bench/gpu_run.py record):
the default path, the warm update's tokens/s ÷ a whole rollout's useful tokens/s (whose time holds
its prefill too), and the compiled decode step, the update's ÷ the `static_packed` decode step's
(every row live, no prefill). Needs matplotlib (bench/requirements.txt).
"""

import json
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from analysis.cost import RATIOS, measured_ratios, time_ratio
from bench import cli

REPO = Path(__file__).resolve().parents[1]


def plot(compare: dict, path: str, gpu: list[tuple[str, float]]) -> None:
    """Time ratio against ρ per arm (the baseline is the line at 1)."""
    import matplotlib

    matplotlib.use("Agg")  # (no display: a file)
    import matplotlib.pyplot as plt

    arms = compare["strategies"]
    grid = np.geomspace(1 / 3, 30, 200)
    fig, ax = plt.subplots(figsize=(9, 5.5))
    colours = plt.get_cmap("tab10" if len(arms) <= 10 else "tab20")
    for i, arm in enumerate(arms[1:]):
        pairs = arm["gpu_time"]["pairs"]
        ys = [time_ratio(pairs, rho)[0] for rho in grid]
        if not pairs or not any(map(math.isfinite, ys)):
            ax.plot([], [], color=colours(i), label=f"{arm['strategy']} (never, or undefined)")
            continue
        ax.plot(grid, ys, color=colours(i), label=arm["strategy"])
        for rho, ratio, lo, hi in arm["gpu_time"]["ratios"]:
            if math.isfinite(ratio) and math.isfinite(lo):
                ax.errorbar(rho, ratio, yerr=[[ratio - lo], [min(hi, 10) - ratio]],
                            color=colours(i), capsize=3, fmt="o", markersize=3)
        even = arm["gpu_time"]["break_even"][-1]
        if math.isfinite(even["ratio"]) and grid[0] <= even["ratio"] <= grid[-1]:
            ax.plot(even["ratio"], 1, "D", color=colours(i), markersize=6)
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
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def main() -> None:
    ap = cli.Parser(__file__, __doc__)
    ap.add_argument("compare_json", help="a comparison's compare.json (eval.py --compare)")
    ap.add_argument("out_png", help="the figure")
    ap.add_argument("--gpu", default=str(REPO / "docs" / "gpu" / "h100" / "gpu_run_2.json"),
                    help="a bench/gpu_run.py record whose measured ratios are marked")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing figure")
    a = ap.parse_args()
    ap.need("matplotlib")
    ap.check_file("out_png", a.out_png, a.overwrite)
    try:
        compare = json.loads(Path(a.compare_json).read_text())
        gpu = measured_ratios(json.loads(Path(a.gpu).read_text()))
    except (OSError, ValueError, KeyError) as e:
        ap.error(f"{a.compare_json} or {a.gpu}: {e}")
    if "gpu_time" not in compare["strategies"][0]:
        ap.error(f"{a.compare_json} has no gpu_time: a comparison made before #60's cost model")
    plot(compare, a.out_png, gpu)
    print(f"wrote {a.out_png}")


if __name__ == "__main__":
    main()
