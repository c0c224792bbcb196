"""Round six (#58 classes 7 and 8), through train.py in subprocesses: a refusal naming a path that
holds a newline is still one line; --resume on a disk that cannot hold the next checkpoint is
refused alone, before any note; a hub id without network fails at once, in one line; a lock held
by another process names the holder that is known, not the pid its file names; a valid non-ASCII
path under an ASCII locale (LC_ALL=C, PYTHONUTF8=0) trains and resumes. Each refusal: exit 2, one
line on stderr, no traceback, every file as it was.

  pytest -q tests/test_bad_input_env.py        # ~4 min on 2 busy cores
"""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from fixtures import previous_run, snapshot

from fixtures import REPO  # (tests/fixtures.py: the repository's root)
MODEL = REPO / "data" / "tiny_model"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled",
       "TOKENIZERS_PARALLELISM": "false"}
TINY = ["--config", str(REPO / "configs" / "tiny.yaml"), f"--model.path={MODEL}",
        "--rollout.batch_size=16", "--rollout.group_size=4", "--rollout.max_new_tokens=24",
        "--max_steps=2", "--eval.n=8", "--eval.k=1", "--checkpoint.every=1", "--threads=1",
        "--wandb.mode=disabled"]
pytestmark = pytest.mark.skipif(not (MODEL / "config.json").is_file(), reason="no tiny model")


def run(*args: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """`python ARGS` from the repository, in ENV updated by `env` (a None value: unset)."""
    full = {**ENV, **(env or {})}
    for name in [k for k, v in full.items() if v is None]:
        del full[name]
    return subprocess.run([sys.executable, *args], cwd=REPO, env=full, capture_output=True,
                          text=True, timeout=timeout, check=False)


def refused(r: subprocess.CompletedProcess, *words: str) -> str:
    """Exit 2 and one line on stderr holding `words`, no traceback."""
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr[-3000:]
    assert r.stderr.startswith("error: ") and "Traceback" not in r.stderr
    for w in words:
        assert w in r.stderr, r.stderr
    return r.stderr


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A run of 2 steps, a checkpoint after each."""
    out = tmp_path_factory.mktemp("trained") / "run"
    r = run("train.py", *TINY, f"--out_dir={out}")
    assert r.returncode == 0, r.stderr[-3000:]
    return out


# ------------------------------------------------------------------ every refusal one line


def test_a_path_holding_a_newline_is_refused_in_one_line(tmp_path):
    """The path is named with its newline written as \\n (support/util.printable)."""
    out = tmp_path / "two\nlines"
    out.mkdir()
    (out / "notes.txt").write_text("not a run's\n")
    before = snapshot(out)
    refused(run("train.py", *TINY, f"--out_dir={out}"), "two\\nlines holds files no run wrote")
    assert snapshot(out) == before
    config = tmp_path / "no\nsuch.yaml"
    refused(run("train.py", "--config", str(config)), "config file not found", "no\\nsuch.yaml")


# ------------------------------------------------------------ a disk too full to resume on


ON_A_DISK = """
import os, runpy, shutil, sys, types
free = int(os.environ["FREE"])  # train.py as run, on a disk with FREE bytes free
shutil.disk_usage = lambda path: types.SimpleNamespace(total=1 << 40, used=(1 << 40) - free,
                                                       free=free)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_resume_on_a_disk_too_full_for_a_checkpoint_is_refused_alone(trained, tmp_path):
    """The refusal comes at set-up, alone: no resume note before it, no step run for nothing."""
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    before = snapshot(out)
    args = ["-c", ON_A_DISK, str(REPO / "train.py"), *TINY, f"--out_dir={out}", "--max_steps=3",
            "--resume"]
    r = run(*args, env={"FREE": "4096"})
    refused(r, f"--resume: 4,096 bytes free on the disk of {out}, fewer than the ",
            "of step_000002 that the next checkpoint needs: free space, then --resume")
    assert snapshot(out) == before
    r = run(*args, env={"FREE": str(1 << 40)})  # the same command with room: it resumes
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming from " in r.stderr


# ------------------------------------------------------------------- a hub id, no network


OFFLINE = {"HF_HUB_OFFLINE": "1"}
NO_NETWORK = {"HF_HUB_OFFLINE": None, "HTTPS_PROXY": "http://127.0.0.1:9",  # refused at once
              "https_proxy": "http://127.0.0.1:9", "NO_PROXY": None, "no_proxy": None}


@pytest.mark.parametrize("env", [OFFLINE, NO_NETWORK], ids=["offline", "no_network"])
def test_a_hub_id_out_of_reach_fails_at_once_in_one_line(tmp_path, env):
    """Not in the cache, and the hub offline or out of reach: one line within seconds, where
    transformers retried each file five times (23 lines over a minute)."""
    out = tmp_path / "run"
    start = time.monotonic()
    r = run("train.py", *TINY, "--model.path=no-such-org-58/no-such-model", f"--out_dir={out}",
            env={**env, "HF_HOME": str(tmp_path / "hf")})  # (an empty cache)
    refused(r, "model.path no-such-org-58/no-such-model: a hub id not in the local Hugging Face "
               "cache, and ")
    assert time.monotonic() - start < 60 and not out.exists()


# --------------------------------------------------------------------- who holds a lock


HOLD = """
import fcntl, os, sys, time
lock = open(sys.argv[1], "a+")
fcntl.flock(lock, fcntl.LOCK_EX)
if sys.argv[2] == "self":  # the holder writes its pid, as a run does
    lock.truncate(0)
    lock.write(f"{os.getpid()}\\n")
    lock.flush()
print("held", flush=True)
time.sleep(300)
"""


@pytest.mark.parametrize("names", ["other", "self"])
def test_a_lock_names_the_holder_that_is_known(tmp_path, names):
    """Held by a process whose pid .lock does not hold (a program that took the lock without
    writing, or a writer's pid left behind): that process is named, and .lock's pid as not the
    holder; a holder whose pid is in .lock is named by it."""
    out = tmp_path / "run"
    previous_run(out)
    (out / ".lock").write_text("4242\n")
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out / ".lock"), names],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        before = snapshot(out)
        r = run("train.py", *TINY, f"--out_dir={out}", "--resume")
        if names == "other":
            refused(r, f"is in use by another process (pid {holder.pid}; its .lock names pid "
                       "4242, which does not hold it)")
        else:
            refused(r, f"is in use by another run (pid {holder.pid})")
        assert snapshot(out) == before
    finally:
        holder.kill()
        holder.wait()


# -------------------------------------------------------- non-ASCII paths, an ASCII locale


def test_a_non_ascii_path_under_an_ascii_locale_trains_and_resumes(tmp_path):
    """LC_ALL=C without UTF-8 mode: Python reads the path's bytes as lone surrogates, which are
    the file system's own spelling of them (not the lone surrogates a JSON escape makes): the run
    trains from a model folder and into an out_dir named in UTF-8, and resumes; text that is not a
    path is those bytes read as UTF-8."""
    model, out = tmp_path / "modèle", tmp_path / "runé"
    shutil.copytree(MODEL, model)
    ascii_locale = {"LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONIOENCODING": None}
    args = [*TINY, f"--model.path={model}", f"--out_dir={out}",
            "--data.template=Problème {problem}"]
    r = run("train.py", *args, env=ascii_locale)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "runé".encode() in os.listdir(bytes(tmp_path))  # the bytes as given
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["data"]["template"] == "Problème {problem}"
    assert (out / "checkpoints" / "step_000002" / "manifest.json").is_file()
    r = run("train.py", *args, "--max_steps=3", "--resume", env=ascii_locale)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (out / "checkpoints" / "step_000003").is_dir() and (out / "summary.json").is_file()
