"""#60's comparison: the saving as a curve (analysis/curve.py) equal to the single-target
computation at each fraction; the GPU-time model's sums (analysis/cost.py) against counters read
from hand-made metrics lines; --metric reading pass@k, maj@k and greedy (analysis/evals.py), a
missing greedy left out, never 0. Run folders are written by hand, as tests/test_compare.py's."""

import contextlib
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from analysis import compare as cp
from analysis import cost
from analysis.compare_io import load_run, read_run
from analysis.curve import FRACTIONS, at_level
from analysis.evals import standard_error, use_metric

from fixtures import REPO, main_here, train_here  # (tests/fixtures.py: the repository's root)
from tests.test_checkpoint import MODEL, TINY, needs_model

COLUMNS = ("accuracy", "pass@k", "maj@k", "greedy")
INITIAL = {"accuracy": "eval_accuracy_initial", "pass@k": "eval_pass_at_k_initial",
           "maj@k": "eval_maj_at_k_initial", "greedy": "eval_greedy_initial"}


def run_folder(root: Path, arm: str, seed: int, evals: list[dict]) -> Path:
    """A finished run: evals[0] is the step-0 eval (its metrics into summary.json), evals[i] the
    metrics line of step i, whose keys are metrics.jsonl's (an eval metric left out of a row is
    not logged there)."""
    d = root / f"{arm}-s{seed}"
    d.mkdir(parents=True)
    config = {"seed": seed, "replay": {"strategy": "none"}, "rollout": {"dynamic_sampling": 0}}
    (d / "config.yaml").write_text(yaml.safe_dump(config))
    lines = []
    for step, row in enumerate(evals[1:], 1):
        line = {"step": step, "generated_tokens": row["tokens/generated_total"]} | row
        lines.append(json.dumps(line | {"eval/accuracy_se": 0.0, "eval/n": 200}) + "\n")
    (d / "metrics.jsonl").write_text("".join(lines))
    summary = {"strategy": "none", "seed": seed, "steps": len(evals) - 1,
               "eval_response_len_final": 10.0,
               "eval_entropy_final": 0.3,
               "tokens_generated_total": evals[-1]["tokens/generated_total"]}
    for metric, key in INITIAL.items():
        if f"eval/{metric}" in evals[0]:
            summary[key] = evals[0][f"eval/{metric}"]
    (d / "summary.json").write_text(json.dumps(summary))
    return d


def rows(accs: list[float], generated: int, fwd_bwd: int, no_grad: int, trained: int,
         **columns) -> list[dict]:
    """Eval rows at steps 0, 1, ...: accuracy `accs`, the other columns as given, and counters
    growing by the given amounts a step."""
    out = []
    for step, acc in enumerate(accs):
        row = {"eval/accuracy": acc, "tokens/generated_total": generated * step,
               "tokens/fwd_bwd": fwd_bwd * step, "tokens/no_grad": no_grad * step,
               "tokens/trained": trained * step}
        for name, values in columns.items():
            if values[step] is not None:
                row[f"eval/{name.replace('_at_', '@')}"] = values[step]
        out.append(row)
    return out


def same(a, b) -> bool:
    """Equal, NaN equal to NaN, lists and tuples alike (compare.json writes tuples as lists)."""
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(same, a, b))
    return a == b or (math.isnan(a) and math.isnan(b))


# ------------------------------------------------------------------------ the curve, point by point


BASE = [[0.2, 0.3, 0.38, 0.45, 0.5, 0.55, 0.58, 0.6], [0.21, 0.28, 0.4, 0.47, 0.49, 0.56, 0.6,
        0.61], [0.19, 0.31, 0.36, 0.44, 0.52, 0.54, 0.57, 0.59]]  # the tuned baseline's seeds


def seeds(root: Path) -> list[str]:
    """Three seeds of a tuned baseline (labelled `tuned`), of `fast` and of `slow`, each arm's
    own curve and counters: crossings fall between evals, and a slow seed never reaches the top."""
    args = []
    for seed, accs in enumerate(BASE):
        run = run_folder(root / "t", "tuned", seed, rows(accs, 100 + seed, 150, 0, 90))
        args.append(f"tuned={run}")
    for seed, accs in enumerate(BASE):
        fast = [min(0.62, a + 0.1 * (i > 0) + 0.01 * seed) for i, a in enumerate(accs)]
        args.append(f"fast={run_folder(root, 'fast', seed, rows(fast, 90, 450, 150, 300))}")
        slow = [a - 0.03 * i / 7 * (seed == 1) for i, a in enumerate(accs)]
        args.append(f"slow={run_folder(root, 'slow', seed, rows(slow, 110, 150, 0, 95))}")
    return args


def test_curve_point_equals_the_single_target_computation_at_each_fraction(tmp_path):
    """Each point of the curve in compare.json (--baseline tuned, a labelled arm) is, number for
    number, the gain-target columns compare_runs gives under --gain-fraction f (generated tokens:
    to_gain; total compute: compute_to_gain), and its `final` point the target columns."""
    args = seeds(tmp_path)
    cp.main([*args, "--baseline", "tuned", "--out-dir", str(tmp_path / "cmp")])
    result = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    curve = {row["strategy"]: row["curve"] for row in result["strategies"]}
    assert [p["target"] for p in curve["fast"]] == ["50 %", "60 %", "70 %", "80 %", "90 %",
                                                    "95 %", "100 %", "final"]
    assert (tmp_path / "cmp" / "curve.md").read_text().startswith(
        "# The saving as a curve (accuracy, against tuned)")
    for i, fraction in enumerate(FRACTIONS):
        runs = []
        for arg in args:
            label, _, folder = arg.rpartition("=")
            runs.append(load_run(folder) | ({"strategy": label} if label else {}))
        runs, _ = use_metric(runs, "accuracy", "tuned")
        table, target, _ = cp.compare_runs(runs, "tuned", None, None, fraction)
        for row in table:
            point = curve[row["strategy"]][i]
            assert point["level"] == row["gain_target"]
            assert same(point["generated"], row["to_gain"]), (fraction, row["strategy"])
            assert same(point["compute"], row["compute_to_gain"]), (fraction, row["strategy"])
            final = curve[row["strategy"]][-1]
            assert final["level"] == target
            assert same(final["generated"], row["to_target"])
            assert same(final["compute"], row["compute_to_target"])
    ratios = [p["generated"][0] for p in curve["fast"]]
    assert len(set(ratios)) > 3 and all(0 < r < 1 for r in ratios[:-2])  # a curve, not a point
    cp.main([*args, "--baseline", "tuned", "--target", "0.57", "--out-dir", str(tmp_path / "t")])
    result = json.loads((tmp_path / "t" / "compare.json").read_text())
    for row in result["strategies"]:  # --target moves the last point only
        for point, before in zip(row["curve"][:-1], curve[row["strategy"]]):
            assert point["level"] == before["level"]
            assert same(point["generated"], before["generated"])
        assert row["curve"][-1]["level"] == 0.57
        assert same(row["curve"][-1]["generated"], row["to_target"])
        assert same(row["curve"][-1]["compute"], row["compute_to_target"])


# ------------------------------------------------------------------------ the GPU-time model


def two_arms(root: Path) -> list[str]:
    """One seed each. none: accuracy 0.2 → 0.6 by 0.1 a step; 100 generated, 150 fwd-bwd, 0
    no-grad and 100 trained tokens a step (prefill share (600 − 400) / 400 = 0.5). fast: 0.2, 0.4,
    then 0.6; 100 generated, 450 fwd-bwd, 150 no-grad, 360 trained a step (share (1800 − 1440) /
    1440 = 0.25)."""
    none = run_folder(root, "none", 0, rows([0.2, 0.3, 0.4, 0.5, 0.6], 100, 150, 0, 100))
    fast = run_folder(root, "fast", 0, rows([0.2, 0.4, 0.6, 0.6, 0.6], 100, 450, 150, 360))
    return [str(none), f"fast={fast}"]


def test_cost_model_sums_equal_the_counters_of_the_metrics_lines(tmp_path):
    """To none's final accuracy (0.6): none at step 4 (G 400, F 600, N 0, prefill 400 · 0.5),
    fast at step 2 (G 200, F 900, N 300, prefill 200 · 0.25). Time = ρ·G + F + (N + prefill) / 3;
    total compute = 2G + 6F + 2N; the break-even ρ solves 200ρ + 1050 = 400ρ + 666.7. At 70 % of
    the gain (0.48) each counter is interpolated as the generated tokens are."""
    cp.main([*two_arms(tmp_path), "--out-dir", str(tmp_path / "cmp")])
    result = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    fast = result["strategies"][1]
    assert fast["gpu_time"]["pairs"] == [[[200, 900, 300, 50], [400, 600, 0, 200]]]
    for rho, ratio, lo, hi in fast["gpu_time"]["ratios"]:
        hand = (200 * rho + 900 + (300 + 50) / 3) / (400 * rho + 600 + (0 + 200) / 3)
        assert ratio == pytest.approx(hand, rel=1e-12) and lo == hi == ratio
    assert fast["gpu_time"]["ratios"][0][0] == pytest.approx(1 / 3)  # FLOPs, prefill counted
    even = fast["gpu_time"]["break_even"][-1]
    assert even["target"] == "final" and even["cheaper"] == "above"
    assert even["ratio"] == pytest.approx((900 + 350 / 3 - 600 - 200 / 3) / 200, rel=1e-9)
    compute = (2 * 200 + 6 * 900 + 2 * 300) / (2 * 400 + 6 * 600 + 2 * 0)
    assert fast["curve"][-1]["compute"] == pytest.approx([compute] * 3, rel=1e-12)
    none, fast = [load_run(arg.rpartition("=")[2]) for arg in two_arms(tmp_path / "b")]
    runs, _ = use_metric([none, fast | {"strategy": "fast"}], "accuracy", "none")
    cp.compare_runs(runs, "none", None, None)
    arms, _ = at_level(runs, "none", 0.48)
    none_at, fast_at = arms["none"][0]["counters_at"], arms["fast"][0]["counters_at"]
    assert none_at == pytest.approx((280, 420, 0, 140), rel=1e-9)  # 0.8 of steps 2 → 3
    assert fast_at == pytest.approx((140, 630, 210, 35), rel=1e-9)  # 0.4 of steps 1 → 2
    assert cost.gpu_time(fast_at, 10) == pytest.approx(1400 + 630 + (210 + 35) / 3, rel=1e-9)
    assert cost.gpu_time(math.inf, 10) == math.inf  # never reached


# ------------------------------------------------------------------------ --metric


def metric_runs(root: Path, greedy_b=(0.8, 0.7, 0.72, 0.75)) -> list[Path]:
    """none (2 seeds) and fast (2 seeds), each column its own values; steps 0-3."""
    columns = {"none": {"pass_at_k": [0.5, 0.6, 0.7, 0.8], "maj_at_k": [0.3, 0.35, 0.4, 0.45],
                        "greedy": [0.8, 0.7, 0.7, 0.72]},
               "fast": {"pass_at_k": [0.5, 0.55, 0.6, 0.62], "maj_at_k": [0.3, 0.4, 0.45, 0.5],
                        "greedy": list(greedy_b)}}
    accs = {"none": [0.2, 0.3, 0.4, 0.5], "fast": [0.2, 0.4, 0.5, 0.55]}
    runs = []
    for arm in ("none", "fast"):  # (labelled `fast` by `labelled`: the configs name none)
        for seed in (0, 1):
            cols = {k: [v + 0.01 * seed * (i > 0) if v is not None else None
                        for i, v in enumerate(vals)] for k, vals in columns[arm].items()}
            runs.append(run_folder(root, arm, seed, rows(accs[arm], 100, 150, 0, 100, **cols)))
    return runs


def labelled(runs: list[Path]) -> list[str]:
    """LABEL=RUN_DIR arguments, each run's arm its folder's name without the seed."""
    return [f"{run.name.rpartition('-s')[0]}={run}" for run in runs]


@pytest.mark.parametrize("metric", COLUMNS)
def test_metric_reads_its_own_columns(tmp_path, metric):
    """--metric M: each run's final value, area and curve come from eval/M and the step-0 eval
    from summary.json's eval_<M>_initial; the standard error of a 0/1-per-problem metric is
    √(p (1 − p) / (n − 1))."""
    runs = metric_runs(tmp_path)
    out = tmp_path / "cmp"
    cp.main([*labelled(runs), "--metric", metric, "--out-dir", str(out)])
    result = json.loads((out / "compare.json").read_text())
    assert result["metric"] == metric
    for run in result["runs"]:
        lines = [json.loads(x) for x in Path(run["path"], "metrics.jsonl").read_text().splitlines()]
        summary = json.loads(Path(run["path"], "summary.json").read_text())
        ys = [summary[INITIAL[metric]]] + [line[f"eval/{metric}"] for line in lines]
        assert [c[2] for c in run["curve"]] == ys
        assert run["final"] == ys[-1]
        hand = (ys[0] + 2 * ys[1] + 2 * ys[2] + ys[3]) / 6  # evals 100 tokens apart, budget 300
        assert run["area"] == pytest.approx(hand, abs=1e-12)
        if metric != "accuracy":
            p = ys[2]
            assert run["curve"][2][3] == pytest.approx(math.sqrt(p * (1 - p) / 199), rel=1e-12)
    none = result["strategies"][0]
    assert none["curve"][-2]["level"] == pytest.approx(none["acc_mean"], abs=1e-12)  # 100 %


def test_a_missing_greedy_is_left_out_never_zero(tmp_path, capsys):
    """A run that logged no greedy (before #60, or eval.greedy off) is left out of --metric
    greedy, named in one line, and stays in accuracy; an eval row without greedy drops out of
    that run's curve (the interpolation bridges it); a baseline without any is one error line."""
    runs = metric_runs(tmp_path, greedy_b=(0.8, 0.7, None, 0.75))  # fast: no greedy at step 2
    old = run_folder(tmp_path, "old", 0, rows([0.2, 0.3, 0.4, 0.5], 100, 150, 0, 100))
    args = [*labelled(runs), f"old={old}"]
    cp.main([*args, "--metric", "greedy", "--out-dir", str(tmp_path / "g")])
    assert f"left out (no eval/greedy logged): {old}\n" in capsys.readouterr().out
    result = json.loads((tmp_path / "g" / "compare.json").read_text())
    assert [row["strategy"] for row in result["strategies"]] == ["none", "fast"]
    fast = [run for run in result["runs"] if run["strategy"] == "fast"]
    assert [c[0] for c in fast[0]["curve"]] == [0, 1, 3]  # step 2 is not a 0
    assert fast[0]["final"] == 0.75 and fast[1]["final"] == pytest.approx(0.76)
    cp.main([*args, "--out-dir", str(tmp_path / "a")])
    strategies = json.loads((tmp_path / "a" / "compare.json").read_text())["strategies"]
    assert [row["strategy"] for row in strategies] == ["none", "fast", "old"]
    assert read_run(old)[0]["eval_accuracy_initial"] == 0.2
    with pytest.raises(SystemExit) as e:
        cp.main([f"none={old}", *labelled(runs[2:]), "--metric", "greedy",
                 "--out-dir", str(tmp_path / "x")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "no run of the baseline 'none' logged eval/greedy" in err and err.count("\n") == 1


def test_a_tuned_baseline_is_the_arm_of_highest_mean_area_in_accuracy(tmp_path, capsys):
    """--baseline none,lo,hi,short (#60's tuned baseline): the arm of highest mean area in avg@k at
    the first arm's budget is the baseline of the table and of compare.json under every --metric
    (`lo` has the higher accuracy, `hi` the higher pass@k: lo in both); the areas it chose by are
    those the table gives each arm; `short`, the highest in accuracy, has a run that generated
    less than the budget, so no area and no claim; an arm with no run is one line, exit 2."""
    arms = {"none": ([0.2, 0.3, 0.4, 0.5], [0.5, 0.6, 0.7, 0.8]),
            "lo": ([0.2, 0.4, 0.5, 0.55], [0.5, 0.55, 0.6, 0.65]),
            "hi": ([0.2, 0.25, 0.35, 0.45], [0.5, 0.7, 0.8, 0.9]),
            "short": ([0.2, 0.6, 0.7, 0.8], [0.5, 0.6, 0.7, 0.8])}
    runs = []
    for arm, (accs, passes) in arms.items():
        for seed in range(2):
            accs = [a + 0.01 * seed * (i > 0) for i, a in enumerate(accs)]
            generated = 100 - 10 * (arm == "short" and seed == 1)  # 270 tokens, the budget 300
            evals = rows(accs, generated, 150, 0, 100, pass_at_k=passes)
            runs.append(run_folder(tmp_path, arm, seed, evals))
    for metric in ("accuracy", "pass@k"):
        out = tmp_path / metric
        cp.main([*labelled(runs), "--baseline", "none,lo,hi,short", "--metric", metric,
                 "--out-dir", str(out)])
        assert "baseline lo: the highest mean area in avg@k at 300 generated tokens" in (
            capsys.readouterr().out)
        result = json.loads((out / "compare.json").read_text())
        assert result["baseline"] == "lo" and result["budget"] == 300
        assert result["strategies"][0]["strategy"] == "lo"
        chosen_by = result["tuned_over"]
        assert math.isnan(chosen_by["short"]) and max(chosen_by, key=chosen_by.get) == "lo"
    cp.main([*labelled(runs), "--baseline", "lo", "--out-dir", str(tmp_path / "plain")])
    table = json.loads((tmp_path / "plain" / "compare.json").read_text())["strategies"]
    for row in table:  # (the table's mean for `short` is its one run's that reaches the budget)
        assert same(chosen_by[row["strategy"]], row["area_mean"]) or row["area_n"] < row["seeds"]
    with pytest.raises(SystemExit) as e:
        cp.main([*labelled(runs), "--baseline", "none,lo,nope", "--out-dir", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert "no run is in the baseline arm 'nope'" in err and not (tmp_path / "x").exists()


def test_the_new_eval_fields_are_checked():
    """eval/pass@k, maj@k, greedy and their step-0 values are fractions; eval/n a count."""
    row = {"eval/pass@k": 0.8, "eval/n": 200}
    assert standard_error("pass@k", row) == pytest.approx(math.sqrt(0.8 * 0.2 / 199))
    assert standard_error("greedy", row) == 0.0  # not logged: no spread to count
    assert standard_error("accuracy", {"eval/accuracy_se": 0.02}) == 0.02
    from analysis.compare_io import check_types
    for key, bad, words in (("eval/pass@k", 1.5, "in [0, 1]"), ("eval/greedy", "x", "a number"),
                            ("eval_maj_at_k_initial", -0.1, "in [0, 1]"),
                            ("eval/n", -1, "finite and ≥ 0")):
        with pytest.raises(ValueError) as e:
            check_types({key: bad}, "here")
        assert f"here: {key} must be {words}" in str(e.value)


def test_the_measured_gpu_ratios_and_the_plot(tmp_path):
    """The H100's c_gen / c_train (docs/gpu/h100/gpu_run_2.json): 13,987 warm update tokens/s ÷
    1,566 useful rollout tokens/s on the default path, ÷ 12,166 for the compiled decode step; the
    plot (when matplotlib is installed) draws a comparison's model."""
    record = json.loads((REPO / "docs" / "gpu" / "h100" / "gpu_run_2.json").read_text())
    (_, default), (_, compiled) = cost.measured_ratios(record)
    assert default == pytest.approx(13986.659 / 1565.765, rel=1e-6)  # 8.93
    assert compiled == pytest.approx(13986.659 / 12166.044, rel=1e-6)  # 1.15
    pytest.importorskip("matplotlib")
    cp.main([*two_arms(tmp_path), "--out-dir", str(tmp_path / "cmp")])
    script = [sys.executable, str(REPO / "bench" / "plot.py"),
              str(tmp_path / "cmp" / "compare.json"), str(tmp_path / "cost.png"), "--cost"]
    subprocess.run(script, check=True, capture_output=True, timeout=120)
    assert (tmp_path / "cost.png").stat().st_size > 0


def test_the_first_ten_arms_keep_ten_distinct_hues_whatever_the_number_of_arms():
    """#60's twelve arms: tab20 in its own order paired each arm with the next in two shades of one
    hue (none_lr1.5x and epochs3 both blue). Now the first ten arms take tab10's colours however
    many arms there are, and the eleventh on the light shades."""
    pytest.importorskip("matplotlib")
    from bench import plot
    ten = plot.colours(10)
    for n in (11, 12, 20):
        many = plot.colours(n)
        assert many[:10] == ten and len(set(many)) == n
    assert ten == [plot.pyplot().get_cmap("tab10")(i) for i in range(10)]


def test_the_cost_plot_is_scaled_by_its_curves_and_marks_an_unbounded_interval(tmp_path,
                                                                              monkeypatch):
    """An interval without an upper end is drawn to the top of the axis and ends in ▲; the axis
    ends a fifth above the highest curve (at least at 2), whatever the intervals reach."""
    pytest.importorskip("matplotlib")
    from bench import plot
    cp.main([*two_arms(tmp_path), "--out-dir", str(tmp_path / "cmp")])
    compare = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    fast = compare["strategies"][1]["gpu_time"]
    rho, ratio, lo, _ = fast["ratios"][0]
    fast["ratios"][0] = [rho, ratio, lo, math.inf]
    fast["ratios"][1][3] = 50.0  # a finite upper end far above the curves
    plt = plot.pyplot()
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    plot.plot_cost(compare, str(tmp_path / "cost.png"), [])
    ax = figures[0].axes[0]
    highest = max(cost.time_ratio(fast["pairs"], r)[0] for r in np.geomspace(1 / 3, 30, 200))
    assert ax.get_ylim() == pytest.approx((0, max(2.0, 1.2 * highest)))
    tops = [line for line in ax.lines if line.get_marker() == "^"]
    assert [(x, y) for line in tops for x, y in line.get_xydata()] == [(rho, ax.get_ylim()[1])]


# ------------------------------------------------------------------------ --continued


def continued_copies(root: Path, extra: list[float], seeds_: range = range(3)) -> Path:
    """Copies of `slow`'s seeds (as `seeds` writes them) run on past step 7: the same evals, then
    `extra` accuracies, its counters growing as before; config.yaml says max_steps 12."""
    for seed in seeds_:
        accs = [a - 0.03 * i / 7 * (seed == 1) for i, a in enumerate(BASE[seed])] + extra
        run = run_folder(root, "slow", seed, rows(accs, 110, 150, 0, 95))
        config = yaml.safe_load((run / "config.yaml").read_text()) | {"max_steps": 12}
        (run / "config.yaml").write_text(yaml.safe_dump(config))
    return root


def test_continued_copies_measure_the_final_value_and_nothing_else(tmp_path, capsys):
    """--continued DIR: a run with a copy there (its folder's name) is measured on the copy for
    the table's target, the baseline's final value (tokens, compute and steps to it; the curve's
    `final` point, its GPU time), each the crossing of the copy's curve; every other figure, the
    curve's 50-100 % points among them, is the one without --continued."""
    args = seeds(tmp_path)
    long = continued_copies(tmp_path / "long", [0.62, 0.63, 0.64, 0.66])
    cp.main([*args, "--baseline", "tuned", "--out-dir", str(tmp_path / "a")])
    capsys.readouterr()
    cp.main([*args, "--baseline", "tuned", "--continued", str(long), "--out-dir",
             str(tmp_path / "b")])
    said = capsys.readouterr().out
    line = f"the final value's crossings on continued copies in {long}: slow (seeds 0, 1, 2)"
    assert line in said
    a, b = (json.loads((tmp_path / x / "compare.json").read_text()) for x in "ab")
    target = b["target"]
    for run in b["runs"]:
        if run["strategy"] != "slow":
            assert "continued_from" not in run
            continue
        copy = load_run(run["continued_from"])
        assert Path(run["continued_from"]).parent == long
        assert run["tokens_to_target"] == cp.sustained_crossing(copy["curve"], target)
        assert run["tokens_to_target"] is not None  # every seed holds it on the copy
    moved = {"to_target", "compute_to_target", "ratios", "ratio_median", "ratio_ci", "reached",
             "steps_ratio", "steps_ratio_ci", "curve", "gpu_time", "continued"}
    for before, after in zip(a["strategies"], b["strategies"]):
        for key in before.keys() - moved:
            assert same(before[key], after[key]), key
        assert same(before["curve"][:-1], after["curve"][:-1])
        assert same(after["curve"][-1]["generated"], after["to_target"])
        assert same(after["curve"][-1]["compute"], after["compute_to_target"])
        if after["strategy"] != "slow":
            assert same(before, after)
    slow_a, slow_b = a["strategies"][2], b["strategies"][2]
    assert slow_b["strategy"] == "slow" and slow_a["reached"] < slow_b["reached"] == 3
    assert not same(slow_a["gpu_time"]["pairs"], slow_b["gpu_time"]["pairs"])
    assert [row["continued"] for row in b["strategies"]] == [0, 0, 3]
    curve_md = (tmp_path / "b" / "curve.md").read_text()
    assert "(--continued; the other targets on the runs): slow (3 of 3 seeds).\n" in curve_md


def test_continued_copies_are_checked_in_one_line(tmp_path, capsys):
    """A copy that is not its run continued, or a folder without one, is one line, exit 2:
    another setting, other evals before the run's end, no eval after it, one still running (the
    run's summary.json, copied with it, or none), a missing folder."""
    args = seeds(tmp_path)
    cases = [(lambda d: d / "none", "not a folder"),
             (lambda d: continued_copies(d, []), "it has no eval after the run's last")]
    copies = continued_copies(tmp_path / "lr", [0.7])
    set_key(copies / "slow-s1", "optim", {"lr": 1.0})
    cases.append((lambda d: copies, "optim.lr is 1.0 there"))
    other = continued_copies(tmp_path / "other", [0.7])
    lines = [json.loads(x) for x in (other / "slow-s2" / "metrics.jsonl").read_text().splitlines()]
    lines[3]["eval/accuracy"] += 0.001  # (step 4: another run, not this one resumed)
    (other / "slow-s2" / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    cases.append((lambda d: other, "their evals in accuracy differ before the run's last"))
    running = continued_copies(tmp_path / "running", [0.7])  # slow-s0 copied, still running
    shutil.copyfile(tmp_path / "slow-s0" / "summary.json", running / "slow-s0" / "summary.json")
    cases.append((lambda d: running, "slow-s0 is not a finished run (no summary.json of its last"))
    stopped = continued_copies(tmp_path / "stopped", [0.7])  # slow-s1 stopped before its summary
    (stopped / "slow-s1" / "summary.json").unlink()
    cases.append((lambda d: stopped, "slow-s1 is not a finished run (no summary.json of its last"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    cases.append((lambda d: elsewhere, "no copy of a compared run there"))
    for i, (make, words) in enumerate(cases):
        folder = make(tmp_path / f"c{i}")
        with pytest.raises(SystemExit) as e:
            cp.main([*args, "--baseline", "tuned", "--continued", str(folder), "--out-dir",
                     str(tmp_path / f"x{i}")])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1, err
        assert words in err and not (tmp_path / f"x{i}").exists(), (words, err)


def set_key(run: Path, section: str, values: dict) -> None:
    config = yaml.safe_load((run / "config.yaml").read_text())
    config[section] = config.get(section, {}) | values
    (run / "config.yaml").write_text(yaml.safe_dump(config))


@needs_model
def test_a_real_run_resumed_past_its_end_is_its_continued_copy(tmp_path, capsys):
    """Through train.py: a finished run copied and resumed with --max_steps past its end (#60's
    rule) is accepted as its continued copy (its evals up to the run's end are the run's, every
    metric), and the comparison measures the final value on it."""
    common = [*TINY, "--eval.every=2", "--eval.k=2", "--max_steps=4"]
    none, other = tmp_path / "none-s0", tmp_path / "other-s0"
    assert train_here(*common, f"--out_dir={none}").returncode == 0
    assert train_here(*common, f"--out_dir={other}", "--optim.lr=1e-5").returncode == 0
    copy = tmp_path / "long" / "other-s0"
    shutil.copytree(other, copy)
    resumed = train_here(*common, f"--out_dir={copy}", "--optim.lr=1e-5", "--resume",
                         "--max_steps=6")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    capsys.readouterr()
    cp.main([f"none={none}", f"other={other}", "--continued", str(copy.parent), "--out-dir",
             str(tmp_path / "cmp")])
    assert "continued copies in" in capsys.readouterr().out
    runs = json.loads((tmp_path / "cmp" / "compare.json").read_text())["runs"]
    assert runs[1]["continued_from"] == str(copy)
    assert [c[0] for c in runs[1]["continued"]["curve"]] == [0, 2, 4, 6]
    assert [c[0] for c in runs[1]["curve"]] == [0, 2, 4]


# -------------------------------------------- #60's continuation rule in bench/reproduce_tiny.py


def test_the_rule_continues_the_arms_below_the_tuned_baseline_and_the_runs_short_of_it(tmp_path):
    """The tuned baseline is the candidate of highest mean area (none here), not of highest final
    (none_lr2x: 0.7); every run of an arm whose seed-mean final is below the baseline's 0.6 is
    continued (b: 0.595, though its seed 1 ends above), and any other run that does not hold 0.6
    by its end: the baseline's own seed 0 (0.58) and a's seed 0 (0.59; a's mean 0.605), not
    none_lr2x's seed 1, whose 0.59 at the end is within its standard error (0.02) of the 0.6 it
    reached before; and c's seed 0, evaluated every step, whose 0.65 at step 1 is not on the
    evals every run shares (steps 0, 2, 4), as the comparison measures it."""
    sys.path.insert(0, str(REPO / "bench"))
    import reproduce_tiny

    from tests.test_compare import train_run
    curves = {"none": ([0.2, 0.5, 0.58], [0.2, 0.5, 0.62]),
              "none_lr2x": ([0.2, 0.3, 0.7], [0.2, 0.62, 0.59]),
              "a": ([0.2, 0.5, 0.59], [0.2, 0.5, 0.62]),
              "b": ([0.2, 0.5, 0.58], [0.2, 0.5, 0.61])}
    for arm, seeds in curves.items():
        for seed, accs in enumerate(seeds):
            train_run(tmp_path, arm, seed, accs)
    train_run(tmp_path, "c", 0, [0.2, 0.65, 0.59, 0.59, 0.59], every=1)
    train_run(tmp_path, "c", 1, [0.2, 0.5, 0.62])
    baseline, runs = reproduce_tiny.to_continue(tmp_path, [*curves, "c"], [0, 1],
                                                ["none", "none_lr2x"])
    assert (baseline, runs) == ("none", [("none", 0), ("a", 0), ("b", 0), ("c", 0), ("b", 1)])


@needs_model
def test_reproduce_tiny_continues_through_train_py_and_publishes_on_the_copies(
        tmp_path, monkeypatch, capsys):
    """bench/reproduce_tiny.py --continue-to 4 on three 2-step arms: the runs of the arm whose
    final avg@k is below the baseline's (computed here from summary.json) are copied to
    <out>_long/ and resumed to step 4 by train.py (their first steps the run's, every key), the
    others not (`same`: none's run, an equal final); the comparisons measure the final value on
    the copies; started again, it trains nothing, a copy of a run not compared (seed 7) beside;
    a copy of another compared run there is refused."""
    sys.path.insert(0, str(REPO / "bench"))
    import eval as evaluate
    import reproduce_tiny
    import train

    configs, out = tmp_path / "configs", tmp_path / "runs"
    configs.mkdir()
    common = {"base": str(REPO / "configs" / "tiny.yaml"), "max_steps": 2, "threads": 1,
              "model": {"path": str(MODEL)}, "wandb": {"mode": "disabled"},
              "rollout": {"batch_size": 16, "group_size": 4, "max_new_tokens": 24},
              "eval": {"every": 1, "n": 16, "k": 2}, "checkpoint": {"every": 1},
              "optim": {"lr": 1e-6, "warmup_steps": 0}}
    arms = {"none": {}, "same": {}, "fast": {"optim": {"lr": 2e-3, "warmup_steps": 0}}}
    for arm, change in arms.items():
        (configs / f"{arm}.yaml").write_text(yaml.safe_dump(common | change))
    trained = []

    def run(cmd, cwd=None, check=False, stdout=None, stderr=None):  # in this process: no imports
        script = Path(cmd[1]).name
        if script == "train.py":
            trained.append(cmd)
        if script not in ("train.py", "eval.py"):  # the plot
            return subprocess.CompletedProcess(cmd, 0)
        main = {"train.py": train.main, "eval.py": evaluate.main}[script]
        with contextlib.chdir(REPO):
            done = main_here(main, cmd[2:])
        if stdout is not None:
            stdout.write(done.stdout + done.stderr)
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
        return done

    class Serial(contextlib.AbstractContextManager):  # (train.py's signals: the main thread)
        def __init__(self, jobs):
            pass

        def __exit__(self, *error):
            return None

        def map(self, fn, jobs):
            return map(fn, jobs)

    monkeypatch.setattr(reproduce_tiny.subprocess, "run", run)
    monkeypatch.setattr(reproduce_tiny, "ThreadPoolExecutor", Serial)
    argv = ["reproduce_tiny.py", "--configs", str(configs), "--out", str(out), "--seeds", "0",
            "--jobs", "1", "--continue-to", "4"]
    monkeypatch.setattr(sys, "argv", argv)
    reproduce_tiny.main()
    longer_runs = [cmd for cmd in trained if "--max_steps=4" in cmd]
    assert len(longer_runs) == 1 and "--resume" in longer_runs[0]  # from the copied checkpoint
    final = {}
    for arm in arms:
        final[arm] = json.loads((out / f"{arm}-s0" / "summary.json").read_text())
    base = final["none"]["eval_accuracy_final"]
    below = [arm for arm in arms if final[arm]["eval_accuracy_final"] < base]
    assert below == ["fast"], final  # (the test needs an arm below: lr 2e-3 drops it here)
    longer = tmp_path / "runs_long"
    assert sorted(p.name for p in longer.iterdir() if p.is_dir()) == ["fast-s0"]
    copy, run_dir = longer / "fast-s0", out / "fast-s0"
    assert json.loads((copy / "summary.json").read_text())["steps"] == 4
    rows = (copy / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 4 and rows[:2] == (run_dir / "metrics.jsonl").read_text().splitlines()
    compared = json.loads((out / "compare" / "accuracy" / "compare.json").read_text())
    continued = {r["path"]: r.get("continued_from") for r in compared["runs"]}
    assert continued == {str(out / f"{arm}-s0"): None for arm in ("none", "same")} | {
        str(run_dir): str(copy)}
    trained.clear()
    shutil.copytree(copy, longer / "same-s7")  # a copy of a run not compared (seed 7): not read
    reproduce_tiny.main()  # started again: every run and copy finished
    assert trained == []
    shutil.copytree(copy, longer / "same-s0")
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        reproduce_tiny.main()
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err  # one line, as all bad input
    assert "same-s0: a copy of a run the rule does not continue" in err
