"""bench/gpu_run.py is a user-facing tool (#49): a dry run never replaces the GPU run's record
(docs/gpu) unless --out names it; bad arguments and a missing GPU are one line on stderr, exit 2,
with nothing written. Each run from a scratch folder, so that a regression cannot reach the
repository's own docs/gpu."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from fixtures import REPO  # (tests/fixtures.py: the repository's root)
from test_bench_cli import run_main
SCRIPT = REPO / "bench" / "gpu_run.py"


def gpu_run(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """`python bench/gpu_run.py ARGS` run in `cwd`, its temporary folders under cwd/tmp."""
    (cwd / "tmp").mkdir(exist_ok=True)
    env = {**os.environ, "TMPDIR": str(cwd / "tmp"), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300, check=False)


def files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_a_dry_run_never_replaces_the_gpu_record(tmp_path):
    """The docstring's `--dry-run` with the default --out: the GPU run's docs/gpu stays as it was
    (it was overwritten and its log emptied); the dry run writes to a new temporary folder and
    says which. --out naming a folder still writes there."""
    record = tmp_path / "docs" / "gpu"
    record.mkdir(parents=True)
    (record / "gpu_run.json").write_text('{"dry_run": false, "device": "NVIDIA H200"}\n')
    (record / "gpu_run.log").write_text("the H200 run's whole output\n")
    before = files(record)
    r = gpu_run(tmp_path, "--dry-run", "--steps", "env", "--work", str(tmp_path / "work"))
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert files(record) == before
    written = list((tmp_path / "tmp").glob("gpu_run_dry_*/gpu_run.json"))
    assert len(written) == 1 and f"gpu_run: writing {written[0]}" in r.stdout
    r = gpu_run(tmp_path, "--dry-run", "--steps", "env", "--out", str(tmp_path / "mine"),
                "--work", str(tmp_path / "work"))
    assert r.returncode == 0 and (tmp_path / "mine" / "gpu_run.json").is_file()


def test_out_never_replaces_an_earlier_record_unasked(tmp_path):
    """A run with --out naming a folder that holds a record (docs/gpu's, or a call run before):
    refused in one line with nothing changed (it was replaced, the log emptied first); with
    --overwrite it is replaced."""
    record = tmp_path / "record"
    record.mkdir()
    (record / "gpu_run.json").write_text('{"dry_run": false, "device": "NVIDIA H200"}\n')
    before = files(record)
    r = gpu_run(tmp_path, "--dry-run", "--steps", "env", "--out", str(record), "--work",
                str(tmp_path / "work"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1, (r.stdout + r.stderr)[-3000:]
    assert "holds a run's gpu_run.json; pass --overwrite to replace it" in r.stderr
    assert files(record) == before
    r = gpu_run(tmp_path, "--dry-run", "--steps", "env", "--out", str(record), "--work",
                str(tmp_path / "work"), "--overwrite")
    assert r.returncode == 0 and '"dry_run": true' in (record / "gpu_run.json").read_text()


BAD = [  # (arguments, what the line says)
    (["--steps"], "argument --steps: expected at least one argument"),
    (["--steps", "env", "nope"], "argument --steps: invalid choice: 'nope'"),
    (["--budget", "nan"], "argument --budget: must be finite and ≥ 20 s (no step runs on less)"),
    (["--budget", "inf"], "argument --budget: must be finite and ≥ 20 s"),
    (["--budget", "-1"], "argument --budget: must be finite and ≥ 20 s"),
    (["--budget", "19"], "argument --budget: must be finite and ≥ 20 s"),
    (["--budget", "soon"], "argument --budget: invalid seconds value: 'soon'"),
    (["--out", ""], "--out '' is empty"),
    (["--work", " "], "--work ' ' is empty"),
    (["--out", "x" * 300], "has a component of 300 bytes"),
    (["--out", "FILE"], "--out FILE: cannot write its folder: File exists"),
    (["--out", "FILE/sub"], "--out FILE/sub: cannot write its folder: Not a directory"),
    (["--work", "FILE/sub"], "--work FILE/sub: cannot make the folder: Not a directory"),
]


@pytest.mark.parametrize("args, words", BAD, ids=[b[1][:30] for b in BAD])
def test_bad_arguments_are_one_line_and_write_nothing(tmp_path, args, words, monkeypatch, capsys):
    """Each refused through the script's __main__ in this process (test_bench_cli.run_main; the
    tests above run it as a user does), from tmp_path, its temporary folders under tmp_path/tmp."""
    (tmp_path / "FILE").write_text("a file, not a folder\n")
    (tmp_path / "tmp").mkdir()
    before = files(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    code, out, err = run_main("gpu_run.py", ["--dry-run", "--steps", "env", *args], monkeypatch,
                              capsys)
    assert code == 2, (out + err)[-3000:]
    assert err.count("\n") == 1 and err.startswith("gpu_run.py: error: "), err
    assert words in err and out == ""
    assert files(tmp_path) == before and list((tmp_path / "tmp").iterdir()) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")
def test_without_a_gpu_the_error_is_one_line_on_stderr(tmp_path):
    r = gpu_run(tmp_path, "--steps", "env")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == "gpu_run.py: error: no GPU is visible; on a CPU run it with --dry-run\n"
    assert not (tmp_path / "docs").exists()


def test_the_smallest_budget_runs_a_step_and_says_which_it_left_out(tmp_path):
    """--budget 20, the least it takes, ran nothing (the first step's share of it fell under
    20 s by the time it started), exited 1 and said nothing: the first step has the whole budget,
    and a step left out says so."""
    out = tmp_path / "out"
    r = gpu_run(tmp_path, "--dry-run", "--steps", "env", "lora", "--budget", "20", "--out",
                str(out), "--work", str(tmp_path / "work"))
    assert r.returncode == 1, (r.stdout + r.stderr)[-3000:]  # (not every step passed: lora)
    assert "== env: passed" in r.stdout
    assert "== lora: not run (" in r.stdout and "under the 20 s a step needs)" in r.stdout
    steps = json.loads((out / "gpu_run.json").read_text())["steps"]
    assert steps["env"]["status"] == "passed" and steps["lora"]["status"] == "not run"
