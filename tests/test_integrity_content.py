"""Integrity by content, not only by size (#49), through train.py and eval.py in subprocesses: a
checkpoint file changed at its size is refused at --resume (its manifest's sha256); a training or
eval file giving one problem two gold answers, or an answer blank to the eye, is refused at load.

  pytest -q tests/test_integrity_content.py        # ~1 min on 2 busy cores
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures import snapshot

from fixtures import REPO  # (tests/fixtures.py: the repository's root)
MODEL = REPO / "data" / "tiny_model"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled",
       "TOKENIZERS_PARALLELISM": "false"}
TINY = ["--config", str(REPO / "configs" / "tiny.yaml"), f"--model.path={MODEL}",
        "--rollout.batch_size=16", "--rollout.group_size=4", "--rollout.max_new_tokens=24",
        "--eval.n=8", "--eval.k=1", "--eval.every=0", "--checkpoint.every=2",
        "--checkpoint.keep_last=3", "--threads=1", "--wandb.mode=disabled"]
pytestmark = pytest.mark.skipif(not (MODEL / "config.json").is_file(), reason="no tiny model")


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / script), *args], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=300, check=False)


def refused(r: subprocess.CompletedProcess, *words: str) -> str:
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    for w in words:
        assert w in r.stderr, r.stderr
    return r.stderr


@pytest.mark.parametrize("name", ["model.safetensors", "state_rank0.pt"])
def test_a_checkpoint_file_changed_at_its_size_is_refused(tmp_path, name):
    out = tmp_path / "run"
    r = run("train.py", *TINY, f"--out_dir={out}", "--max_steps=4")
    assert r.returncode == 0, r.stderr[-3000:]
    f = out / "checkpoints" / "step_000004" / name
    data = bytearray(f.read_bytes())
    data[-4:] = bytes(b ^ 0x55 for b in data[-4:])  # a weight (or a pickled value) changed
    f.write_bytes(bytes(data))
    before = snapshot(out)
    line = refused(run("train.py", *TINY, f"--out_dir={out}", "--max_steps=6", "--resume"),
                   "checkpoint step_000004 is damaged", f"{name}'s content is not what",
                   "--resume=step_000002")
    assert "sha256" in line and snapshot(out) == before


def problems_file(tmp_path: Path, rows: list[dict]) -> Path:
    f = tmp_path / "train.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f


GOOD = [{"problem": f"{i}+{i}", "answer": str(2 * i)} for i in range(1, 9)]
BAD = [  # (rows, what the line says)
    (GOOD + [{"problem": "3+3", "answer": "7"}], "rows 2 and 8 give one problem two gold answers"),
    (GOOD + [{"problem": " 4+4 ", "answer": "9"}], "two gold answers"),
    (GOOD + [{"problem": "9+9", "answer": "\u200b"}], "row 8: the gold answer (answer) must be"),
    (GOOD + [{"problem": "9+9", "answer": "\ufeff \u2060"}], "row 8: the gold answer"),
    (GOOD + [{"problem": "\u200b\u200b", "answer": "1"}], "row 8: the problem (problem)"),
]


@pytest.mark.parametrize("rows, words", BAD, ids=["two_golds", "two_golds_spaced",
                                                  "zero_width_answer", "bom_answer",
                                                  "zero_width_problem"])
def test_a_problem_with_two_golds_or_a_blank_one_is_refused_at_load(tmp_path, rows, words):
    f, out = problems_file(tmp_path, rows), tmp_path / "run"
    refused(run("train.py", *TINY, f"--out_dir={out}", f"--data.train={f}", "--max_steps=1"),
            f"error: data: {f}", words)
    assert not out.exists()
    res = tmp_path / "res"
    refused(run("eval.py", "--model", str(MODEL), "--benchmarks", str(f), "--k", "1",
                "--max-new-tokens", "4", "--out-dir", str(res)), words)
    assert not res.exists()


def test_a_problem_given_twice_with_one_gold_trains(tmp_path):
    f = problems_file(tmp_path, GOOD + [{"problem": "3+3", "answer": "6"}])
    r = run("train.py", *TINY, f"--out_dir={tmp_path / 'run'}", f"--data.train={f}",
            "--max_steps=1")
    assert r.returncode == 0, r.stderr[-3000:]


def test_a_training_file_rewritten_in_place_is_refused_at_resume(tmp_path):
    """The checkpoint records the training problems' sha256: the same path with as many rows but
    other problems is refused at --resume (one line naming the file and what to do); the file put
    back resumes."""
    f, out = problems_file(tmp_path, GOOD), tmp_path / "run"
    r = run("train.py", *TINY, f"--out_dir={out}", f"--data.train={f}", "--max_steps=2")
    assert r.returncode == 0, r.stderr[-3000:]
    original = f.read_bytes()
    problems_file(tmp_path, [{"problem": f"{i}*{i}", "answer": str(i * i)} for i in range(1, 9)])
    before = snapshot(out)
    refused(run("train.py", *TINY, f"--out_dir={out}", f"--data.train={f}", "--max_steps=4",
                "--resume"), f"the training data ({f})", "step_000002", "sha256",
            "restore the file, or start a new run")
    assert snapshot(out) == before
    f.write_bytes(original)
    r = run("train.py", *TINY, f"--out_dir={out}", f"--data.train={f}", "--max_steps=4",
            "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
