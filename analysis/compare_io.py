"""The files of the run comparison (analysis/compare.py): what it reads of each run folder, every
field checked for its type and domain and the runs of an arm checked to be seeds of one config, and
what it writes: the markdown table of the arms, compare.csv (per run), compare.json (per arm, run).
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from data.loaders import json_line, jsonl_rows, open_regular, read_yaml_file

NUMBER = (int, float)
NUMBERS = ["eval_accuracy_initial", "eval_response_len_final", "tokens_generated_total",
           "eval_entropy_final", "generated_tokens", "tokens/generated_total", "eval/accuracy",
           "eval/accuracy_se", "eval/response_len", "eval/entropy", "tokens/trained",
           "tokens/fwd_bwd", "tokens/no_grad"]
TYPES = {"strategy": str, "seed": int, "step": int} | dict.fromkeys(NUMBERS, NUMBER)
FRACTIONS = {"eval_accuracy_initial", "eval/accuracy", "eval/accuracy_se"}  # in [0, 1]; the
# other numbers finite and ≥ 0 (NaN, inf or a negative count would poison every mean)
# Keys the seeds of one arm may differ in: where a run writes, how it logs, how fast it runs, how
# often it evaluates (common_grid compares curves on the evals all runs share). Anything else
# (evaluation settings included) changes what the runs measure: not pooled without --allow-mixed.
UNCOMPARED = ("seed", "out_dir", "threads", "wandb.", "checkpoint.", "eval.every",
              "reward.workers", "reward.timeout", "reward.batch_budget",
              "model.gradient_checkpointing", "model.compile", "model.device",
              "optim.micro_batch_size", "optim.logprob_batch_size", "rollout.gen_batch_size",
              "rollout.vllm_")
FIELDS = ["path", "strategy", "seed", "final", "length", "tokens", "entropy", "tokens_to_target",
          "tokens_ratio", "tokens_to_gain", "trained_to_gain", "passes_to_gain", "compute_to_gain",
          "compute_to_target", "steps_to_target", "aes", "area", "trained_tokens", "trained_rows"]


def read_run(path: Path) -> tuple[dict, dict, list[dict]]:
    """(summary.json, config.yaml, metrics.jsonl rows), one of summary and metrics at least, every
    field load_run reads checked: ValueError naming the file (and line) otherwise."""
    summary_file, config_file = path / "summary.json", path / "config.yaml"
    metrics_file = path / "metrics.jsonl"
    if not metrics_file.exists() and not summary_file.exists():
        raise FileNotFoundError(f"{path}: not a run folder (no metrics.jsonl or summary.json)")
    summary, config, rows = {}, {}, []
    if summary_file.exists():
        with open_regular(summary_file, 1 << 20) as f:
            text = f.read()
        summary = json_line(text, summary_file, 1) or {}
        check_types(summary, summary_file, text.decode())
    if config_file.exists():
        config = read_yaml_file(config_file) or {}
        sections = ("replay", "rollout", "optim")
        if not isinstance(config, dict) or not all(
                isinstance(config.get(k, {}), dict) for k in sections):
            raise ValueError(f"{config_file}: not a run's config (a mapping of sections)")
    numbered = jsonl_rows(metrics_file) if metrics_file.exists() else []
    for lineno, row in numbered:
        check_types(row, f"{metrics_file}:{lineno}")
        if row.get("step") is None or row.get("generated_tokens") is None:
            raise ValueError(f"{metrics_file}:{lineno}: a row without step or generated_tokens")
        rows.append(row)
    return summary, config, rows


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


def mixed_configs(runs: list[dict]) -> str | None:
    """Why the runs of one arm are not seeds of one experiment (None: they are): two resolved
    configs of the arm differ in a key outside UNCOMPARED. Keys one of them lacks (older code)
    are not compared."""
    first = {}
    for run in runs:
        base = first.setdefault(run["strategy"], run)
        a, b = base["config"], run["config"]
        keys = sorted(k for k in a.keys() & b.keys() if a[k] != b[k])
        keys = [k for k in keys if not k.startswith(UNCOMPARED)]
        if keys:
            shown = ", ".join(f"{k} ({a[k]!r:.20} vs {b[k]!r:.20})" for k in keys[:3])
            more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
            return (f"arm {run['strategy']!r} pools runs of different configs: {base['path']} and "
                    f"{run['path']} differ in {shown}{more}; --allow-mixed pools them anyway")
    return None


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
               f"steps to {100 * target:.1f}% ÷ {baseline}'s (95% CI)",
               "AES (95% CI)", "eval entropy", "tokens generated", "tokens trained", "rows trained"]
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
                 f"{row['steps_ratio']:.2f} ({interval(row['steps_ratio_ci'])})",
                 f"{row['aes_mean']:.3f} ({interval(row['aes_ci'], fmt='.3f')})",
                 f"{row['entropy']:.3f}", f"{row['tokens']:.3g}",
                 num(row["trained_tokens"], ".3g"), num(row["trained_rows"], ".3g")]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
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
    return "–".join("∞" if math.isinf(x) else f"{scale * x:{fmt}}" for x in bounds)


def num(x: float, fmt: str = ".2g", scale: float = 1.0) -> str:
    return "" if math.isnan(x) else f"{scale * x:{fmt}}"  # blank: no test


def write(out: Path, runs: list[dict], result: dict) -> None:
    """compare.csv (per run; the area blank where left out) and compare.json (per arm, per run)."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "compare.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(runs)
    (out / "compare.json").write_text(json.dumps(result | {"runs": runs}, indent=1))
    print(f"\nwrote {out / 'compare.csv'} and {out / 'compare.json'}")
