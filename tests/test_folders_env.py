"""Round five (#49), through train.py and eval.py in subprocesses: a run folder is the run's and
only the run's (a .lock that is a link or not a file, an eval's results folder locked, never a run's
root, never a run under way; a symlinked out_dir), and the environment (torchrun's variables left
in a shell, a signal during the rendezvous, a WANDB_MODE wandb does not know). Each refusal: exit 2,
one line on stderr, every file as it was.

  pytest -q tests/test_folders_env.py        # ~1 min on 2 busy cores
"""

import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fixtures import previous_run, snapshot

from fixtures import REPO  # (tests/fixtures.py: the repository's root)
MODEL = REPO / "data" / "tiny_model"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled",
       "TOKENIZERS_PARALLELISM": "false"}
for _name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
              "TORCHELASTIC_RUN_ID"):
    ENV.pop(_name, None)
TINY = ["--config", str(REPO / "configs" / "tiny.yaml"), f"--model.path={MODEL}",
        "--rollout.batch_size=16", "--rollout.group_size=4", "--rollout.max_new_tokens=24",
        "--eval.n=8", "--eval.k=1", "--eval.every=0", "--threads=1", "--wandb.mode=disabled"]
EVAL = ["--benchmarks", "tiny", "--limit", "2", "--k", "1", "--max-new-tokens", "4",
        "--template", "{problem}"]
pytestmark = pytest.mark.skipif(not (MODEL / "config.json").is_file(), reason="no tiny model")


def run(script: str, *args: str, env: dict | None = None,
        timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / script), *args], cwd=REPO,
                          env={**ENV, **(env or {})}, capture_output=True, text=True,
                          timeout=timeout, check=False)


def refused(r: subprocess.CompletedProcess, *words: str) -> str:
    """Exit 2 and one line on stderr holding `words`."""
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    for w in words:
        assert w in r.stderr, r.stderr
    return r.stderr


def train(out: Path, *args: str, env: dict | None = None,
          timeout: int = 300) -> subprocess.CompletedProcess:
    return run("train.py", *TINY, f"--out_dir={out}", "--max_steps=1", *args, env=env,
               timeout=timeout)


def with_model(out: Path) -> Path:
    """A finished-looking run whose final/ is a loadable model."""
    previous_run(out)
    shutil.copytree(MODEL, out / "final")
    return out


# ------------------------------------------------------------------ a run folder is the run's


@pytest.mark.parametrize("kind", ["symlink", "folder", "fifo"])
def test_a_lock_that_is_no_regular_file_is_refused_and_nothing_it_names_changes(tmp_path, kind):
    out, victim = tmp_path / "run", tmp_path / "victim"
    previous_run(out)
    victim.write_text("someone's file\n")
    lock = out / ".lock"
    if kind == "symlink":
        lock.symlink_to(victim)
    elif kind == "folder":
        lock.mkdir()
    else:
        os.mkfifo(lock)
    before = snapshot(tmp_path)
    line = refused(train(out, "--overwrite"), str(lock))
    assert ("is a symbolic link" if kind == "symlink" else "is not a regular file") in line
    assert snapshot(tmp_path) == before and lock.is_symlink() == (kind == "symlink")


def test_an_eval_lock_that_is_a_symlink_is_refused(tmp_path):
    out, victim = tmp_path / "res", tmp_path / "victim"
    out.mkdir()
    victim.write_text("someone's file\n")
    (out / ".lock").symlink_to(victim)
    refused(run("eval.py", "--model", str(MODEL), *EVAL, "--out-dir", str(out)),
            "is a symbolic link")
    assert victim.read_text() == "someone's file\n" and sorted(os.listdir(out)) == [".lock"]


@pytest.mark.parametrize("compare", [False, True], ids=["eval", "compare"])
@pytest.mark.parametrize("inside", ["", "checkpoints", "final/x"])
def test_eval_never_writes_into_a_run_folders_root(tmp_path, compare, inside):
    """--out-dir a run folder (or inside it, outside its eval/): --resume would then refuse the
    run (files no run wrote)."""
    run_dir = tmp_path / "run"
    previous_run(run_dir)
    before = snapshot(run_dir)
    target = run_dir / inside
    if compare:
        r = run("eval.py", "--compare", str(run_dir), "--out-dir", str(target))
    else:
        r = run("eval.py", "--model", str(MODEL), *EVAL, "--out-dir", str(target))
    refused(r, "--out-dir", f"the training run {run_dir}" if inside else "the training run folder")
    assert snapshot(run_dir) == before and not (run_dir / "eval").exists()


def test_two_evals_into_one_out_dir_the_second_is_refused(tmp_path):
    out = tmp_path / "res"
    out.mkdir()
    with open(out / ".lock", "a+") as lock:  # as an eval in another process holds it
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        lock.write(f"{os.getpid()}\n")  # (the holder's pid, as eval.py writes it)
        lock.flush()
        refused(run("eval.py", "--model", str(MODEL), *EVAL, "--out-dir", str(out)),
                f"--out-dir {out} is in use by another eval.py (pid {os.getpid()})")
        assert sorted(os.listdir(out)) == [".lock"]
    (out / ".lock").unlink()
    r = run("eval.py", "--model", str(MODEL), *EVAL, "--out-dir", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(os.listdir(out)) == ["results.json"]  # its lock goes with it
    first = (out / "results.json").read_bytes()
    refused(run("eval.py", "--model", str(MODEL), *EVAL, "--out-dir", str(out)),
            "exists; pass --overwrite")
    assert (out / "results.json").read_bytes() == first


def test_eval_into_a_run_under_way_is_refused(tmp_path):
    """train.py (--overwrite or --resume) holds RUN: eval.py RUN/final would write the old model's
    results into the new run."""
    out = with_model(tmp_path / "run")
    before = snapshot(out)
    with open(out / ".lock", "a+") as lock:  # as train.py holds it
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        lock.write(f"{os.getpid()}\n")  # (the holder's pid, as train.py writes it)
        lock.flush()
        r = run("eval.py", "--model", str(out / "final"), *EVAL)
        refused(r, f"{out} is in use by a run (pid {os.getpid()})", "--out-dir outside it")
    assert snapshot(out) == before | {".lock": f"{os.getpid()}\n".encode()}


def test_a_run_is_not_started_on_a_folder_an_eval_writes_into(tmp_path):
    out = with_model(tmp_path / "run")
    (out / ".lock").write_text("99\n")
    before = snapshot(out)
    with open(out / ".lock") as lock:  # as eval.py shares it while it writes into the run
        fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
        refused(train(out, "--overwrite"), "is in use by an eval.py writing its results into it")
    assert snapshot(out) == before and not (tmp_path / "run.overwritten").exists()


def test_overwrite_through_a_symlinked_out_dir(tmp_path):
    real, link = tmp_path / "real", tmp_path / "link"
    assert train(real).returncode == 0
    link.symlink_to(real)
    r = train(link, "--overwrite")
    assert r.returncode == 0, r.stderr[-3000:]
    assert link.is_symlink() and link.resolve() == real and (real / "final").is_dir()
    assert sorted(os.listdir(tmp_path)) == ["link", "real"]


# ------------------------------------------------------------------------------- environment

STALE = [  # (the environment, what the line says)
    ({"LOCAL_RANK": "0"}, "LOCAL_RANK set, but torchrun did not start this process"),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
      "MASTER_PORT": "29400"}, "torchrun did not start this process"),
    ({"TORCHELASTIC_RUN_ID": "x", "RANK": "1", "WORLD_SIZE": "2"},
     "LOCAL_RANK, MASTER_ADDR, MASTER_PORT not set"),
    ({"TORCHELASTIC_RUN_ID": "x", "RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
      "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400"}, "do not fit"),
    ({"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "two", "LOCAL_RANK": "0",
      "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400"}, "do not fit"),
]


@pytest.mark.parametrize("env, words", STALE, ids=["local_rank", "stale", "part", "rank", "text"])
def test_torchrun_variables_without_torchrun_are_one_line(tmp_path, env, words):
    out = tmp_path / "run"
    refused(train(out, env=env, timeout=120), words)  # (the old code waited two hours)
    assert not out.exists()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_during_the_rendezvous_stops_at_once(tmp_path):
    """Rank 0 of two waits for a rank that never comes: SIGTERM ends it within seconds, with
    nothing written."""
    port, out = free_port(), tmp_path / "run"
    env = {**ENV, "TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    proc = subprocess.Popen([sys.executable, "train.py", *TINY, f"--out_dir={out}"], cwd=REPO,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:  # the store listens: rendezvous
            with socket.socket() as c:
                if c.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        time.sleep(1)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode in (-signal.SIGTERM, 128 + signal.SIGTERM) and not out.exists()


def test_a_wandb_mode_wandb_does_not_know_is_one_line_and_nothing_written(tmp_path):
    out = tmp_path / "run"
    env = {"WANDB_MODE": "garbage"}
    refused(train(out, "--wandb.mode=offline", env=env), "WANDB_MODE='garbage'")
    assert not out.exists()
    before = previous_run(out)
    refused(train(out, "--wandb.mode=offline", "--overwrite", env=env), "WANDB_MODE")
    assert snapshot(out) == before and not (tmp_path / "run.overwritten").exists()
