"""Evaluate a checkpoint on math benchmarks, and compare finished training runs by replay strategy.

Usage:
  python eval.py --model data/tiny_model --benchmarks tiny --k 8 --max-new-tokens 48 --template "{problem}"
  python eval.py --model Qwen/Qwen2.5-Math-1.5B --benchmarks math500,gsm8k,aime24,aime25,amc23 \\
      --data-dir /path/to/benchmarks --k 8 --temperature 0.6 --limit 100 --out-dir eval_results/qwen1.5b
  python eval.py --model CKPT --benchmarks my.jsonl --problem-key question --answer-key final
  python eval.py --compare runs/none-s0 runs/none-s1 runs/fifo-s0 runs/fifo-s1 --out-dir eval_results/compare

Metrics, k samples per problem, averaged over problems ("macro" weighs every benchmark equally):
  avg@k   mean accuracy of the k samples (the unbiased estimate of pass@1)
  pass@k  Chen et al. (2021) unbiased estimator 1 - C(n-c, k)/C(n, k); here n = k samples per problem
  maj@k   the most frequent extracted answer is correct
  tokens  mean response tokens (EOS included); trunc: fraction of responses that hit --max-new-tokens
  AES     O1-Pruner's accuracy-efficiency score against a baseline (see `aes`), used by --compare
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import statistics
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from tqdm import tqdm

import rewards
from data.loaders import NAMED, Problem, load_problems, read_jsonl
from replay import STRATEGIES
from rollout import RolloutConfig, end_ids, generate, load_model, prompt_ids

DEFAULT_TEMPLATE = "{problem}\nPlease reason step by step, and put your final answer within \\boxed{}."

# ---------------------------------------------------------------------------------------------- metrics


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples, drawn without replacement from n with c correct, is correct."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)  # exact integers, one division


def avg_at_k(correct: list[bool]) -> float:
    return sum(correct) / len(correct)


def _vote_key(answer: str) -> str:
    """Light normalisation so that `\\dfrac{1}{2}` and `\\frac{1}{2} ` vote together; the verifier does the rest."""
    s = re.sub(r"\\left|\\right|\\[!,; ]|\s|\$", "", answer)
    return s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").rstrip(".")


def maj_at_k(answers: list[str | None], correct: list[bool]) -> float:
    """1.0 if the most frequent answer is correct. Every correct answer equals the gold, so all correct samples
    form one vote bucket; wrong ones vote by their normalised text. Samples without an answer do not vote, and
    ties go to the answer seen first (samples are in random order, so this favours no answer)."""
    votes = Counter()
    for answer, ok in zip(answers, correct, strict=True):
        if ok:
            votes[True] += 1  # a bool key never collides with an answer string
        elif answer is not None:
            votes[_vote_key(answer)] += 1
    return float(bool(votes) and votes.most_common(1)[0][0] is True)


def aes(L: float, A: float, L_b: float, A_b: float, alpha: float = 1.0, beta: float = 3.0, gamma: float = 5.0) -> float:
    """O1-Pruner's accuracy-efficiency score of (length L, accuracy A) against a baseline (L_b, A_b).
    Shorter is rewarded by alpha; an accuracy gain by beta, a loss penalised by gamma. NaN if the baseline is 0."""
    if L_b <= 0 or A_b <= 0:
        return math.nan
    dL, dA = (L_b - L) / L_b, (A - A_b) / A_b
    return alpha * dL + beta * abs(dA) if dA >= 0 else alpha * dL - gamma * abs(dA)


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else math.nan


# ---------------------------------------------------------------------------------------------- evaluation


def evaluate(model, tokenizer, prompts: list[list[int]], golds: list, sampling: RolloutConfig, reward_cfg,
             stop: list[int], desc: str | None = None, keep: bool = False) -> list[dict]:
    """Sample `sampling.group_size` completions per prompt (token ids) and verify them against `golds`. One record
    per prompt: per-sample correctness, extracted answers, token counts, mean sampling entropies (and, if `keep`,
    every completion with its token ids and behaviour log-probs). A tqdm bar if `desc`."""
    k = sampling.group_size
    per_call = max(1, sampling.gen_batch_size // k)  # prompts per generate call: ~gen_batch_size sequences
    records = []
    for start in tqdm(range(0, len(prompts), per_call), desc=desc, disable=desc is None):
        ro, texts = generate(model, tokenizer, prompts[start : start + per_call], sampling, stop)
        _, correct, _ = rewards.score_batch(texts, [g for g in golds[start : start + per_call] for _ in range(k)], reward_cfg)
        for j in range(len(texts) // k):
            rows = range(j * k, (j + 1) * k)
            records.append({
                "gold": golds[start + j], "correct": [bool(correct[i]) for i in rows],
                "answers": [rewards.extract_answer(texts[i], reward_cfg.last_number_fallback) for i in rows],
                "tokens": ro.completion_len[rows].tolist(), "truncated": ro.truncated[rows].tolist(),
                "entropy": ro.entropy[rows].tolist(), "sample": texts[j * k],  # one completion, to read what the model does
                **({"completions": [texts[i] for i in rows], "ids": [ro.tokens[i, ro.prompt_len[i]: ro.seq_len[i]].tolist()
                    for i in rows], "behav_logp": [ro.behav_logp[i, ro.prompt_len[i]: ro.seq_len[i]].tolist() for i in rows]}
                   if keep else {}),
            })
    return records


METRICS = ["accuracy", "pass@k", "maj@k", "response_len", "truncation_rate"]


def summarize(records: list[dict]) -> dict[str, float]:
    """Per-problem metrics averaged over problems; lengths and truncation averaged over all samples."""
    return {
        "accuracy": _mean(avg_at_k(r["correct"]) for r in records),  # avg@k
        "pass@k": _mean(pass_at_k(len(r["correct"]), sum(r["correct"]), len(r["correct"])) for r in records),
        "maj@k": _mean(maj_at_k(r["answers"], r["correct"]) for r in records),
        "response_len": _mean(t for r in records for t in r["tokens"]),
        "truncation_rate": _mean(t for r in records for t in r["truncated"]),
        "entropy": (sum(e * n for r in records for e, n in zip(r["entropy"], r["tokens"]))  # token mean, sampling policy
                    / max(1, sum(n for r in records for n in r["tokens"]))),
        "n": len(records),
    }


def results_table(results: dict[str, dict], k: int) -> str:
    """Markdown table, one row per benchmark plus the macro average; accuracies in percent."""
    lines = [f"| benchmark | problems | avg@{k} | pass@{k} | maj@{k} | tokens | trunc |", "|---|---:|---:|---:|---:|---:|---:|"]
    rows = dict(results)
    if len(results) > 1:
        rows["macro"] = {"n": sum(r["n"] for r in results.values())} | macro_average(results)
    for name, r in rows.items():
        acc = " | ".join(f"{100 * r[m]:.1f}" for m in METRICS[:3])
        lines.append(f"| {name} | {r['n']} | {acc} | {r['response_len']:.1f} | {100 * r['truncation_rate']:.1f}% |")
    return "\n".join(lines)


def macro_average(results: dict[str, dict]) -> dict:
    return {m: _mean(r[m] for r in results.values()) for m in METRICS}


# ---------------------------------------------------------------------------------------------- comparing runs


@dataclass
class Run:
    path: Path
    strategy: str
    seed: int | None
    records: list[dict]  # metrics.jsonl, one dict per training step
    summary: dict  # summary.json, empty if the run did not finish

    def final(self, summary_key: str, metric_key: str) -> float | None:
        """From summary.json when present, else the last step that logged `metric_key`."""
        if self.summary.get(summary_key) is not None:
            return self.summary[summary_key]
        return next((r[metric_key] for r in reversed(self.records) if r.get(metric_key) is not None), None)

    def evals(self) -> list[tuple[int, float, float]]:
        """(step, generated tokens, eval accuracy) at every eval, starting with the step-0 eval from summary.json."""
        start = [(0, 0, self.summary["eval_accuracy_initial"])] if self.summary.get("eval_accuracy_initial") is not None else []
        return start + [(r["step"], r["generated_tokens"], r["eval/accuracy"]) for r in self.records if r.get("eval/accuracy") is not None]


def load_run(path: str | Path) -> Run:
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"run folder not found: {path}")
    metrics, summary = path / "metrics.jsonl", path / "summary.json"
    if not metrics.exists() and not summary.exists():
        raise FileNotFoundError(f"{path}: not a run folder (no metrics.jsonl or summary.json)")
    summary = json.loads(summary.read_text()) if summary.exists() else {}
    config = yaml.safe_load((path / "config.yaml").read_text()) if (path / "config.yaml").exists() else {}
    strategy = summary.get("strategy") or (config.get("replay") or {}).get("strategy")
    if strategy is None:
        raise ValueError(f"{path}: no replay strategy in summary.json or config.yaml")
    records = read_jsonl(metrics) if metrics.exists() else []
    return Run(path, strategy, summary.get("seed", config.get("seed")), records, summary)


def first_reach(run: Run, target: float) -> tuple[int, float] | tuple[None, None]:
    """(step, generated tokens) of the first eval whose accuracy reaches `target`; (None, None) if none does."""
    return next(((step, tokens) for step, tokens, acc in run.evals() if acc >= target), (None, None))


def compare_runs(runs: list[Run], *, baseline: str = "none", target: float | None = None,
                 alpha: float = 1.0, beta: float = 3.0, gamma: float = 5.0) -> tuple[list[dict], float | None]:
    """One row per run, with what the replay papers claim measured against the `baseline` group:
      tokens_ratio  generated tokens to reach `target` (default: the baseline's mean final accuracy),
                    divided by the baseline's mean generated tokens for the whole run;
      steps_ratio   steps to reach the baseline's peak (the maximum of its seed-mean eval curve),
                    divided by the step at which the baseline reached that peak;
      aes           accuracy-efficiency score against the baseline's mean final accuracy and response length."""
    base = [r for r in runs if r.strategy == baseline]
    A_b = _mean(r.final("eval_accuracy_final", "eval/accuracy") for r in base) if base else math.nan
    L_b = _mean(r.final("eval_response_len_final", "eval/response_len") for r in base) if base else math.nan
    T_b = _mean(r.final("generated_tokens", "generated_tokens") for r in base) if base else math.nan
    if target is None and base:
        target = A_b
    by_step: dict[int, list[float]] = {}
    for r in base:
        for step, _, acc in r.evals():
            by_step.setdefault(step, []).append(acc)
    curve = [(step, _mean(accs)) for step, accs in sorted(by_step.items()) if len(accs) == len(base)]
    peak_step, peak = max(curve, key=lambda c: (c[1], -c[0])) if curve else (None, None)
    rows = []
    for r in runs:
        A, L = r.final("eval_accuracy_final", "eval/accuracy"), r.final("eval_response_len_final", "eval/response_len")
        _, tokens = first_reach(r, target) if target is not None else (None, None)
        steps, _ = first_reach(r, peak) if peak is not None else (None, None)
        rows.append({
            "run": str(r.path), "strategy": r.strategy, "seed": r.seed, "final_accuracy": A, "final_response_len": L,
            "tokens_to_target": tokens, "tokens_ratio": tokens / T_b if tokens is not None and T_b > 0 else None,
            "steps_to_peak": steps, "steps_ratio": steps / peak_step if steps is not None and peak_step else None,
            "generated_tokens": r.final("generated_tokens", "generated_tokens"),
            "entropy_final": r.final("entropy_final", "entropy"), "wall_seconds": r.final("wall_seconds", "wall_seconds"),
            "aes": aes(L, A, L_b, A_b, alpha, beta, gamma) if None not in (A, L) else math.nan,
        })
    return rows, target, peak


def _pm(values: list, scale: float = 1.0, fmt: str = ".1f") -> str:
    """mean ± sample std over seeds (just the mean for one seed); missing values are left out."""
    xs = [scale * v for v in values if v is not None and not math.isnan(v)]
    if not xs:
        return "n/a"
    return f"{_mean(xs):{fmt}}" + (f" ± {statistics.stdev(xs):{fmt}}" if len(xs) > 1 else "")


def _median(values: list, reached: int) -> str:
    """Median over seeds; a seed that never reached counts as infinitely slow, as a median should."""
    xs = sorted(v if v is not None else math.inf for v in values)
    m = statistics.median(xs) if xs else math.inf
    return ("not reached" if math.isinf(m) else f"{m:.2f}") + f" ({reached}/{len(xs)})"


def compare_table(rows: list[dict], target: float | None, peak: float | None = None, baseline: str = "none") -> str:
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["strategy"], []).append(r)
    order = sorted(groups, key=lambda s: (s != baseline, s))
    tgt = "n/a" if target is None else f"{100 * target:.1f}%"
    pk = "n/a" if peak is None else f"{100 * peak:.1f}%"
    lines = [(f"| strategy | seeds | final acc (%) | tokens to {tgt} ÷ {baseline} tokens, median (reached) | "
              f"steps to {pk} ÷ {baseline}'s, median (reached) | entropy (end) | wall time (s) | AES vs {baseline} |"),
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for s in order:
        g = groups[s]
        tok = _median([r["tokens_ratio"] for r in g], sum(r["tokens_ratio"] is not None for r in g))
        stp = _median([r["steps_ratio"] for r in g], sum(r["steps_ratio"] is not None for r in g))
        lines.append(f"| {s} | {len(g)} | {_pm([r['final_accuracy'] for r in g], 100)} | {tok} | {stp} | "
                     f"{_pm([r['entropy_final'] for r in g], fmt='.3f')} | {_pm([r['wall_seconds'] for r in g], fmt='.0f')} | "
                     f"{_pm([r['aes'] for r in g], fmt='.3f')} |")
    return "\n".join(lines)


def plot_curves(runs: list[Run], path: Path) -> bool:
    """Eval accuracy vs generated tokens: per strategy, the seed mean with a min-max band, on the token range
    every seed covers (seeds evaluate at different token counts, so curves are interpolated onto one grid)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed, skipping the plot (pip install matplotlib)")
        return False
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4.5))
    rank = {s: i for i, s in enumerate(STRATEGIES)}  # registry order: one colour per strategy in every plot
    for strategy in sorted({r.strategy for r in runs}, key=lambda s: (rank.get(s, len(rank)), s)):
        curves = [np.array(r.evals(), dtype=float).T[1:] for r in runs if r.strategy == strategy and r.evals()]
        if not curves:
            continue
        lo, hi = max(c[0][0] for c in curves), min(c[0][-1] for c in curves)
        grid = np.linspace(lo, max(lo, hi), 100)
        ys = 100 * np.stack([np.interp(grid, x, y) for x, y in curves])  # (seeds, 100)
        colour = f"C{rank[strategy]}" if strategy in rank else None
        (line,) = ax.plot(grid, ys.mean(0), color=colour, label=f"{strategy} (n={len(curves)})")
        ax.fill_between(grid, ys.min(0), ys.max(0), color=line.get_color(), alpha=0.2)
    ax.set(xlabel="generated tokens", ylabel="eval accuracy (%)", title="eval accuracy vs generation cost (band: min-max over seeds)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------------------------- CLI


def fail(msg: str) -> None:
    print(f"eval.py: error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def run_compare(args) -> None:
    try:
        runs = [load_run(d) for d in args.compare]
    except (FileNotFoundError, ValueError) as e:
        fail(str(e))
    rows, target, peak = compare_runs(runs, baseline=args.baseline, target=args.target,
                                      alpha=args.aes_alpha, beta=args.aes_beta, gamma=args.aes_gamma)
    print(compare_table(rows, target, peak, args.baseline))
    out = Path(args.out_dir or "eval_results/compare")
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "compare.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plotted = plot_curves(runs, out / "compare.png")
    print(f"\nwrote {out / 'compare.csv'}" + (f" and {out / 'compare.png'}" if plotted else ""))


def default_out_dir(model: str) -> Path:
    """Results of a run's model go into that run (`runs/x/final` → `runs/x/eval/final`); anything else into
    eval_results/<name>."""
    path = Path(model).expanduser()
    run = next((p for p in (path.parent, path.parent.parent) if (p / ".run").is_file()), None)
    return run / "eval" / "_".join(path.relative_to(run).parts) if run else Path("eval_results") / path.name


def run_eval(args) -> None:
    checks = [(args.k >= 1, f"--k must be ≥ 1, got {args.k}"), (args.limit is None or args.limit >= 1, "--limit must be ≥ 1"),
              (args.max_new_tokens >= 1, f"--max-new-tokens must be ≥ 1, got {args.max_new_tokens}"),
              (args.batch_size >= 1, f"--batch-size must be ≥ 1, got {args.batch_size}"),
              (args.temperature >= 0, f"--temperature must be ≥ 0, got {args.temperature}"),
              (0 < args.top_p <= 1, f"--top-p must be in (0, 1], got {args.top_p}"),
              ("{problem}" in args.template, "--template must contain {problem}")]
    for ok, msg in checks:
        if not ok:
            fail(msg)
    out = Path(args.out_dir) if args.out_dir else default_out_dir(args.model)
    if out.exists() and not out.is_dir():
        fail(f"--out-dir {out} is a file")
    if (out / "results.json").exists() and not args.overwrite:
        fail(f"{out / 'results.json'} exists; pass --overwrite to replace it or --out-dir to write elsewhere")
    if args.save_correct and Path(args.save_correct).exists() and not args.overwrite:
        fail(f"{args.save_correct} exists; pass --overwrite to replace it")
    benchmarks = {}
    for spec in args.benchmarks.split(","):
        name = spec if spec in NAMED or spec in ("tiny", "tiny_train") or spec.startswith("hf:") else Path(spec).stem
        try:  # all data first, so a typo fails before a slow model load
            benchmarks[name] = load_problems(spec, data_dir=args.data_dir, problem_key=args.problem_key,
                                             answer_key=args.answer_key, limit=args.limit)
        except (ValueError, FileNotFoundError, ImportError, TypeError) as e:
            fail(str(e))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        model, tokenizer = load_model(args.model, args.trust_remote_code, torch.bfloat16 if device == "cuda" else torch.float32)
        stop = end_ids(tokenizer, model, args.chat_template, args.stop_tokens.split(",") if args.stop_tokens else [])
    except Exception as e:  # noqa: BLE001 -- any failure to load is one line about the model
        fail(f"cannot load model {args.model}: {' '.join(str(e).split())[:300] or type(e).__name__}")
    model.to(device)
    sampling = RolloutConfig(group_size=args.k, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                             top_p=args.top_p, top_k=args.top_k, gen_batch_size=args.batch_size)
    torch.manual_seed(args.seed)
    results, records = {}, {}
    for name, problems in benchmarks.items():
        prompts = [prompt_ids(tokenizer, p.problem, args.template, args.chat_template, args.system_prompt) for p in problems]
        records[name] = evaluate(model, tokenizer, prompts, [p.answer for p in problems], sampling, rewards.RewardConfig(),
                                 stop, desc=name, keep=bool(args.save_correct))
        for p, r in zip(problems, records[name]):
            r["id"] = p.id
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
        summary = {"args": vars(args), "macro": macro_average(results), "benchmarks": results, "problems": records}
        (out / "results.json").write_text(json.dumps(summary, indent=1))
    except OSError as e:
        fail(f"cannot write {out / 'results.json'}: {e.strerror}")
    print(f"\nwrote {out / 'results.json'}")


def save_correct(path: str, problems: list[Problem], records: list[dict], meta: dict) -> int:
    """RLEP phase I: every verified-correct completion of `records` (evaluate(keep=True)) with its problem text,
    token ids and behaviour log-probs, so phase II replays exactly these tokens; `<path>.meta.json` gets `meta`
    (with the tokens this sampling generated). Returns the number of completions written."""
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
    mode.add_argument("--compare", nargs="+", metavar="RUN_DIR", help="training run folders to compare")
    ap.add_argument("--out-dir", help="where JSON/CSV/PNG go (default: <run>/eval/<model> for a run's model, "
                    "eval_results/<model name>, eval_results/compare)")
    g = ap.add_argument_group("evaluating a model")
    g.add_argument("--benchmarks", default="tiny", help=f"comma list of tiny, {', '.join(NAMED)}, .jsonl/.parquet paths, hf:NAME")
    g.add_argument("--data-dir", help="folder holding the benchmark files (math500_test.jsonl, ...)")
    g.add_argument("--problem-key", help="problem field of a custom file (default: problem/question/prompt)")
    g.add_argument("--answer-key", help="answer field of a custom file (default: answer/solution)")
    g.add_argument("--limit", type=int, help="first N problems of each benchmark")
    g.add_argument("--k", type=int, default=8, help="samples per problem")
    g.add_argument("--temperature", type=float, default=0.6, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--max-new-tokens", type=int, default=1024)
    g.add_argument("--batch-size", type=int, default=64, help="sequences per generate call")
    g.add_argument("--template", default=DEFAULT_TEMPLATE, help="instruction text; {problem} is replaced by the problem")
    g.add_argument("--no-chat-template", dest="chat_template", action="store_false",
                   help="plain prompts, even when the tokenizer has a chat template")
    g.add_argument("--system-prompt", default="", help="system turn of the chat template (empty = none)")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--stop-tokens", default="", help="comma-separated extra end tokens")
    g.add_argument("--overwrite", action="store_true", help="replace existing results")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--trust-remote-code", action="store_true")
    g.add_argument("--save-correct", metavar="JSONL", help="write every verified-correct completion (RLEP phase I)")
    c = ap.add_argument_group("comparing runs")
    c.add_argument("--baseline", default="none", help="strategy that AES and the default target are measured against")
    c.add_argument("--target", type=float, help="eval accuracy (0-1) for tokens-to-target (default: baseline's final mean)")
    c.add_argument("--aes-alpha", type=float, default=1.0)
    c.add_argument("--aes-beta", type=float, default=3.0)
    c.add_argument("--aes-gamma", type=float, default=5.0)
    args = ap.parse_args(argv)
    run_compare(args) if args.compare else run_eval(args)


if __name__ == "__main__":
    main()
