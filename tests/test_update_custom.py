"""An update-side method defined outside methods/ (tests/kl_stop.py: PPO's target-KL early stop),
plugged in with --optim.update=module:function and trained through train.py, no other file
edited."""

import json
import os
import subprocess
import sys

import pytest

from fixtures import REPO  # (tests/fixtures.py: the repository's root)
from train import main


def train(out, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "train.py", "--config", "configs/tiny.yaml", f"--out_dir={out}",
           "--max_steps=2", "--rollout.batch_size=32", "--rollout.group_size=4", "--eval.n=8",
           "--eval.k=1", "--eval.greedy=false", "--checkpoint.every=0", "--wandb.mode=disabled",
           "--threads=1", *overrides]
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests")}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
                          check=False)


def test_a_plugged_update_replaces_grpos_through_train(tmp_path, capsys):
    """kl_stop:first_change (target KL 0) stops after the second of optim.epochs = 3 passes: the
    first pass's step is π_old itself (KL exactly 0), the second sees the moved weights."""
    if not (REPO / "data" / "tiny_model" / "config.json").exists():
        pytest.skip("data/tiny_model not built (python -m data.build_tiny_model)")
    out = tmp_path / "run"
    p = train(out, "--optim.epochs=3", "--optim.update=kl_stop:first_change")
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["kl_stop/passes"] for r in rows] == [2.0, 2.0]
    assert [r["optim/epochs_run"] for r in rows] == [2.0, 2.0]
    # a misspelled function: refused before anything is written (in this process: the same
    # main, without another interpreter's start)
    code = main(["--config", "configs/tiny.yaml", f"--out_dir={tmp_path / 'bad'}",
                 "--optim.update=kl_stop:first_chnage"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("error: optim.update must be empty, or module:function"), err
    assert not (tmp_path / "bad").exists()
