"""The files of the run comparison (analysis/compare.py): what it reads of each run folder
(`load_run`: the arm, the final figures, the eval curve and the counters), every field checked for
its type and domain, and what it writes: the markdown table of the arms, compare.csv (per run),
compare.json (per arm, run). Which runs may be pooled: analysis/pooling.py.
"""

from __future__ import annotations

import csv
import json
import math
import os
from pathlib import Path

from analysis.evals import METRICS, eval_curve
from config import ConfigError, typed_mapping
from data.loaders import json_line, jsonl_rows, open_regular, read_yaml_file
from support.checkpoint import INITIAL_EVALS
from support.util import file_fault, flatten, folder_fault

NUMBER = (int, float)
NUMBERS = ["eval_response_len_final", "tokens_generated_total", "eval_entropy_final",
           "generated_tokens", "tokens/generated_total", "eval/accuracy", "eval/accuracy_se",
           "eval/response_len", "eval/entropy", "tokens/trained", "tokens/fwd_bwd",
           "tokens/no_grad", "tokens_trained", "rows_trained"]
# The step-0 evals (summary.json) and the other metrics of each eval (#60, analysis/evals.py)
OTHER_EVALS = [*INITIAL_EVALS, "eval/pass@k", "eval/maj@k", "eval/greedy"]
NUMBERS = NUMBERS + OTHER_EVALS + ["eval/n"]
TYPES = {"strategy": str, "seed": int, "step": int} | dict.fromkeys(NUMBERS, NUMBER)
# In [0, 1]; the other numbers finite and ≥ 0 (NaN, inf or a negative count would poison every mean)
FRACTIONS = {"eval/accuracy", "eval/accuracy_se", *OTHER_EVALS}
# The counters of a run (cumulative): they never fall from one row of metrics.jsonl to the next
COUNTERS = ("generated_tokens", "tokens/generated_total", "tokens/trained", "tokens/fwd_bwd",
            "tokens/no_grad")
FIELDS = ["path", "strategy", "seed", "final", "length", "tokens", "entropy", "tokens_to_target",
          "tokens_ratio", "tokens_to_gain", "trained_to_gain", "passes_to_gain", "compute_to_gain",
          "compute_to_target", "steps_to_target", "aes", "area", "trained_tokens", "trained_rows",
          "versions", "continued_from"]


def run_arg(arg: str) -> tuple[str | None, str]:
    """(the arm's label or None, the run folder) of a [LABEL=]RUN_DIR argument; ValueError for an
    empty label or folder (`=runs/x` would be an arm named by nothing, `x=` the current folder)."""
    label, sep, folder = arg.partition("=")
    if not sep or "/" in label:  # a folder whose path holds "="
        label, folder = None, arg
    if not folder.strip() or (label is not None and not label.strip()):
        raise ValueError(f"{arg!r}: a run is [LABEL=]RUN_DIR, neither of them empty")
    return label, folder


def given_twice(folders: list[str]) -> str | None:
    """Why these run folders cannot be pooled (None: they can): one given twice, by the same or
    another path (a link, a label), would count as two seeds of one run."""
    seen = {}  # real path: the folder as given first
    for folder in folders:
        real = os.path.realpath(folder)
        if real in seen:
            also = f" (also as {seen[real]})" if seen[real] != folder else ""
            return f"{folder} is given twice{also}: a run counts once, as one seed"
        seen[real] = folder
    return None


def positive_number(text: str) -> float:
    """--budget's number: ValueError unless it is one, finite and > 0."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"--budget must be a number > 0 or shortest, got {text!r}") from None
    if not 0 < value < math.inf:
        raise ValueError(f"--budget must be finite and > 0, got {text}")
    return value


def load_run(path: str | Path) -> dict:
    """A run folder: arm, seed, final figures and the eval curve [(step, generated tokens, accuracy,
    standard error)], whose step 0 sits after RLEP's phase I."""
    path = Path(path)
    summary, config, rows = read_run(path)
    rows = rows or [{}]  # an empty row: no eval, nothing generated
    strategy = summary.get("strategy") or config.get("replay", {}).get("strategy")
    if strategy is None:
        raise ValueError(f"{path}: no replay strategy in summary.json or config.yaml")
    tags = [strategy]
    if config.get("rollout", {}).get("dynamic_sampling"):  # its own arm, never the baseline
        tags.append("dynamic")
    if config.get("model", {}).get("lora", {}).get("rank", 0) > 0:  # adapters: lora, aper+lora
        tags.append("lora")
    if config.get("skip", {}).get("enabled"):  # GRESO's prompt skipping: skip, aper+skip
        tags.append("skip")
    if config.get("stages", {}).get("first", 0) > 0:  # staged rollouts
        tags.append("stages")
    optim = config.get("optim", {})
    if optim.get("epochs", 1) > 1:  # reuse too: epochs2, epochs4+gate, aper+epochs2
        tags.append(f"epochs{optim['epochs']}" + "+gate" * bool(optim.get("gate")))
    method = config.get("lookahead", {}).get("method", "none")
    if method != "none":  # SFPO, GXPO: sfpo, aper+sfpo
        tags.append(str(method))
    phase1 = rows[0].get("tokens/generated_total", 0) - rows[0].get("generated_tokens", 0)
    trained = {0: 0}  # step: tokens the updates trained on so far (the update's compute)
    passes = {0: (0, 0)}  # step: token passes so far, (forward-backward, no-grad) (#47)
    for row in rows:
        if row.get("tokens/trained") is not None:
            trained[row.get("step")] = row["tokens/trained"]
        if row.get("tokens/fwd_bwd") is not None:
            passes[row.get("step")] = (row["tokens/fwd_bwd"], row.get("tokens/no_grad") or 0)
        tokens = row.get("tokens/generated_total", row.get("generated_tokens"))
    curves = {}  # every eval metric's curve; evals.use_metric picks the compared one
    for metric in METRICS:
        curves[metric] = eval_curve(metric, summary, rows, phase1)
    curve = curves["accuracy"]
    return {"path": str(path), "strategy": "+".join(tags).removeprefix("none+"),
            "config": flatten(config), "curves": curves,
            "seed": summary.get("seed", config.get("seed")), "curve": curve, "trained": trained,
            "passes": passes,
            "finished": bool(summary),
            "ended": (summary.get("steps"), rows[-1].get("step")),  # summary's end, the last row's
            "final": curve[-1][2] if curve else None,
            "length": summary.get("eval_response_len_final", rows[-1].get("eval/response_len")),
            "tokens": summary.get("tokens_generated_total", tokens),
            "trained_tokens": summary.get("tokens_trained"),  # the update's compute
            "trained_rows": summary.get("rows_trained"),  # (None in runs before #42)
            "versions": summary.get("versions"),  # libraries it ran on (None in runs before #47)
            "entropy": summary.get("eval_entropy_final", rows[-1].get("eval/entropy"))}


def read_run(path: Path) -> tuple[dict, dict, list[dict]]:
    """(summary.json, config.yaml, metrics.jsonl rows), metrics.jsonl with a row at least, every
    field load_run reads checked: ValueError naming the file (and line) otherwise."""
    summary_file, config_file = path / "summary.json", path / "config.yaml"
    metrics_file = path / "metrics.jsonl"
    if not metrics_file.exists() and not summary_file.exists():
        raise FileNotFoundError(f"{path}: not a run folder (no metrics.jsonl or summary.json)")
    summary, config = {}, {}
    if summary_file.exists():
        with open_regular(summary_file, 1 << 20) as f:
            text = f.read()
        summary = json_line(text, summary_file, 1) or {}
        check_types(summary, summary_file, text.decode())
        check_versions(summary, summary_file)
    if config_file.exists():
        config = read_yaml_file(config_file) or {}
        if not isinstance(config, dict):
            raise ValueError(f"{config_file}: not a run's config: not a mapping of sections")
        try:  # config.py's own rule for each key it knows, as a --config file meets it
            config = typed_mapping(config)
        except ConfigError as e:
            raise ValueError(f"{config_file}: not a run's config: {e}") from None
    return summary, config, metric_rows(metrics_file)


def metric_rows(metrics_file: Path) -> list[dict]:
    """The rows of metrics.jsonl, one at least, each typed, its steps rising and its counters never
    falling (two runs that wrote one file, or a hand edit, would mix two curves)."""
    try:
        numbered = jsonl_rows(metrics_file)
    except ValueError as e:  # a run still writing its last line leaves it without a newline
        if metrics_file.is_file() and not metrics_file.read_bytes().endswith(b"\n"):
            raise ValueError(f"{e} (its last line is cut short: is the run still writing it?)"
                             ) from None
        raise
    if not numbered:
        raise ValueError(f"{metrics_file}: no rows (an empty run, or one before its first step)")
    last = {}  # key: (line, value) of the last row holding it
    for lineno, row in numbered:
        check_types(row, f"{metrics_file}:{lineno}")
        if row.get("step") is None or row.get("generated_tokens") is None:
            raise ValueError(f"{metrics_file}:{lineno}: a row without step or generated_tokens")
        for key in ("step", *COUNTERS):
            if row.get(key) is not None:
                check_order(key, row[key], last.get(key), f"{metrics_file}:{lineno}")
                last[key] = (lineno, row[key])
    return [row for _, row in numbered]


def check_order(key: str, value: float, before: tuple | None, where: str) -> None:
    """ValueError naming `where` for a step that does not rise or a count that falls since the row
    `before` (its line, its value)."""
    if before is None or value > before[1] or (value == before[1] and key != "step"):
        return
    rule = "steps rise" if key == "step" else "a count never falls"
    raise ValueError(f"{where}: {key} {value} after {before[1]} on line {before[0]}: {rule} in "
                     "one run's metrics.jsonl (did two runs write it?)")


def check_versions(summary: dict, where) -> None:
    """ValueError naming `where` unless summary.json's `versions` (the library versions a run
    started and resumed on) is absent, null or a list of strings."""
    versions = summary.get("versions")
    if versions is None:
        return
    if not isinstance(versions, list) or not all(isinstance(v, str) for v in versions):
        raise ValueError(f"{where}: versions must be a list of strings, "
                         f"got {json.dumps(versions)[:40]}")


def check_types(row: dict, where, text: str = "") -> None:
    """ValueError naming `where` and the field (and the line of `text`, a JSON document, holding
    it), for a field of another type than TYPES says (null is allowed; a bool is not a number), or
    a number outside its domain (FRACTIONS in [0, 1], the others finite and ≥ 0)."""
    for key, types in TYPES.items():
        value = row.get(key)
        if value is None:
            continue
        typed = isinstance(value, types) and not isinstance(value, bool)
        if not typed:
            want = "a number" if types is NUMBER else types.__name__
            raise ValueError(f"{where}: {key} must be {want}, got {json.dumps(value)[:40]}")
        top = 1 if key in FRACTIONS else math.inf
        if types is not str and not (value >= 0 and value <= top and math.isfinite(value)):
            line = next((i for i, t in enumerate(text.splitlines(), 1) if f'"{key}"' in t), None)
            at = f"{where}:{line}" if line else where
            want = "in [0, 1]" if top == 1 else "finite and ≥ 0"
            raise ValueError(f"{at}: {key} must be {want}, got {json.dumps(value)[:40]}")


def arm_versions(runs: list[dict]) -> str:
    """The library versions an arm's runs ran on, each once ("not recorded" for runs before
    #47)."""
    seen = []
    for run in runs:
        for version in run["versions"] or ["not recorded"]:
            if version not in seen:
                seen.append(version)
    return "; ".join(seen)


def compare_table(table: list[dict], target: float, budget: float, baseline: str) -> str:
    """The markdown table: the area, final accuracy, then the secondary columns."""
    crossing = f"tokens to {100 * target:.1f}% ÷ {baseline}'s total: median (95% CI) [per seed]"
    gain = table[0]["gain_target"]
    paired = f"÷ {baseline}'s median (paired 95% CI) [at ≤ 0.5× / ≤ 0.3×]"
    columns = ["strategy", "seeds", f"area to {budget:,.0f} tokens % (95% CI) [runs]", "Δ pp",
               "p", "Holm p", "verdict", "detectable Δ pp (80% power, Holm's α/m)",
               "final acc % (95% CI)", "p", "Holm p", crossing, "reached",
               f"tokens to {100 * target:.1f}% {paired}",
               f"tokens to {100 * gain:.1f}% (the gain target) {paired}",
               f"tokens trained to {100 * gain:.1f}% {paired}",
               f"forward-backward token passes to {100 * gain:.1f}% {paired}",
               f"total compute to {100 * gain:.1f}% {paired}",
               f"total compute to {100 * target:.1f}% {paired}",
               (f"steps to {100 * target:.1f}% ÷ the steps {baseline}'s seed-mean curve takes "
                "to hold it (95% CI)"),
               "AES (95% CI)", "eval entropy", "tokens generated", "tokens trained", "rows trained",
               "library versions"]
    lines = ["| " + " | ".join(columns) + " |", "|---|" + "---:|" * (len(columns) - 1)]
    for row in table:
        ratio = "never reached" if math.isinf(row["ratio_median"]) else f"{row['ratio_median']:.2f}"
        seeds = " / ".join("–" if math.isinf(x) else f"{x:.2f}" for x in row["ratios"])
        cells = [row["strategy"], row["seeds"],
                 (f"{100 * row['area_mean']:.1f} ({interval(row['area_ci'], 100, '.1f')}) "
                  f"[{row['area_n']}]"),
                 num(row["area_diff"], "+.1f", 100), num(row["area_p"]), num(row["area_p_holm"]),
                 row["verdict"], num(row["detectable"], ".1f", 100),
                 f"{100 * row['acc_mean']:.1f} ({interval(row['acc_ci'], 100, '.1f')})",
                 num(row["p_vs_base"]), num(row["p_vs_base_holm"]),
                 f"{ratio} ({interval(row['ratio_ci'])}) [{seeds}]",
                 f"{row['reached']}/{row['seeds']}", ratio_cell(row["to_target"]),
                 ratio_cell(row["to_gain"]), ratio_cell(row["trained_to_gain"]),
                 ratio_cell(row["passes_to_gain"]), ratio_cell(row["compute_to_gain"]),
                 ratio_cell(row["compute_to_target"]),
                 f"{num(row['steps_ratio'], '.2f')} ({interval(row['steps_ratio_ci'])})",
                 f"{row['aes_mean']:.3f} ({interval(row['aes_ci'], fmt='.3f')})",
                 f"{row['entropy']:.3f}", f"{row['tokens']:.3g}",
                 num(row["trained_tokens"], ".3g"), num(row["trained_rows"], ".3g"),
                 row["versions"]]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    base = table[0]
    if any(math.isnan(base[k][0]) for k in ("to_target", "to_gain")) or math.isnan(
            base["steps_ratio"]):  # the baseline's own ratio is 1 wherever one is defined
        lines.append(f"\nblank ratios: {baseline} is at the target from its start (0 tokens or "
                     "steps) or has no step-0 eval, so no ratio to it is defined")
    return "\n".join(lines)


def ratio_cell(r: tuple[float, float, float]) -> str:
    """A paired ratio of medians (compare.arm_row's to_target, to_gain), its interval and its
    verdicts at 0.5× and 0.3×: shown (the interval lies at or below), ruled out (above), or not
    shown."""
    if math.isnan(r[0]):
        return ""
    verdicts = []
    for at in (0.5, 0.3):
        verdict = "not shown"
        if r[2] <= at:
            verdict = "shown"
        if r[1] > at:
            verdict = "ruled out"
        verdicts.append(verdict)
    value = "∞" if math.isinf(r[0]) else f"{r[0]:.2f}"
    return f"{value} ({interval(r[1:])}) [{' / '.join(verdicts)}]"


def interval(bounds: tuple[float, float], scale: float = 1.0, fmt: str = ".2f") -> str:
    if any(map(math.isnan, bounds)):  # one seed, or a resample without a defined value
        return "undefined"
    return "–".join("∞" if math.isinf(x) else f"{scale * x:{fmt}}" for x in bounds)


def num(x: float, fmt: str = ".2g", scale: float = 1.0) -> str:
    return "" if math.isnan(x) else f"{scale * x:{fmt}}"  # blank: no test


def write(out: Path, runs: list[dict], result: dict) -> None:
    """compare.csv (per run; the area blank where left out) and compare.json (per arm, per run)."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "compare.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        writer.writeheader()
        for run in runs:
            writer.writerow(run | {"versions": "; ".join(run["versions"] or [])})
    (out / "compare.json").write_text(json.dumps(result | {"runs": runs}, indent=1))
    print(f"\nwrote {out / 'compare.csv'} and {out / 'compare.json'}")


def out_dir_checked(out_dir: str, overwrite: bool) -> None:
    """ValueError unless the comparison may write into `out_dir`: a folder it can make or write (an
    empty path is not the current folder), whose compare.csv, compare.json and curve.md it replaces
    only with --overwrite (eval.py refuses to replace results the same way)."""
    fault = folder_fault(out_dir)
    if fault:
        raise ValueError(f"--out-dir {out_dir!r} {fault}")
    for name in ("compare.csv", "compare.json", "curve.md"):
        fault = file_fault(str(Path(out_dir) / name), overwrite, makes_folder=True)
        if fault:
            raise ValueError(f"--out-dir {out_dir}: {name} {fault}")
