"""Evaluate a checkpoint on math benchmarks, and compare finished training runs by replay strategy.

Usage:
  python eval.py --model data/tiny_model --benchmarks tiny --k 8 --max-new-tokens 48 --template "{problem}"
  python eval.py --model Qwen/Qwen2.5-Math-1.5B --benchmarks math500,gsm8k,aime24,aime25,amc23 \\
      --data-dir /path/to/benchmarks --k 8 --temperature 0.6 --limit 100 --out-dir eval_results/qwen1.5b
  python eval.py --compare runs/repro/none-s0 runs/repro/none-s1 runs/repro/aper-s0 ... --out-dir runs/repro/compare
  python eval.py --compare runs/repro/none-s0 ... aper_half=runs/repro_half/aper-s0 ...  # arms named by hand

Metrics, k samples per problem, averaged over problems ("macro" weighs every benchmark equally): avg@k (the
unbiased estimate of pass@1, with its standard error over problems), pass@k (Chen et al.'s unbiased estimator),
maj@k (the most frequent answer is right), tokens (mean response tokens), trunc (share that hit the length cap),
entropy (the sampling policy's mean token entropy). A run's model is evaluated into the run: `runs/x/final` writes
`runs/x/eval/final/results.json`, and an existing result is replaced only with --overwrite.

--compare, per strategy against the baseline (`none`), with seeds as the unit of replication:
  tokens to target  generated tokens (phase-I generation included) at which the eval curve, interpolated linearly,
                    first reaches the target (the baseline's mean final accuracy) and then stays at or above the
                    target minus one standard error at every later eval; ÷ the baseline's mean tokens for its run
  steps to target   the same crossing in steps, ÷ the steps at which the baseline's seed-mean curve crosses it
                    (RLEP's measure: the baseline's peak, 135 vs 380 steps)
  final accuracy    mean with a 95 % t interval, and Welch's p against the baseline
  AES               O1-Pruner's accuracy-efficiency score against the baseline's means (`aes`)
  entropy           the sampling policy's token entropy at the last eval
Medians, means and AES carry 95 % percentile bootstrap intervals over seeds (every resample when there are ≤ 6).
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
import random
import re
import statistics
import sys
from collections import Counter
from pathlib import Path

import mpmath
import torch
import yaml
from tqdm import tqdm

import rewards
from data.loaders import NAMED, Problem, load_problems, read_jsonl
from rollout import RolloutConfig, end_ids, generate, load_model, prompt_ids

DEFAULT_TEMPLATE = "{problem}\nPlease reason step by step, and put your final answer within \\boxed{}."


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples, drawn without replacement from n with c correct, is correct."""
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)  # exact integers, one division


def maj_at_k(answers: list[str | None], correct: list[bool]) -> float:
    """1.0 if the most frequent answer is correct. All correct samples form one vote bucket (each equals the gold);
    wrong ones vote by their text (spacing, \\dfrac and \\left/\\right normalised). Samples without an answer do not
    vote; a tie goes to the answer seen first (samples come in random order, so this favours no answer)."""
    votes = Counter(True if ok else re.sub(r"\\left|\\right|\\[!,; ]|\s|\$", "", a).replace("\\dfrac", "\\frac")
                    .replace("\\tfrac", "\\frac").rstrip(".") for a, ok in zip(answers, correct, strict=True)
                    if ok or a is not None)
    return float(bool(votes) and votes.most_common(1)[0][0] is True)  # a bool key never collides with a string


def aes(L: float, A: float, L_b: float, A_b: float, alpha: float = 1.0, beta: float = 3.0, gamma: float = 5.0) -> float:
    """O1-Pruner's accuracy-efficiency score of (length L, accuracy A) against a baseline (L_b, A_b): shorter is
    rewarded by alpha, an accuracy gain by beta, a loss penalised by gamma. NaN if the baseline is 0."""
    if L_b <= 0 or A_b <= 0:
        return math.nan
    dL, dA = (L_b - L) / L_b, (A - A_b) / A_b
    return alpha * dL + (beta * dA if dA >= 0 else gamma * dA)


def evaluate(model, tokenizer, prompts: list[list[int]], golds: list, sampling: RolloutConfig, reward_cfg,
             stop: list[int], desc: str | None = None, keep: bool = False) -> list[dict]:
    """Sample `sampling.group_size` completions per prompt (token ids) and verify them against `golds`. One record per
    prompt: correctness, extracted answers, token counts, truncation and sampling entropy per sample (and, if
    `keep`, the completions with their token ids and behaviour log-probs). A tqdm bar if `desc`."""
    k, records = sampling.group_size, []
    per_call = max(1, sampling.gen_batch_size // k)  # prompts per generate call: ~gen_batch_size sequences
    for start in tqdm(range(0, len(prompts), per_call), desc=desc, disable=desc is None):
        ro, texts = generate(model, tokenizer, prompts[start : start + per_call], sampling, stop)
        gold = [g for g in golds[start : start + per_call] for _ in range(k)]
        _, correct, _ = rewards.score_batch(texts, gold, reward_cfg)
        for j in range(len(texts) // k):
            rows = range(j * k, (j + 1) * k)
            records.append({"gold": golds[start + j], "correct": [bool(correct[i]) for i in rows],
                            "answers": [rewards.extract_answer(texts[i], reward_cfg.last_number_fallback)
                                        for i in rows],
                            "tokens": ro.completion_len[rows].tolist(), "truncated": ro.truncated[rows].tolist(),
                            "entropy": ro.entropy[rows].tolist(), "sample": texts[j * k]})  # a completion to read
            if keep:
                comp = [(i, slice(int(ro.prompt_len[i]), int(ro.seq_len[i]))) for i in rows]
                records[-1] |= {"completions": [texts[i] for i in rows], "behav_logp": [ro.behav_logp[i, c].tolist()
                                for i, c in comp], "ids": [ro.tokens[i, c].tolist() for i, c in comp]}
    return records


METRICS = ["accuracy", "pass@k", "maj@k", "response_len", "truncation_rate", "entropy"]


def summarize(records: list[dict]) -> dict[str, float]:
    """Per-problem metrics averaged over problems (accuracy's standard error over problems too); lengths and
    truncation over all samples; entropy a token mean (samples weigh by their length)."""
    acc = [sum(r["correct"]) / len(r["correct"]) for r in records]
    tokens = [t for r in records for t in r["tokens"]]
    se = statistics.stdev(acc) / len(acc) ** 0.5 if len(acc) > 1 else 0.0
    return {"accuracy": statistics.fmean(acc), "accuracy_se": se, "pass@k": statistics.fmean(
                pass_at_k(len(r["correct"]), sum(r["correct"]), len(r["correct"])) for r in records),
            "maj@k": statistics.fmean(maj_at_k(r["answers"], r["correct"]) for r in records), "response_len":
            statistics.fmean(tokens), "truncation_rate": statistics.fmean(t for r in records for t in r["truncated"]),
            "entropy": sum(e * n for r in records for e, n in zip(r["entropy"], r["tokens"])) / max(1, sum(tokens)),
            "n": len(records)}


def macro(results: dict[str, dict]) -> dict[str, float]:
    """Every benchmark weighs the same."""
    return {m: statistics.fmean(r[m] for r in results.values()) for m in METRICS} | {
        "n": sum(r["n"] for r in results.values())}


def results_table(results: dict[str, dict], k: int) -> str:
    """Markdown table, one row per benchmark plus the macro average; accuracies in percent."""
    rows = results | ({"macro": macro(results)} if len(results) > 1 else {})
    return "\n".join([f"| benchmark | problems | avg@{k} | pass@{k} | maj@{k} | tokens | trunc | entropy |",
                      "|---|---:|---:|---:|---:|---:|---:|---:|"] + [
        f"| {name} | {r['n']} | " + " | ".join(f"{100 * r[m]:.1f}" for m in METRICS[:3])
        + f" | {r['response_len']:.1f} | {100 * r['truncation_rate']:.1f}% | {r['entropy']:.3f} |"
        for name, r in rows.items()])


# ------------------------------------------------------------------------------------------- comparing runs


def load_run(path: str | Path) -> dict:
    """A finished (or unfinished) run folder: its strategy (`dynamic` for none with rollout.dynamic_sampling), seed,
    eval curve and summary."""
    path = Path(path)
    if not (path / "metrics.jsonl").is_file() and not (path / "summary.json").is_file():
        raise FileNotFoundError(f"{path}: not a run folder (no metrics.jsonl or summary.json)")
    summary = json.loads((path / "summary.json").read_text()) if (path / "summary.json").is_file() else {}
    config = yaml.safe_load((path / "config.yaml").read_text()) if (path / "config.yaml").is_file() else {}
    rows = read_jsonl(path / "metrics.jsonl") if (path / "metrics.jsonl").is_file() else []
    strategy = summary.get("strategy") or (config.get("replay") or {}).get("strategy")
    if strategy is None:
        raise ValueError(f"{path}: no replay strategy in summary.json or config.yaml")
    if (config.get("rollout") or {}).get("dynamic_sampling"):  # regenerating is its own arm, never the baseline
        strategy = "dynamic" if strategy == "none" else f"{strategy}+dynamic"
    acc0 = summary.get("eval_accuracy_initial")
    spent = rows[0].get("tokens/generated_total", 0) - rows[0].get("generated_tokens", 0) if rows else 0  # phase I
    start = [(0, spent, acc0, 0.0)] if acc0 is not None else []
    curve = start + [(r["step"], r.get("tokens/generated_total", r["generated_tokens"]), r["eval/accuracy"],
                      r.get("eval/accuracy_se", 0.0)) for r in rows if r.get("eval/accuracy") is not None]
    last = rows[-1] if rows else {}
    return {"path": str(path), "strategy": strategy, "seed": summary.get("seed", config.get("seed")), "curve": curve,
            "final": curve[-1][2] if curve else None,
            "length": summary.get("eval_response_len_final", last.get("eval/response_len")),
            "tokens": summary.get("tokens_generated_total", last.get("tokens/generated_total",
                                                                     last.get("generated_tokens"))),
            "entropy": summary.get("eval_entropy_final", last.get("eval/entropy"))}


def sustained_crossing(curve: list[tuple], target: float) -> float | None:
    """Generated tokens where the eval curve (step, tokens, accuracy, standard error) first reaches `target` by linear
    interpolation between evals, counting a crossing only if every later eval stays ≥ target − its standard
    error."""
    for j, (_, x, y, _) in enumerate(curve):
        if y >= target and all(y2 >= target - se for _, _, y2, se in curve[j + 1 :]):
            if j == 0:
                return x
            x0, y0 = curve[j - 1][1], curve[j - 1][2]
            return x0 + (target - y0) / (y - y0) * (x - x0) if y > y0 else x
    return None


def bootstrap(values: list[float], stat=statistics.median, level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of `stat` over `values` (seeds): every resample when there are ≤ 6 values,
    else 20,000 drawn with a fixed seed. Unreached targets enter as inf."""
    n = len(values)
    rng = random.Random(0)
    draws = itertools.product(values, repeat=n) if n <= 6 else (rng.choices(values, k=n) for _ in range(20_000))
    stats = sorted(stat(d) for d in draws)

    def percentile(q):  # linear between neighbours, as numpy's default, but inf stays inf
        i, f = divmod(q / 100 * (len(stats) - 1), 1)
        a, b = stats[int(i)], stats[min(int(i) + 1, len(stats) - 1)]
        return a if f == 0 or a == b else a + f * (b - a)

    return percentile(50 - 50 * level), percentile(50 + 50 * level)


def t_sf(t: float, df: float) -> float:
    """P(T > t) for Student's t with `df` degrees of freedom (regularized incomplete beta, from mpmath)."""
    p = 0.5 * float(mpmath.betainc(df / 2, 0.5, 0, df / (df + t * t), regularized=True))
    return p if t >= 0 else 1 - p


def mean_interval(xs: list[float], level: float = 0.95) -> tuple[float, float]:
    """Student-t interval of the mean (the quantile found by bisection)."""
    if len(xs) < 2:
        return (math.nan, math.nan)
    lo, hi = 0.0, 1e3
    for _ in range(100):
        lo, hi = (lo, (lo + hi) / 2) if t_sf((lo + hi) / 2, len(xs) - 1) < (1 - level) / 2 else ((lo + hi) / 2, hi)
    half = hi * statistics.stdev(xs) / len(xs) ** 0.5
    return statistics.fmean(xs) - half, statistics.fmean(xs) + half


def welch_p(a: list[float], b: list[float]) -> float:
    """Two-sided p-value of Welch's t-test that the means of `a` and `b` differ."""
    va, vb = (statistics.variance(x) / len(x) if len(x) > 1 else math.nan for x in (a, b))
    if not va + vb > 0:
        return math.nan if math.isnan(va + vb) else float(statistics.fmean(a) == statistics.fmean(b))
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    return 2 * t_sf(abs(statistics.fmean(a) - statistics.fmean(b)) / math.sqrt(va + vb), df)


def unreached(x: float | None) -> float:
    return math.inf if x is None else x  # (0 is a crossing at the start, not "never")


def seed_mean_curve(runs: list[dict]) -> list[tuple]:
    """(step, step, mean accuracy, its standard error: mean se / √seeds) at the steps every run evaluated."""
    at = {}
    for r in runs:
        for step, _, acc, se in r["curve"]:
            at.setdefault(step, []).append((acc, se))
    return [(k, k, statistics.fmean(a for a, _ in v), statistics.fmean(e for _, e in v) / len(v) ** 0.5)
            for k, v in sorted(at.items()) if len(v) == len(runs)]


def compare_runs(runs: list[dict], baseline: str = "none", target: float | None = None, aes_weights=(1.0, 3.0, 5.0)):
    """(per-run rows, per-strategy rows, target): the measures of the module docstring against the `baseline` runs."""
    base = [r for r in runs if r["strategy"] == baseline and r["final"] is not None]
    A_b, L_b, T_b = (statistics.fmean(r[k] for r in base) if base else math.nan for k in ("final", "length", "tokens"))
    target = A_b if target is None else target
    for r in runs:
        x = sustained_crossing(r["curve"], target) if not math.isnan(target) else None
        by_step = [(c[0], c[0], *c[2:]) for c in r["curve"]]  # the same rule with steps in place of tokens
        r["steps_to_target"] = sustained_crossing(by_step, target) if not math.isnan(target) else None
        r |= {"tokens_to_target": x, "tokens_ratio": x / T_b if x is not None and T_b > 0 else None,
              "aes": math.nan if None in (r["length"], r["final"]) else aes(r["length"], r["final"], L_b, A_b,
                                                                             *aes_weights)}
    groups = {}
    for r in runs:
        groups.setdefault(r["strategy"], []).append(r)
    S_b = unreached(sustained_crossing(seed_mean_curve(base), target)) if base and not math.isnan(target) else math.nan
    summary = []
    for s, g in sorted(groups.items(), key=lambda kv: (kv[0] != baseline, kv[0])):
        acc, ratios = [r["final"] for r in g if r["final"] is not None], [unreached(r["tokens_ratio"]) for r in g]
        aes_v = [r["aes"] for r in g if not math.isnan(r["aes"])]
        steps = [unreached(r["steps_to_target"]) / S_b if S_b > 0 else math.nan for r in g]  # ÷ the baseline's
        summary.append({"strategy": s, "seeds": len(g), "ratios": ratios, "ratio_median": statistics.median(ratios),
                        "ratio_ci": bootstrap(ratios), "reached": sum(math.isfinite(x) for x in ratios),
                        "steps_ratio": statistics.median(steps), "steps_ratio_ci": bootstrap(steps),
                        "acc_mean": statistics.fmean(acc), "acc_ci": mean_interval(acc),
                        "p_vs_base": welch_p(acc, [r["final"] for r in base]) if s != baseline else math.nan,
                        "aes_mean": statistics.fmean(aes_v) if aes_v else math.nan,
                        "aes_ci": bootstrap(aes_v, statistics.fmean) if aes_v else (math.nan,) * 2,
                        "entropy": math.nan if any(r["entropy"] is None for r in g) else
                        statistics.fmean(r["entropy"] for r in g),
                        "tokens": statistics.fmean(r["tokens"] for r in g)})
    return runs, summary, target


def compare_table(summary: list[dict], target: float, baseline: str = "none") -> str:
    def ci(a, b, scale=1.0, fmt=".2f"):
        return "–".join("∞" if math.isinf(x) else f"{scale * x:{fmt}}" for x in (a, b))

    lines = [(f"| strategy | seeds | final acc % (95% CI) | p vs {baseline} | tokens to {100 * target:.1f}% ÷ "
              f"{baseline}'s: median (95% CI) [per seed] | reached | steps to it ÷ {baseline}'s (95% CI) | "
              f"AES vs {baseline} (95% CI) | eval entropy | tokens generated |"),
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in summary:
        ratio = "never reached" if math.isinf(s["ratio_median"]) else f"{s['ratio_median']:.2f}"
        seeds = " / ".join("–" if math.isinf(x) else f"{x:.2f}" for x in s["ratios"])
        p = "" if math.isnan(s["p_vs_base"]) else f"{s['p_vs_base']:.3f}"
        acc = f"{100 * s['acc_mean']:.1f} ({ci(*s['acc_ci'], 100, '.1f')})"
        lines.append(f"| {s['strategy']} | {s['seeds']} | {acc} | {p} | "
                     f"{ratio} ({ci(*s['ratio_ci'])}) [{seeds}] | {s['reached']}/{s['seeds']} | "
                     f"{s['steps_ratio']:.2f} ({ci(*s['steps_ratio_ci'])}) | {s['aes_mean']:.3f} "
                     f"({ci(*s['aes_ci'], fmt='.3f')}) | {s['entropy']:.3f} | {s['tokens']:.3g} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- CLI


def fail(msg: str) -> None:
    print(f"eval.py: error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def run_compare(args) -> None:
    try:
        runs = [load_run(d.partition("=")[2]) | {"strategy": d.partition("=")[0]} if "=" in d.split("/")[0]
                else load_run(d) for d in args.compare]  # LABEL=RUN_DIR names the arm
    except (FileNotFoundError, ValueError) as e:
        fail(str(e))
    weights = (args.aes_alpha, args.aes_beta, args.aes_gamma)
    rows, summary, target = compare_runs(runs, args.baseline, args.target, weights)
    print(compare_table(summary, target, args.baseline))
    out = Path(args.out_dir or "eval_results/compare")
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "compare.csv", "w", newline="") as f:
        keys = ["path", "strategy", "seed", "final", "length", "tokens", "entropy", "tokens_to_target", "tokens_ratio",
                "steps_to_target", "aes"]
        csv.DictWriter(f, fieldnames=keys, extrasaction="ignore").writerows([dict(zip(keys, keys))] + rows)
    (out / "compare.json").write_text(json.dumps({"target": target, "strategies": summary, "runs": rows}, indent=1))
    print(f"\nwrote {out / 'compare.csv'} and {out / 'compare.json'}")


def default_out_dir(model: str) -> Path:
    """A run's model is evaluated into that run (`runs/x/final` → `runs/x/eval/final`); others into eval_results/."""
    path = Path(model).expanduser()
    run = next((p for p in (path.parent, path.parent.parent) if (p / ".run").is_file()), None)
    return run / "eval" / "_".join(path.relative_to(run).parts) if run else Path("eval_results") / path.name


def run_eval(args) -> None:
    for ok, msg in [(args.k >= 1, f"--k must be ≥ 1, got {args.k}"),
                    (args.limit is None or args.limit >= 1, "--limit must be ≥ 1"),
                    (args.max_new_tokens >= 1, f"--max-new-tokens must be ≥ 1, got {args.max_new_tokens}"),
                    (args.batch_size >= 1, f"--batch-size must be ≥ 1, got {args.batch_size}"),
                    (args.temperature >= 0, f"--temperature must be ≥ 0, got {args.temperature}"),
                    (0 < args.top_p <= 1, f"--top-p must be in (0, 1], got {args.top_p}"),
                    ("{problem}" in args.template, "--template must contain {problem}")]:
        fail(msg) if not ok else None
    out = Path(args.out_dir) if args.out_dir else default_out_dir(args.model)
    for f in (out / "results.json", Path(args.save_correct or "")) if not args.overwrite else ():
        fail(f"{f} exists; pass --overwrite to replace it or --out-dir to write elsewhere") if f.is_file() else None
    fail(f"--out-dir {out} is a file") if out.exists() and not out.is_dir() else None
    benchmarks = {}
    for spec in args.benchmarks.split(","):
        try:  # all data first, so a typo fails before a slow model load
            named = spec in NAMED or spec in ("tiny", "tiny_train") or spec.startswith("hf:")
            name = spec if named else Path(spec).stem
            benchmarks[name] = load_problems(spec, data_dir=args.data_dir, problem_key=args.problem_key,
                                             answer_key=args.answer_key, limit=args.limit)
        except (ValueError, FileNotFoundError, ImportError, TypeError) as e:
            fail(str(e))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        model, tokenizer = load_model(args.model, args.trust_remote_code, dtype)
        stop = end_ids(tokenizer, model, args.chat_template, args.stop_tokens.split(",") if args.stop_tokens else [])
    except Exception as e:  # noqa: BLE001 -- any failure to load is one line about the model
        fail(f"cannot load model {args.model}: {' '.join(str(e).split())[:300] or type(e).__name__}")
    sampling = RolloutConfig(group_size=args.k, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                             top_p=args.top_p, top_k=args.top_k, gen_batch_size=args.batch_size)
    torch.manual_seed(args.seed)
    results, records = {}, {}
    for name, problems in benchmarks.items():
        prompts = [prompt_ids(tokenizer, p.problem, args.template, args.chat_template, args.system_prompt)
                   for p in problems]
        records[name] = evaluate(model.to(device), tokenizer, prompts, [p.answer for p in problems], sampling,
                                 rewards.RewardConfig(), stop, desc=name, keep=bool(args.save_correct))
        [r.update(id=p.id) for p, r in zip(problems, records[name])]
        results[name] = summarize(records[name])
    if args.save_correct:
        tokens = sum(t for recs in records.values() for r in recs for t in r["tokens"])
        meta = {"generated_tokens": tokens, "model": args.model, "k": args.k, "temperature": args.temperature,
                "top_p": args.top_p}
        n = save_correct(args.save_correct, [p for ps in benchmarks.values() for p in ps],
                         [r for recs in records.values() for r in recs], meta)
        print(f"wrote {n} verified-correct completions to {args.save_correct} ({tokens} tokens generated)")
    print(results_table(results, args.k))
    try:
        out.mkdir(parents=True, exist_ok=True)
        summary = {"args": vars(args), "macro": macro(results), "benchmarks": results, "problems": records}
        (out / "results.json").write_text(json.dumps(summary, indent=1))
    except OSError as e:
        fail(f"cannot write {out / 'results.json'}: {e.strerror}")
    print(f"\nwrote {out / 'results.json'}")


def save_correct(path: str, problems: list[Problem], records: list[dict], meta: dict) -> int:
    """RLEP phase I: every verified-correct completion of `records` (evaluate(keep=True)) with its problem text, token
    ids and behaviour log-probs, so phase II replays exactly these tokens; `<path>.meta.json` gets `meta` (the tokens
    this sampling generated among it). Returns the number of completions written."""
    n = 0
    with open(path, "w") as f:
        for p, r in zip(problems, records, strict=True):
            for text, ids, lp, ok in zip(r.pop("completions"), r.pop("ids"), r.pop("behav_logp"), r["correct"]):
                if ok:
                    f.write(json.dumps({"problem": p.problem, "completion": text, "completion_ids": ids,
                                        "behav_logp": [round(x, 6) for x in lp]}) + "\n")
                    n += 1
    Path(path + ".meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return n


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--model", help="local checkpoint folder or Hugging Face model id")
    mode.add_argument("--compare", nargs="+", metavar="RUN_DIR", help="training run folders to compare; LABEL=RUN_DIR "
                      "puts a run in arm LABEL (default: its strategy)")
    ap.add_argument("--out-dir", help="where results go (default: <run>/eval/<model>, eval_results/<model>, "
                    "eval_results/compare)")
    g = ap.add_argument_group("evaluating a model")
    g.add_argument("--benchmarks", default="tiny", help=f"comma list of tiny, {', '.join(NAMED)}, .jsonl/.parquet "
                   "paths, hf:NAME")
    g.add_argument("--data-dir", help="folder holding the benchmark files (math500_test.jsonl, ...)")
    g.add_argument("--problem-key", help="problem field of a custom file (default: problem/question/prompt)")
    g.add_argument("--answer-key", help="answer field of a custom file (default: answer/solution)")
    g.add_argument("--limit", type=int, help="first N problems of each benchmark")
    g.add_argument("--k", type=int, default=8, help="samples per problem")
    g.add_argument("--temperature", type=float, default=0.6, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--max-new-tokens", type=int, default=1024)
    g.add_argument("--batch-size", type=int, default=64, help="sequences per generate call")
    g.add_argument("--template", default=DEFAULT_TEMPLATE, help="instruction text, {problem} replaced by the problem")
    g.add_argument("--no-chat-template", dest="chat_template", action="store_false", help="plain prompts")
    g.add_argument("--system-prompt", default="", help="system turn of the chat template (empty = none)")
    g.add_argument("--stop-tokens", default="", help="comma-separated extra end tokens")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--trust-remote-code", action="store_true")
    g.add_argument("--save-correct", metavar="JSONL", help="write every verified-correct completion (RLEP phase I)")
    g.add_argument("--overwrite", action="store_true", help="replace existing results")
    c = ap.add_argument_group("comparing runs")
    c.add_argument("--baseline", default="none", help="strategy the ratios, p-values and AES are measured against")
    c.add_argument("--target", type=float, help="eval accuracy (0-1) for tokens-to-target (default: the baseline's "
                   "final mean)")
    c.add_argument("--aes-alpha", type=float, default=1.0)
    c.add_argument("--aes-beta", type=float, default=3.0)
    c.add_argument("--aes-gamma", type=float, default=5.0)
    args = ap.parse_args(argv)
    run_compare(args) if args.compare else run_eval(args)


if __name__ == "__main__":
    main()
