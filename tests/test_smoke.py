"""Run train.py in a subprocess exactly as the README does, for a couple of steps, and every tiny
config through its main: catches what unit tests miss."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from replay import STRATEGIES

from fixtures import REPO, train_here  # (tests/fixtures.py)
MODEL = REPO / "data" / "tiny_model"
pytestmark = pytest.mark.skipif(
    not (MODEL / "config.json").exists(),
    reason="data/tiny_model not built (python -m data.build_tiny_model)")
SMALL = ["--eval.n=16", "--eval.k=1", "--checkpoint.every=0", "--threads=1"]


def run_train(out: Path, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "train.py", "--config", "configs/tiny.yaml", f"--out_dir={out}",
           *overrides]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, check=False,
                       env={**__import__("os").environ, "WANDB_MODE": "offline"})
    assert p.returncode == 0, p.stderr[-3000:]
    return p


@pytest.mark.fast
def test_readme_command_two_steps(tmp_path):
    out = tmp_path / "run"
    run_train(out, "--max_steps=2", *SMALL)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("generated_tokens", "tokens/generated_total", "tokens/trained", "reward_mean",
                "entropy", "entropy/fresh", "response_len", "time/generate",
                "time/forward_backward", "clip_low", "approx_kl", "is_weight_min",
                "adv/zero_std_frac"):
        assert key in rows[0], key
    assert rows[1]["generated_tokens"] > rows[0]["generated_tokens"] > 0
    assert "eval/accuracy" in rows[-1]
    summary = json.loads((out / "summary.json").read_text())
    for key in ("eval_accuracy_initial", "eval_accuracy_final", "generated_tokens", "steps",
                "wall_seconds", "eval_entropy_final", "tokens_trained"):
        assert summary[key] is not None, key
    assert (out / "config.yaml").exists()
    assert list((out / "wandb").glob("offline-run-*")), "an offline wandb run is written"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoTokenizer.from_pretrained(out / "final")
    AutoModelForCausalLM.from_pretrained(out / "final")


CONFIGS = sorted(p.stem for p in (REPO / "configs" / "tiny").glob("*.yaml") if p.stem != "common")


def test_every_strategy_has_a_tiny_config():
    assert {s for s, cls in STRATEGIES.items() if cls.__module__ == "replay"} <= set(CONFIGS)


@pytest.mark.parametrize("name", CONFIGS)
def test_every_tiny_config_runs(tmp_path, name):
    """Each configs/tiny/<name>.yaml (every strategy, dynamic sampling, the reuse arms) through
    train.py for three steps (its main, in this process: the command line is the test above's)."""
    out = tmp_path / name
    extra = ["--replay.exgrpo_min_solve=0"] if name == "exgrpo" else []
    p = train_here("--config", f"configs/tiny/{name}.yaml", f"--out_dir={out}", "--max_steps=3",
                   "--rollout.batch_size=64", "--eval.every=0", "--wandb.mode=disabled",
                   "--replay.tau_max=1", *SMALL, *extra)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    strategy = json.loads((out / "summary.json").read_text())["strategy"]
    no_replay = ("dynamic", "epochs2", "epochs4", "gated", "lora", "skip", "stages", "sfpo", "gxpo",
                 "gxpo_nogate", "none_lr2x", "none_lr4x")
    # skipping with a replay strategy (and GXPO's update)
    composed = {"skip_aper": "aper", "skip_uniform": "uniform", "gxpo_nogate_skip_aper": "aper"}
    expected = composed.get(name, name)
    if name in no_replay:
        expected = "none"
    assert len(rows) == 3 and strategy == expected
    for r in rows:
        assert "replay/size" in r and "replay/token_share" in r and "replay/age_max" in r
    if name in ("uniform", "aper"):
        assert rows[-1]["replay/rows"] > 0, "rows were replayed by step 3"
        # a step replays rows of earlier steps only: stored after its update, drawn from then on
        assert rows[0]["replay/rows"] == 0
        assert all(r["replay/age_mean"] >= 1 for r in rows if r["replay/rows"] > 0)
    if name.startswith("skip"):  # GRESO's metrics every step
        assert all("greso/p_easy" in r and r["greso/consumed"] >= r["adv/groups"] for r in rows)
    if name == "stages":  # every step says what the stage rule did
        assert all(0 < r["stages/sample_share"] <= 1 for r in rows)
    if name == "aper":
        assert all(r["replay/age_max"] <= 1 for r in rows)
    if name == "group":
        assert all("replay/groups_replaced" in r and "replay/flat_groups" in r for r in rows)
    if name in ("epochs2", "epochs4", "gated"):  # every step measures the lm_head gradient
        assert all(r["optim/lm_head_grad_norm"] > 0 and r["optim/epochs_run"] >= 1 for r in rows)
    if name == "dynamic":  # the update holds only informative groups, whatever it cost in rounds
        assert all(r["dynamic/rounds"] >= 1 and r["adv/zero_std_frac"] == 0
                   or r["dynamic/capped"]
                   for r in rows)
