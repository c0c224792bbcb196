"""Preemption at any moment (support/preempt.py): SIGTERM during a long eval, a long generation,
dynamic-sampling rounds or eval.py exits 143 within seconds with a checkpoint of the last completed
step (eval.py: the problems finished, marked partial), and --resume afterwards is bit-identical
to an uninterrupted run; the same under torchrun with two gloo processes, where a signal to one
rank stops both.

  pytest tests/test_preempt.py -q -s    # -s prints the time from SIGTERM to exit of each case

How a phase is made long: an eval by config (eval.k = 100,000 samples per problem, hours here;
eval.* may change on --resume, so the resumed run evaluates with the reference's k). A generation
or a dynamic-sampling round by SLOW, a test-only wrapper of train.py that sleeps after each token
of the chosen phase (a stand-in for a large model's per-token time; the tokens sampled are
unchanged, so the resumed run, without it, must match the reference). Each signal is sent once a
marker shows the phase has begun, never after a fixed sleep.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from support.checkpoint import checkpoints
from fixtures import snapshot, train_here
from support.util import kill_tree
from tests.test_checkpoint import ENV, MODEL, REPO, TIMING, needs_model

STEPS = 6
TINY = ["--config", "configs/tiny.yaml", f"--model.path={MODEL}", "--rollout.batch_size=16",
        "--rollout.group_size=4", "--rollout.max_new_tokens=24", "--rollout.gen_batch_size=8",
        "--eval.n=8", "--eval.k=1", "--eval.every=3", "--checkpoint.every=0",
        "--reward.no_answer=-1", "--replay.strategy=uniform", "--replay.ratio=0.25", "--threads=1",
        "--wandb.mode=disabled", f"--max_steps={STEPS}"]
DYNAMIC = ["--rollout.dynamic_sampling=8", "--reward.no_answer=0"]  # many flat groups: 2 rounds
LONG_EVAL = "--eval.k=100000"
DELAY = 1.0  # SLOW's seconds per token
STOP_WITHIN = 6.0  # seconds from SIGTERM to the note while SLOW generates: the token under way
# (DELAY), then the checkpoint. Measured 1.0-1.2 s on 2 cores, one process or torchrun; a
# generation that ignores the stop flag runs its HF generate call to the end (20-25 s here).
LAUNCHER = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]

# train.py with the generation of one phase slowed down. SLOW_PHASE rollout: from the SLOW_CALL-th
# generate call (round) of step SLOW_STEP's rollout, steps counted from 0; eval: the eval after step
# SLOW_STEP; update: the passes of step SLOW_STEP's update after its third (DELAY seconds before
# each: three passes have moved the weights and AdamW's moments when a stop comes). The first
# slowed token (or pass) of each rank appends "rank pid" to SLOW_MARKER.
SLOW = """
import os, sys, time
sys.path.insert(0, os.environ["REPO"])
import grpo, rollout, train
env = os.environ
phase, at, delay = env["SLOW_PHASE"], int(env["SLOW_STEP"]), float(env["SLOW_DELAY"])
call = int(env.get("SLOW_CALL", "1"))
state = {"on": False, "marked": False, "step": -1, "calls": 0, "eval": False}
real_round, real_eval, real_generate = train.one_round, train.held_out_eval, rollout.generate
real_token = rollout._SamplingDistribution.__call__
def round_(r, step, t, rnd=0, rounds=1):
    if rnd == 0:  # a step's rollout starts
        state["step"], state["calls"] = step, 0
    return real_round(r, step, t, rnd, rounds)
def generate_(*a, **k):
    if state["eval"]:  # the eval's generate calls: run_eval_ decides
        return real_generate(*a, **k)
    state["calls"] += 1
    state["on"] = phase == "rollout" and state["step"] == at and state["calls"] >= call
    try:
        return real_generate(*a, **k)
    finally:
        state["on"] = False
def run_eval_(r):
    state["on"] = phase == "eval" and r.progress.step == at
    state["eval"] = True
    try:
        return real_eval(r)
    finally:
        state["on"] = state["eval"] = False
def slow():  # DELAY seconds; the first time, "rank pid" into SLOW_MARKER
    if not state["marked"]:
        with open(env["SLOW_MARKER"], "a") as f:
            f.write(f"{env.get('RANK', '0')} {os.getpid()}\\n")
        state["marked"] = True
    time.sleep(delay)
def token(self, input_ids, scores):
    if state["on"]:
        slow()
    return real_token(self, input_ids, scores)
real_pass = grpo.run_pass
def pass_(u, k, inspect=None):  # SLOW_PHASE update: step SLOW_STEP's passes after its third
    if phase == "update" and state["step"] == at and k >= 3:
        slow()
    return real_pass(u, k, inspect)
grpo.run_pass = pass_
train.one_round, train.held_out_eval, rollout.generate = round_, run_eval_, generate_
rollout._SamplingDistribution.__call__ = token
sys.exit(train.main(sys.argv[1:]))
"""


def metrics(out: Path) -> list[dict]:
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    timing = [k for r in rows for k in r if k.startswith("time/") or k in TIMING]
    return [{k: v for k, v in r.items() if k not in timing} for r in rows]


def weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def assert_same_run(a: Path, b: Path, steps: int = STEPS) -> None:
    """Every logged field but timing, the summary, and every tensor of the final weights: equal."""
    ma, mb = metrics(a), metrics(b)
    assert [r["step"] for r in mb] == list(range(1, steps + 1))  # every step once
    assert json.dumps(ma) == json.dumps(mb)  # as text: NaN fields compare equal
    wa, wb = weights(a / "final"), weights(b / "final")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (a, b))
    sa.pop("wall_seconds"), sb.pop("wall_seconds")
    assert json.dumps(sa) == json.dumps(sb)


class Launch:
    """train.py (or SLOW; under torchrun or not) in the background, stderr to a file; the time from
    a signal to the exit."""

    def __init__(self, tmp: Path, out: Path, *args: str, slow: dict | None = None,
                 torchrun: bool = False):
        self.err, self.marker = tmp / f"{out.name}.err", tmp / f"{out.name}.marker"
        self.marker.unlink(missing_ok=True)
        script = tmp / "slow_train.py"
        script.write_text(SLOW)
        entry = [str(script)] if slow else ["train.py"]
        python = LAUNCHER if torchrun else [sys.executable]
        cmd = python + entry + TINY + [f"--out_dir={out}", *args]
        env = ENV | {"REPO": str(REPO), "SLOW_MARKER": str(self.marker), "SLOW_DELAY": str(DELAY)}
        env |= {f"SLOW_{k.upper()}": str(v) for k, v in (slow or {}).items()}
        with open(self.err, "w") as err:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                                         stderr=err, start_new_session=True)

    def wait_for(self, seen, what: str, timeout: float = 400) -> None:
        deadline = time.time() + timeout
        while not seen():
            if self.proc.poll() is not None or time.time() > deadline:
                self.kill()
                pytest.fail(f"{what} never came: {self.stderr()[-3000:]}")
            time.sleep(0.02)

    def wait_for_text(self, text: str) -> None:
        self.wait_for(lambda: text in self.stderr(), repr(text))

    def wait_for_marker(self, ranks: int = 1) -> list[int]:
        """The pids of the ranks that began the slowed phase."""
        def began():
            return self.marker.exists() and len(self.marker.read_text().splitlines()) >= ranks

        self.wait_for(began, "the slowed phase")
        lines = sorted(ln.split() for ln in self.marker.read_text().splitlines())
        return [int(pid) for _, pid in lines]

    def stop(self, pid: int | None = None, name: str = "", ranks: int = 1) -> tuple[int, float]:
        """SIGTERM to `pid` (default: the process started): the exit code and the seconds until
        every rank's "stopped by" note (its checkpoint is written); prints them and the seconds to
        the exit."""
        t0 = time.perf_counter()
        os.kill(pid or self.proc.pid, signal.SIGTERM)
        noted = None
        while self.proc.poll() is None:
            if noted is None and self.stderr().count("stopped by SIGTERM") >= ranks:
                noted = time.perf_counter() - t0
            if time.perf_counter() - t0 > 120:
                self.kill()
                pytest.fail(f"no exit within 120 s of SIGTERM: {self.stderr()[-3000:]}")
            time.sleep(0.01)
        seconds = time.perf_counter() - t0
        noted = seconds if noted is None else noted
        print(f"\n[preempt] {name}: SIGTERM to the note(s) {noted:.2f} s, to the exit "
              f"{seconds:.2f} s, exit code {self.proc.returncode}")
        return self.proc.returncode, noted

    def kill(self) -> None:
        if self.proc.poll() is None:
            kill_tree(self.proc.pid)
            self.proc.wait()

    def stderr(self) -> str:
        return self.err.read_text()


def run(out: Path, *args: str, torchrun: bool = False) -> None:
    """A whole run in the foreground, in this process or under torchrun; it must succeed."""
    argv = TINY + [f"--out_dir={out}", *args]
    if torchrun:
        r = subprocess.run(LAUNCHER + ["train.py"] + argv, cwd=REPO, env=ENV, capture_output=True,
                           text=True, timeout=900, check=False)
    else:
        r = train_here(*argv)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]


def stopped(launch: Launch, code: int, step: int, world: int = 1) -> None:
    """Exit 143 with the note, one checkpoint, of `step`, with every rank's state."""
    err = launch.stderr()
    assert code == 143 or world > 1, err[-3000:]  # (torchrun says its workers failed: exit 1)
    assert 'train.py", line' not in err, err[-3000:]  # no traceback through train.py on any rank
    assert f"stopped by SIGTERM after step {step}" in err, err[-3000:]
    out = Path(next(a for a in launch.proc.args if a.startswith("--out_dir=")).partition("=")[2])
    ck = checkpoints(out)[-1]
    assert ck.name == f"step_{step:06d}", ck
    states = sorted(p.name for p in ck.glob("state_rank*.pt"))
    assert states == [f"state_rank{r}.pt" for r in range(world)]


@pytest.fixture(scope="module")
def dynamic_reference(tmp_path_factory) -> Path:
    if not (MODEL / "config.json").is_file():
        pytest.skip(f"no tiny model at {MODEL}")
    out = tmp_path_factory.mktemp("ref") / "dynamic"
    run(out, *DYNAMIC)
    rounds = [r["dynamic/rounds"] for r in metrics(out)]
    assert rounds[4] >= 2, f"step 5 must take a second round, for the test to mean it: {rounds}"
    return out


# ---------------------------------------------------------------------------------- one process


@needs_model
def test_sigterm_during_the_first_eval_checkpoints_step_0_and_resume_is_bit_identical(
        dynamic_reference, tmp_path):
    """The step-0 eval, 8 problems × 100,000 samples: the run stops within seconds and checkpoints
    step 0 (the run as set up: --resume works as after any other stop), and the resumed run is the
    reference."""
    out = tmp_path / "run"
    launch = Launch(tmp_path, out, LONG_EVAL, *DYNAMIC)
    launch.wait_for_text("eval 0:")  # its progress bar
    code, _ = launch.stop(name="the step-0 eval")
    stopped(launch, code, 0)
    assert "--resume continues from step_000000" in launch.stderr()
    run(out, "--resume", *DYNAMIC)  # eval.k back to the reference's: eval.* may change on --resume
    assert_same_run(dynamic_reference, out)


@pytest.mark.long
@needs_model
def test_sigterm_during_a_long_eval_checkpoints_its_step_and_resume_is_bit_identical(
        dynamic_reference, tmp_path):
    """The eval after step 3 (every 3 steps), 100,000 samples per problem: the checkpoint is of step
    3, whose metrics line waits for its eval; --resume runs that eval first, and the run is the
    reference."""
    out, log = tmp_path / "run", tmp_path / "run" / "metrics.jsonl"
    first = Launch(tmp_path, out, *DYNAMIC)  # steps 1-2 at the reference's eval.k, then a stop
    first.wait_for(lambda: log.is_file() and '"step": 1,' in log.read_text(), "step 1")
    code, _ = first.stop(name="between steps")
    assert code == 143 and len(metrics(out)) < 3, first.stderr()[-3000:]
    launch = Launch(tmp_path, out, "--resume", LONG_EVAL, *DYNAMIC)
    launch.wait_for_text("eval 3:")
    code, _ = launch.stop(name="the eval after step 3")
    stopped(launch, code, 3)
    assert "with the eval of step 3, cut short" in launch.stderr()
    assert [r["step"] for r in metrics(out)] == [1, 2]  # step 3's line waits for its eval
    run(out, "--resume", *DYNAMIC)
    assert_same_run(dynamic_reference, out)


@needs_model
@pytest.mark.parametrize("call", [1, 2], ids=["generation", "dynamic_sampling_round_2"])
def test_sigterm_during_a_long_generation_abandons_the_step_and_resume_is_bit_identical(
        dynamic_reference, tmp_path, call):
    """Step 5's rollout, slowed to DELAY seconds a token (16 completions of up to 24 tokens, 2 HF
    generate calls a round), in its first round or in the second round of dynamic sampling. The step
    is abandoned, the checkpoint is of step 4 (with step 5's RNG streams and data position at its
    start), and the resumed run is the reference. The note comes within STOP_WITHIN seconds
    (guards against generation ignoring the stop flag: `StopRequested` left out of HF generate)."""
    out = tmp_path / "run"
    launch = Launch(tmp_path, out, *DYNAMIC, slow={"phase": "rollout", "step": 4, "call": call})
    launch.wait_for_marker()
    code, noted = launch.stop(name=f"generate call {call} of step 5")
    assert noted < STOP_WITHIN, f"the stop took {noted:.1f} s: generation ignored it"
    stopped(launch, code, 4)
    assert [r["step"] for r in metrics(out)] == [1, 2, 3, 4]
    run(out, "--resume", *DYNAMIC)
    assert_same_run(dynamic_reference, out)


# Updates of 16 passes, in runs of 3 steps: SFPO's 15 fast passes and its slow one; plain GRPO's
# 16 epochs
PASSES = {"sfpo": ["--lookahead.method=sfpo", "--lookahead.fast_steps=15", "--max_steps=3"],
          "epochs": ["--optim.epochs=16", "--max_steps=3"]}


@needs_model
@pytest.mark.parametrize("update", list(PASSES))
def test_sigterm_during_an_update_of_many_passes_stops_between_steps_and_resume_is_bit_identical(
        tmp_path, update):
    """#58: a stop during step 2's update of 16 passes, after its third (the 13 left slowed to DELAY
    seconds each), is honoured before the next optimizer step (the note within STOP_WITHIN s, not
    after the update): the step is put back as at its start (weights and AdamW's moments, which
    step 1 made and three passes moved; the replay, which holds step 1's rows; the RNG streams,
    the progress), the checkpoint is of step 1, and the resumed run is the uninterrupted one."""
    ref, out = tmp_path / "ref", tmp_path / "run"
    run(ref, *PASSES[update])
    launch = Launch(tmp_path, out, *PASSES[update], slow={"phase": "update", "step": 1})
    launch.wait_for_marker()
    code, noted = launch.stop(name=f"{update}: pass 4 of step 2's 16")
    assert noted < STOP_WITHIN, f"the stop took {noted:.1f} s: the update ran on"
    stopped(launch, code, 1)
    assert [r["step"] for r in metrics(out)] == [1]
    run(out, "--resume", *PASSES[update])
    assert_same_run(ref, out, steps=3)


# Prompt skipping and staged rollouts on, 12 training prompts: steps 4 on revisit prompts, so the
# skip rule has traces to act on (p_init 0.05: a prompt seen once is skipped with p = 0.95)
SKIPPING = ["--skip.enabled=true", "--skip.p_init=0.05", "--stages.first=2",
            "--data.tiny.train_size=12"]


@needs_model
def test_sigterm_during_a_generation_with_skipping_on_resumes_bit_identical(tmp_path):
    """Guards the rewind of the skip state (its generator, its traces) and the staged rollouts'
    stored successes: a stop during step 5's rollout, where GRESO has already drawn for its
    candidates, puts them back as at the step's start, so the resumed run is the reference."""
    ref = tmp_path / "ref"
    run(ref, *SKIPPING)
    assert sum(r["greso/skipped"] for r in metrics(ref)[3:]) > 0, "nothing skipped from step 4"
    out = tmp_path / "run"
    launch = Launch(tmp_path, out, *SKIPPING, slow={"phase": "rollout", "step": 4, "call": 1})
    launch.wait_for_marker()
    code, _ = launch.stop(name="generate call 1 of step 5, skipping on")
    stopped(launch, code, 4)
    assert [r["step"] for r in metrics(out)] == [1, 2, 3, 4]
    run(out, "--resume", *SKIPPING)
    assert_same_run(ref, out)


@needs_model
def test_sigterm_during_eval_py_writes_the_finished_problems_marked_partial(tmp_path):
    """eval.py, 400 problems × 64 samples: stopped once 3 are done, it exits 143 and writes the
    problems finished (marked partial) and their correct completions as whole lines (RLEP's phase
    I); they are exactly what an eval of those problems alone gives."""
    out, saved, err = tmp_path / "out", tmp_path / "phase1.jsonl", tmp_path / "eval.err"
    common = [sys.executable, "eval.py", "--model", str(MODEL), "--benchmarks", "tiny", "--k", "64",
              "--batch-size", "64", "--max-new-tokens", "24", "--template", "{problem}",
              "--temperature", "1.0"]
    long = ["--limit", "400", "--out-dir", str(out), "--save-correct", str(saved)]
    with open(err, "w") as f:
        proc = subprocess.Popen(common + long, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL,
                                stderr=f)
    deadline = time.time() + 300
    while proc.poll() is None and "| 3/400" not in err.read_text() and time.time() < deadline:
        time.sleep(0.02)
    t0 = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=120)
    seconds = time.perf_counter() - t0
    print(f"\n[preempt] eval.py: SIGTERM to exit {seconds:.2f} s, exit code {code}")
    assert code == 143 and "Traceback" not in err.read_text(), err.read_text()[-3000:]
    result = json.loads((out / "results.json").read_text())
    n = result["benchmarks"]["tiny"]["n"]
    assert result["partial"] is True and 3 <= n < 400 and len(result["problems"]["tiny"]) == n
    meta = json.loads(Path(f"{saved}.meta.json").read_text())
    assert meta["partial"] is True and meta["problems"] == n
    lines = saved.read_text().splitlines()
    assert saved.read_text().endswith("\n")
    assert all(json.loads(ln)["completion_ids"] for ln in lines)  # whole lines only
    whole = tmp_path / "whole"
    short = ["--limit", str(n), "--out-dir", str(whole), "--save-correct", f"{whole}.jsonl"]
    r = subprocess.run(common + short, cwd=REPO, env=ENV, capture_output=True, text=True,
                       check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    expected = json.loads((whole / "results.json").read_text())
    assert json.dumps(expected["problems"]) == json.dumps(result["problems"])
    assert Path(f"{whole}.jsonl").read_text() == saved.read_text()


# ---------------------------------------------------------------------- torchrun, 2 gloo processes


@pytest.fixture(scope="module")
def torchrun_reference(tmp_path_factory) -> Path:
    if not (MODEL / "config.json").is_file():
        pytest.skip(f"no tiny model at {MODEL}")
    out = tmp_path_factory.mktemp("ref") / "torchrun"
    run(out, *DYNAMIC, torchrun=True)
    return out


@needs_model
def test_torchrun_sigterm_to_one_rank_during_a_long_eval_stops_both(torchrun_reference, tmp_path):
    """SIGTERM to rank 1 alone (a scheduler draining one node) during the step-0 eval (each rank's
    share: 4 problems × 100,000 samples, hours here): rank 1 posts the stop, rank 0 sees it within a
    second and abandons its eval too, both agree and checkpoint step 0, within a minute; the resumed
    run is the uninterrupted one."""
    out = tmp_path / "run"
    slow = {"phase": "eval", "step": 0, "delay": 0}  # (not slowed: its marker gives the pids)
    launch = Launch(tmp_path, out, LONG_EVAL, *DYNAMIC, torchrun=True, slow=slow)
    pids = launch.wait_for_marker(ranks=2)
    code, seconds = launch.stop(pids[1], name="torchrun, the step-0 eval, rank 1 only", ranks=2)
    stopped(launch, code, 0, world=2)
    assert launch.stderr().count("stopped by SIGTERM after step 0") == 2  # each rank says it
    assert seconds < 60  # rank 0 alone would have gone on for hours
    run(out, "--resume", *DYNAMIC, torchrun=True)
    assert_same_run(torchrun_reference, out)


@pytest.mark.long
@needs_model
@pytest.mark.parametrize("call", [1, 2], ids=["generation", "dynamic_sampling_round_2"])
def test_torchrun_sigterm_to_the_launcher_during_a_long_generation_stops_every_rank(
        torchrun_reference, tmp_path, call):
    """SIGTERM to torchrun (as a scheduler sends it), which forwards it to both workers, while both
    generate slowly: the first round of a step, or the second round of dynamic sampling. Both ranks
    abandon the step and checkpoint the one before, within STOP_WITHIN seconds (guards against
    generation ignoring the stop flag); the resumed run is the uninterrupted one."""
    rounds = [r["dynamic/rounds"] for r in metrics(torchrun_reference)]
    step = next((i for i in range(1, STEPS) if rounds[i] >= call), None)
    assert step is not None, f"no step after the first takes {call} rounds: {rounds}"
    out = tmp_path / "run"
    launch = Launch(tmp_path, out, *DYNAMIC, torchrun=True,
                    slow={"phase": "rollout", "step": step, "call": call})
    launch.wait_for_marker(ranks=2)
    code, noted = launch.stop(name=f"torchrun, round {call} of step {step + 1}, the launcher",
                              ranks=2)
    assert noted < STOP_WITHIN, f"the stop took {noted:.1f} s: generation ignored it"
    stopped(launch, code, step, world=2)
    assert launch.stderr().count(f"stopped by SIGTERM after step {step}") == 2
    run(out, "--resume", *DYNAMIC, torchrun=True)
    assert_same_run(torchrun_reference, out)


def start_and_signal_in_set_up(out: Path, sig: int, *args: str) -> tuple[int, str, float]:
    """train.py on `out`, signalled as soon as its set-up holds out_dir's lock (.lock names its
    pid): (exit code, stderr, seconds from the signal to the exit)."""
    cmd = [sys.executable, "train.py", *TINY, f"--out_dir={out}", "--max_steps=4", *args]
    proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        lock = out / ".lock"
        if lock.is_file() and lock.read_text().strip() == str(proc.pid):
            break
        time.sleep(0.01)
    assert proc.poll() is None, "the run ended before its set-up could be signalled"
    proc.send_signal(sig)
    t0 = time.monotonic()
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        raise
    return proc.returncode, err, time.monotonic() - t0


@needs_model
@pytest.mark.parametrize("how,sig", [("new", signal.SIGTERM), ("overwrite", signal.SIGTERM),
                                     ("resume", signal.SIGINT)])
def test_a_signal_during_set_up_ends_it_at_once_and_leaves_out_dir_as_it_was(tmp_path, how, sig):
    """SIGTERM or SIGINT while set-up loads (data, model, a checkpoint) ends the process within
    seconds, with one line and 128 + the signal: out_dir is as it was (a new run's folder gone; an
    --overwrite's old run in place, not moved aside; a --resume's config.yaml and metrics as they
    were), where set-up used to run to its end and the loop then stopped."""
    out = tmp_path / "run"
    args = []
    if how != "new":
        done = subprocess.run([sys.executable, "train.py", *TINY, f"--out_dir={out}",
                               "--max_steps=2", "--checkpoint.every=1"], cwd=REPO, env=ENV,
                              capture_output=True, text=True, timeout=600, check=False)
        assert done.returncode == 0, done.stderr[-2000:]
        args = [f"--{how}"]
    before = snapshot(out) if out.exists() else None
    code, err, took = start_and_signal_in_set_up(out, sig, *args)
    assert code == 128 + sig, err[-2000:]
    assert "during set-up" in err and "Traceback" not in err, err[-2000:]
    assert took < 10, f"the stop took {took:.1f} s"
    if before is None:
        assert not out.exists(), sorted(out.rglob("*"))
    else:
        assert snapshot(out) == before
        assert not Path(f"{out}.overwritten").exists()


@needs_model
def test_torchrun_fsdp_sigterm_to_one_rank_during_an_update_of_many_passes(tmp_path):
    """#58 under FSDP2 on two ranks: SIGTERM to rank 1 alone during step 5's update of 16 epochs
    (after its third pass): the stop rides on the next optimizer step's all-reduce, both ranks put
    the step back (their weight and AdamW shards, DTensors) and checkpoint step 4 within
    STOP_WITHIN seconds; the resumed run is the uninterrupted one."""
    args = ["--model.parallel=fsdp", *PASSES["epochs"]]
    ref, out = tmp_path / "ref", tmp_path / "run"
    run(ref, *args, torchrun=True)
    launch = Launch(tmp_path, out, *args, torchrun=True, slow={"phase": "update", "step": 4})
    pids = launch.wait_for_marker(ranks=2)
    code, noted = launch.stop(pid=pids[1], name="torchrun fsdp, pass 4 of 16, rank 1", ranks=2)
    assert noted < STOP_WITHIN, f"the stop took {noted:.1f} s: the update ran on"
    stopped(launch, code, 4, world=2)
    run(out, "--resume", *args, torchrun=True)
    assert_same_run(ref, out)
