"""Hand-made regressions of the core (grpo.py, replay.py, rewards.py, train.py), the way a developer
might make them, and which test tiers catch each: the evidence behind the fast tier (#59).

  python tests/regressions.py                  # each regression against the fast tier
  python tests/regressions.py --tier files     # ... and against the test files of its module
  python tests/regressions.py --only adv_no_centre,aper_alpha

Each regression is one exact text replacement, applied to a copy of the repository's tracked
files in a temporary folder (the checkout is never touched; the tiny model is linked in). A tier
catches a regression when pytest fails on the copy. It prints a Markdown table (docs/testing.md
keeps one, with the commit it ran on).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# name -> (file, old text, new text, what it breaks, the module's test files)
REGRESSIONS = {
    "adv_no_centre": (
        "grpo.py", "centred = rewards.double() - s.mean[s.index]", "centred = rewards.double()",
        "advantages not centred on the group mean", "tests/test_grpo.py"),
    "adv_std_eps": (
        "grpo.py", "adv = centred / (s.std[s.index] + eps)",
        "adv = centred / (s.std[s.index] + 1.0)",
        "the group std's epsilon 1 instead of adv_eps", "tests/test_grpo.py"),
    "clip_high_is_low": (
        "grpo.py", "ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high)",
        "ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_low)", "clip-higher ignored",
        "tests/test_grpo.py"),
    "agg_grpo_tokens": (
        "grpo.py", "return (per_tok.sum(1) / mask.sum(1).clamp(min=1)).sum() / n_seqs",
        "return per_tok.sum() / n_tokens", "GRPO's per-sequence mean replaced by DAPO's token mean",
        "tests/test_grpo.py"),
    "step_without_signal": (
        "grpo.py", 'skipped = None if any_signal else "zero_adv"', "skipped = None",
        "an optimizer step when every advantage is 0 (AdamW moves the weights)",
        "tests/test_grpo.py tests/test_train.py"),
    "aper_alpha": (
        "replay.py", "fresh.advantage.abs().pow(self.cfg.alpha)", "fresh.advantage.abs()",
        "APER's priority exponent ignored", "tests/test_replay.py"),
    "aper_age": (
        "replay.py",
        'self.evict(step - self.rows.born > self.cfg.tau_max, "age")\n        k = min(',
        'self.evict(step - self.rows.born > self.cfg.tau_max + 1, "age")\n        k = min(',
        "APER keeps rows one step past tau_max", "tests/test_replay.py tests/test_train.py"),
    "boxed_first": (
        "rewards.py", "for m in list(_BOX.finditer(text))[-20:]:",
        "for m in list(_BOX.finditer(text))[:1]:", "the first \\boxed{} read instead of the last",
        "tests/test_rewards.py"),
    "push_before_sample": (
        "train.py", "            batch = r.replay.sample(groups, step)\n",
        "            r.replay.push(groups, step, groups.reward * 0)\n"
        "            batch = r.replay.sample(groups, step)\n",
        "fresh rows stored before the batch is drawn (a row replayed in its own step)",
        "tests/test_train.py tests/test_smoke.py"),
    "lr_schedule_off": (
        "train.py", 'group["lr"] = get_lr(step, cfg)', 'group["lr"] = cfg.optim.lr',
        "warm-up and cosine decay ignored", "tests/test_train.py tests/test_grpo.py"),
    "generated_not_counted": (
        "train.py", "p.generated_tokens += generated", "p.generated_tokens += 0",
        "generated tokens not counted (the budget every comparison rests on)",
        "tests/test_train.py tests/test_smoke.py"),
    "observers_skipped": (
        "train.py", "        for method in r.observers:\n            method.observe(fresh)\n",
        "", "GRESO and staged rollouts never see the rollout",
        "tests/test_greso_stages.py tests/test_stage_skip_runs.py"),
}


def copy_repo(dest: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.splitlines()
    for name in files:
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            (dest / name).write_bytes(src.read_bytes())
    model = dest / "data" / "tiny_model"
    if not model.exists():
        model.symlink_to(REPO / "data" / "tiny_model")


def caught(root: Path, args: list[str]) -> tuple[bool, float]:
    """Whether pytest fails on `root` with `args`, and its seconds."""
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                        "-n", "2", *args], cwd=root, capture_output=True, text=True, check=False)
    return p.returncode != 0, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tier", choices=["fast", "files"], default="fast")
    ap.add_argument("--only", default="", help="comma-separated names (default: every one)")
    a = ap.parse_args()
    names = list(REGRESSIONS)
    if a.only:
        names = a.only.split(",")
        unknown = [n for n in names if n not in REGRESSIONS]
        if unknown:
            ap.error(f"unknown regression(s) {', '.join(unknown)}; known: {', '.join(REGRESSIONS)}")
    print("| regression | file | what it breaks | fast tier | its module's test files |")
    print("|---|---|---|---|---|")
    for name in names:
        file, old, new, what, files = REGRESSIONS[name]
        with tempfile.TemporaryDirectory(prefix="regression_") as tmp:
            root = Path(tmp)
            copy_repo(root)
            text = (root / file).read_text()
            if text.count(old) != 1:
                print(f"| {name} | {file} | {what} | (does not apply) | |", flush=True)
                continue
            (root / file).write_text(text.replace(old, new))
            fast, t_fast = caught(root, ["-m", "fast"])
            cells = [f"{'caught' if fast else 'missed'} ({t_fast:.0f} s)", "-"]
            if a.tier == "files":
                hit, t_files = caught(root, files.split())
                cells[1] = f"{'caught' if hit else 'missed'} ({t_files:.0f} s: {files})"
        print(f"| {name} | {file} | {what} | {cells[0]} | {cells[1]} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
