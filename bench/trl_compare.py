"""The same GRPO work through train.py (replay.strategy=none) and through TRL's GRPOTrainer,
alternating runs.

Usage:
  pip install -r bench/requirements.txt  # trl, datasets, accelerate: bench-only
  python bench/trl_compare.py  # configs/tiny.yaml, 30 steps, 2 rounds (ours, TRL, TRL, ours)
  python bench/trl_compare.py --steps 10 --rounds 1 --model.path=/tmp/model \
      --optim.micro_batch_size=64
  python bench/trl_compare.py --before /tmp/before  # and another checkout's train.py, alternating
  python bench/trl_compare.py --variant="--rollout.refill=true"  # and train.py with these keys

Both sides read one resolved config (the file plus any --key=value overrides, as train.py does), so
they share the model, the training problems, prompts × group size, max_new_tokens,
temperature/top_p, the learning rate (constant, no warm-up), AdamW betas and weight decay, gradient
clipping, the loss (dapo aggregation, clip 0.2/0.28, beta 0, group-std advantages, one optimizer
step per batch, micro-batches of optim.micro_batch_size rows), the seed, one torch thread on CPU and
no vLLM. TRL's reward function is rewards.score_batch, so both get the same reward.

Printed per side: median step time (the whole step: generation, reward, advantages,
forward/backward, optimizer; not eval), generated completion tokens per second of step time, peak
resident memory of the process, and eval accuracy before and after (eval.evaluate on the final
weights with the same settings and seed), and the ratio.
Runs alternate (ABBA for 2 rounds) so that load from other processes on a shared machine hits both
sides alike.
Round r uses seed + r on both sides.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere
from bench import cli

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
       "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1",
       "PYTHONPATH": str(REPO)}


def run(cmd: list[str], log: Path, tree: Path = REPO) -> int:
    """Run `cmd` in the checkout `tree`; returns the peak resident set size of the process in MB
    (os.wait4 reports it per child)."""
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, cwd=tree, env=ENV | {"PYTHONPATH": str(tree)}, stdout=f,
                             stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(p.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{log.read_text()[-3000:]}")
    return usage.ru_maxrss // 1024


def ours(config: str, overrides: list[str], steps: int, seed: int, out: Path,
         tree: Path = REPO) -> dict:
    """train.py of the checkout `tree` (this one, or --before's)."""
    cmd = [sys.executable, "train.py", "--config", config, *overrides, f"--out_dir={out}",
           f"--max_steps={steps}", f"--seed={seed}",
           "--replay.strategy=none", "--eval.every=0", "--checkpoint.every=0",
           "--wandb.mode=disabled", "--overwrite"]
    rss = run(cmd, out.with_suffix(".log"), tree)
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    step_times = [r["time/step"] for r in rows]
    return {"step_times": step_times, "tokens": rows[-1]["generated_tokens"], "rss_mb": rss,
            "acc_initial": summary["eval_accuracy_initial"],
            "acc_final": summary["eval_accuracy_final"],
            "phases": {k[5:]: statistics.median(r[k] for r in rows)
                       for k in rows[0] if k.startswith("time/")}}


def trl(config: str, overrides: list[str], steps: int, seed: int, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, __file__, "--trl-worker", str(out / "result.json"), "--config", config,
           *overrides, f"--seed={seed}",
           f"--max_steps={steps}", f"--out_dir={out}"]
    rss = run(cmd, out.with_suffix(".log"))
    return {**json.loads((out / "result.json").read_text()), "rss_mb": rss}


def trl_worker(result_path: str, config: str, overrides: list[str]) -> None:
    """One TRL GRPOTrainer run from our resolved config; writes step times, token count and final
    eval accuracy."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from config import load_config, validate
    from data.loaders import load_task
    from eval import evaluate, summarize
    from rewards import score_batch
    from rollout import HFSampler
    from support.prompts import end_ids, prompt_ids

    cfg = load_config(config, overrides)
    validate(cfg)
    torch.set_num_threads(cfg.threads or torch.get_num_threads())
    train_problems, eval_problems = load_task(cfg.data, cfg.eval.n)
    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32)
    template = cfg.data.template
    ds = Dataset.from_list([{"prompt": [{"role": "user",
                                         "content": template.replace("{problem}", p.problem)}],
                             "answer": p.answer} for p in train_problems])
    tokens = []

    def reward(completions, answer, completion_ids, **_):
        tokens.append(sum(len(c) for c in completion_ids))
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return score_batch(texts, list(answer), cfg.reward)[0]

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times, self.t0 = [], 0.0

        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.time()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.time() - self.t0)

    B, mb = cfg.rollout.batch_size, min(cfg.optim.micro_batch_size, cfg.rollout.batch_size)
    if B % mb:
        sys.exit(f"TRL needs rollout.batch_size ({B}) to be a multiple of "
                 f"optim.micro_batch_size ({mb})")
    o = cfg.optim
    args = GRPOConfig(
        output_dir=cfg.out_dir, seed=cfg.seed, max_steps=cfg.max_steps, use_cpu=True, bf16=False,
        report_to="none",
        save_strategy="no", logging_steps=1, disable_tqdm=True,
        # one generation of B completions per optimizer step, trained in B / mb micro-batches of mb
        # rows (as ours)
        per_device_train_batch_size=mb, gradient_accumulation_steps=B // mb,
        steps_per_generation=B // mb,
        num_generations=cfg.rollout.group_size, max_completion_length=cfg.rollout.max_new_tokens,
        temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=0,
        learning_rate=o.lr, lr_scheduler_type="constant", warmup_steps=o.warmup_steps,
        adam_beta1=o.beta1, adam_beta2=o.beta2,
        weight_decay=o.weight_decay, max_grad_norm=o.grad_clip, num_iterations=1,
        loss_type=cfg.grpo.loss_agg, beta=cfg.grpo.beta, epsilon=cfg.grpo.eps_low,
        epsilon_high=cfg.grpo.eps_high,
        scale_rewards=cfg.grpo.adv_scale,
    )
    timer = StepTimer()
    trainer = GRPOTrainer(model=model, processing_class=tok, reward_funcs=reward, args=args,
                          train_dataset=ds, callbacks=[timer])
    trainer.train()
    model = trainer.model.eval()
    with torch.random.fork_rng(devices=[]):  # as train.py's run_eval
        torch.manual_seed(cfg.seed)
        e, d = cfg.eval, cfg.data
        sampling = replace(cfg.rollout, group_size=e.k, temperature=e.temperature, top_p=e.top_p,
                           max_new_tokens=e.max_new_tokens or cfg.rollout.max_new_tokens)
        prompts = [prompt_ids(tok, p.problem, d.template, d.chat_template, d.system_prompt)
                   for p in eval_problems]
        sampler = HFSampler(model, tok,
                            end_ids(tok, model, d.chat_template, cfg.rollout.stop_tokens))
        ev = summarize(evaluate(sampler, prompts, [p.answer for p in eval_problems], sampling,
                                cfg.reward))
    Path(result_path).write_text(json.dumps({"step_times": timer.times, "tokens": sum(tokens),
                                             "acc_final": ev["accuracy"]}))


def summarize(runs: list[dict]) -> dict:
    times = [t for r in runs for t in r["step_times"]]
    return {"median_step": statistics.median(times),
            "tokens_per_s": sum(r["tokens"] for r in runs) / sum(times),
            "rss_mb": max(r["rss_mb"] for r in runs),
            "acc_final": statistics.mean(r["acc_final"] for r in runs)}


def side_line(name: str, what: str, s: dict, s_trl: dict) -> str:
    """A third side's summary `s` (`before`, `variant`): step time, tokens/s, ratio to TRL."""
    return (f"{name} ({what}): median step {s['median_step']:.2f} s, "
            f"{s['tokens_per_s']:.0f} generated tokens/s, {name}/TRL "
            f"{s['median_step'] / s_trl['median_step']:.2f}")


def main() -> None:
    if sys.argv[1:2] == ["--trl-worker"]:
        rest, config = sys.argv[3:], "configs/tiny.yaml"
        if "--config" in rest:
            i = rest.index("--config")
            config, rest = rest[i + 1], rest[:i] + rest[i + 2 :]
        return trl_worker(sys.argv[2], config, rest)
    ap = cli.Parser(__file__, __doc__)
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--steps", type=cli.positive_int, default=30)
    ap.add_argument("--rounds", type=cli.positive_int, default=2,
                    help="each round runs both sides; the order alternates (ABBA...)")
    ap.add_argument("--seed", type=cli.count, default=0)
    ap.add_argument("--out", help="keep the runs here (default: a temporary folder)")
    ap.add_argument("--overwrite", action="store_true", help="replace runs kept in --out before")
    ap.add_argument("--before", default="", help="another checkout (e.g. `git worktree add "
                    "/tmp/before REV`): its train.py runs as a third side, `before`, in each round")
    ap.add_argument("--variant", default="", help="overrides (e.g. '--rollout.refill=true') of a "
                    "side `variant`: train.py with them, in each round")
    a, overrides = ap.parse_known_args()
    ap.need("trl", "datasets")  # TRL's side: found missing now, not after our side has run
    ap.check_config(str(REPO / a.config), overrides)  # both sides read it
    ap.check_config(str(REPO / a.config), overrides + a.variant.split())
    if a.before and not (Path(a.before) / "train.py").is_file():
        ap.error(f"--before {a.before}: not a checkout (no train.py)")
    ap.check_folder("--out", a.out)
    sides = ["ours", "trl"]
    if a.before:
        sides.append("before")
    if a.variant:
        sides.append("variant")
    kept = []  # runs of an earlier comparison in --out, which train.py would replace
    if a.out:
        kept = [f"{side}_{r}" for r in range(a.rounds) for side in sides
                if (Path(a.out) / f"{side}_{r}").exists()]
    if kept and not a.overwrite:
        ap.error(f"--out {a.out} holds {kept[0]} already; pass --overwrite to replace it")
    overrides += [f"--threads={os.environ.get('BENCH_THREADS', '1')}"]
    root = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="trl_compare_"))
    root.mkdir(parents=True, exist_ok=True)
    results = {side: [] for side in sides}
    for r in range(a.rounds):
        order = sides if r % 2 == 0 else sides[::-1]  # ABC CBA ...
        for side in order:
            t0 = time.time()
            out = root / f"{side}_{r}"
            if side == "trl":
                res = trl(a.config, overrides, a.steps, a.seed + r, out)
            elif side == "variant":
                res = ours(a.config, overrides + a.variant.split(), a.steps, a.seed + r, out)
            else:
                tree = Path(a.before).resolve() if side == "before" else REPO
                res = ours(a.config, overrides, a.steps, a.seed + r, out, tree)
            results[side].append(res)
            print(f"round {r} {side:4s}: median step "
                  f"{statistics.median(res['step_times']):.2f}s, "
                  f"eval accuracy {res['acc_final']:.3f}"
                  f", {time.time() - t0:.0f}s wall", flush=True)
    s_ours, s_trl = summarize(results["ours"]), summarize(results["trl"])
    acc0 = statistics.mean(r["acc_initial"] for r in results["ours"])
    print(f"\n{a.steps} steps x {a.rounds} rounds, config {a.config} {' '.join(overrides)}")
    print(f"{'':28s}{'train.py':>12s}{'TRL':>12s}{'ours/TRL':>10s}")
    for label, key, fmt in [("median step time (s)", "median_step", ".2f"),
                            ("generated tokens / s", "tokens_per_s", ".0f")]:
        print(f"{label:28s}{s_ours[key]:12{fmt}}{s_trl[key]:12{fmt}}"
              f"{s_ours[key] / s_trl[key]:10.2f}")
    if a.before:
        s_before = summarize(results["before"])
        after = s_ours["median_step"] / s_before["median_step"]
        print(side_line("before", a.before, s_before, s_trl) + f", after/before {after:.2f}")
    if a.variant:
        s_variant = summarize(results["variant"])
        ratio = s_variant["median_step"] / s_ours["median_step"]
        print(side_line("variant", a.variant, s_variant, s_trl) + f", variant/train.py {ratio:.2f}")
    print(f"{'peak resident memory (MB)':28s}{s_ours['rss_mb']:12d}{s_trl['rss_mb']:12d}"
          f"{s_ours['rss_mb'] / s_trl['rss_mb']:10.2f}")
    print(f"{'eval accuracy after':28s}{s_ours['acc_final']:12.3f}{s_trl['acc_final']:12.3f}"
          f"   (before: {acc0:.3f})")
    phases = {k: statistics.median(r["phases"][k] for r in results["ours"])
              for k in results["ours"][0]["phases"]}
    print("train.py median seconds per phase: "
          + ", ".join(f"{k} {v:.3f}" for k, v in phases.items() if v >= 0.0005))
    print(f"runs kept in {root}")


if __name__ == "__main__":
    main()
