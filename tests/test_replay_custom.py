"""A replay strategy defined outside replay.py (tests/per_feedback.py), registered without editing
any other file, and run through train.py from the command line with --replay.module: PER-style
replay whose priorities learn from the replayed rows' new advantages."""

import importlib
import json
import math
import os
import subprocess
import sys

import pytest
from test_replay import MAX_LEN, PAD, push, rejected, replayed, rollouts

from replay import STRATEGIES, ReplayConfig, make_replay

from fixtures import REPO  # (tests/fixtures.py: the repository's root)
from train import main


@pytest.fixture
def per_feedback():
    """Import the strategy's file (defining the class registers it), then forget it after the test:
    tests/test_smoke.py runs every strategy of replay.py, and test_replay.py's built-in list is
    read when it is collected."""
    yield importlib.import_module("per_feedback").PerFeedbackReplay
    del STRATEGIES["per_feedback"]
    del sys.modules["per_feedback"]


def test_defining_the_class_registers_it_with_its_own_checks(per_feedback):
    assert STRATEGIES["per_feedback"] is per_feedback and per_feedback.__module__ == "per_feedback"
    rules = ReplayConfig(strategy="per_feedback", ratio=5.0).check()
    assert ({"strategy", "capacity", "advantage", "rlep_source", "ratio", "priority_eps"}
            <= set(rules))
    assert rules["strategy"][0] and not rules["ratio"][0]
    message = ("replay.ratio must be in [0, 4] for per_feedback (replayed rows per fresh row), "
               "got 5.0")
    assert rejected(strategy="per_feedback", ratio=5.0) == message


def test_feedback_rescores_exactly_the_replayed_slots(per_feedback):
    cfg = ReplayConfig(strategy="per_feedback", ratio=0.5, advantage="recompute", capacity=16)
    buf = make_replay(cfg, max_len=MAX_LEN, pad_id=PAD, seed=0)
    # prompt 7: rewards 1, 0; prompt 8: rewards 1, 0 (not in the fresh batch);
    # stored priority |±0.5| + 1e-3
    push(buf, rollouts(4, prompt_idx=[7, 7, 8, 8], reward=[1, 0, 1, 0],
                       advantage=[0.5, -0.5, 0.5, -0.5]), 0)
    assert buf.score[:4].tolist() == pytest.approx([0.501] * 4)
    fresh = rollouts(4, prompt_idx=7, group=100, reward=[0, 0, 0, 1],
                     advantage=[-0.5, -0.5, -0.5, 1.5], born=1, seed=1)
    batch = buf.sample(fresh, 1)  # k = round(0.5 · 4) = 2 draws
    again = replayed(batch)
    assert len(again) == 2 and (again.slot >= 0).all() and (batch.slot[:4] == -1).all()
    before = buf.score.clone()
    push(buf, batch, 1)
    # recomputed advantages (unbiased std + 1e-6): reward 1 joining [0,0,0,1] → 0.6 / sqrt(0.3);
    # reward 0 → -0.2 / sqrt(0.2); prompt 8 against its stored rewards [1, 0] → ±0.5 / sqrt(0.5)
    new = {(7, 1.0): 0.6 / (math.sqrt(0.3) + 1e-6), (7, 0.0): 0.2 / (math.sqrt(0.2) + 1e-6),
           (8, 1.0): 0.5 / (math.sqrt(0.5) + 1e-6),
           (8, 0.0): 0.5 / (math.sqrt(0.5) + 1e-6)}  # fmt: skip
    for s, p, r in zip(again.slot.tolist(), again.prompt_idx.tolist(), again.reward.tolist()):
        assert buf.score[s].item() == pytest.approx(new[(p, r)] + 1e-3, rel=1e-5)
    changed = (buf.score[:4] != before[:4]).nonzero().squeeze(1).tolist()
    # exactly the replayed slots, no other stored row
    assert changed == sorted(set(again.slot.tolist()))
    # the fresh rows, stored after
    assert buf.score[4:8].tolist() == pytest.approx([0.501, 0.501, 0.501, 1.501])
    assert buf.metrics()["replay/rescored"] == float(len(changed))


def test_custom_strategy_runs_through_train_from_the_command_line(tmp_path, capsys):
    """The README's command: train.py in a subprocess imports the strategy's module by name."""
    if not (REPO / "data" / "tiny_model" / "config.json").exists():
        pytest.skip("data/tiny_model not built (python -m data.build_tiny_model)")
    out = tmp_path / "run"
    cmd = [sys.executable, "train.py", "--config", "configs/tiny.yaml", f"--out_dir={out}",
           "--replay.module=per_feedback", "--replay.strategy=per_feedback", "--max_steps=3",
           "--replay.advantage=recompute", "--rollout.batch_size=32", "--rollout.group_size=4",
           "--eval.n=8", "--eval.k=1", "--checkpoint.every=0", "--wandb.mode=disabled",
           "--threads=1"]
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests")}
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
                       check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[0]["replay/rows"] == 0 and rows[0]["replay/rescored"] == 0.0  # nothing stored yet
    assert any(r["replay/rows"] > 0 for r in rows) and any(r["replay/rescored"] > 0 for r in rows)
    assert all(r["replay/rescored"] <= r["replay/rows"] for r in rows)
    assert json.loads((out / "summary.json").read_text())["strategy"] == "per_feedback"
    # a misspelled module: refused before anything is written (in this process: the same main,
    # without another interpreter's start)
    code = main(["--config", "configs/tiny.yaml", f"--out_dir={tmp_path / 'bad'}",
                 "--replay.module=per_feedbak", "--replay.strategy=per_feedback"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("error: replay.module must be a module name on sys.path"), err
    assert not (tmp_path / "bad").exists()


def test_registered_only_while_its_tests_run():
    assert "per_feedback" not in STRATEGIES and "per_feedback" not in sys.modules
