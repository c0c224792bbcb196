"""Prompt skipping (GRESO) and staged rollouts through train.py: SIGKILL and --resume bit-identical
with both on (their traces, p, generator and stored successes in the checkpoint), generated-token
accounting equal to the sum of the generated completions' lengths, and an unsolved prompt taking
its stored success as a replayed, off-policy row of its group.

A training set of 24 problems with 8 prompts a step revisits each prompt every third step, so
skipping has traces to act on within a few steps.
"""

import json
import signal
import subprocess
import sys

import pytest
import torch

import rollout
import train
from batch import Rollouts
from methods.stages import StageConfig, Stages
from tests.test_checkpoint import ENV, MODEL, REPO, needs_model, wait_for_step, weights

STEPS = 8
SMALL = ["--config", "configs/tiny.yaml", f"--model.path={MODEL}", "--rollout.batch_size=32",
         "--rollout.group_size=4", "--rollout.max_new_tokens=24", "--data.tiny.train_size=24",
         "--eval.n=8", "--eval.k=1", "--eval.every=0", "--checkpoint.every=2", "--threads=1",
         "--wandb.mode=disabled", "--skip.enabled=true", "--skip.p_init=0.05", "--stages.first=2",
         "--replay.strategy=aper", f"--max_steps={STEPS}"]
VARY = ("time/", "wall", "reward/verify_seconds", "reward/worker_frac")


def lines(out) -> list[dict]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(VARY)} for r in rows]


@pytest.mark.long
@needs_model
def test_skip_and_stages_resume_after_sigkill_is_bit_identical(tmp_path):
    ref = tmp_path / "ref"
    done = subprocess.run([sys.executable, "train.py", *SMALL, f"--out_dir={ref}"], cwd=REPO,
                          env=ENV, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    m = lines(ref)
    assert sum(r["greso/skipped"] for r in m) > 0, "nothing skipped: the test would prove nothing"
    assert any(r["stages/stopped"] > 0 for r in m), "no prompt stopped after stage 1"
    out = tmp_path / "run"
    cmd = [sys.executable, "train.py", *SMALL, f"--out_dir={out}"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    if wait_for_step(proc, out / "metrics.jsonl", 5):  # after the step-4 checkpoint
        proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL, "the run ended before it could be killed"
    again = subprocess.run([*cmd, "--resume"], cwd=REPO, env=ENV, capture_output=True,
                           text=True, timeout=600, check=False)
    assert again.returncode == 0, again.stderr[-2000:]
    assert json.dumps(lines(out)) == json.dumps(m)
    wa, wb = weights(ref / "final"), weights(out / "final")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@needs_model
def test_stage_generated_tokens_equal_the_sum_of_generated_lengths(tmp_path, monkeypatch):
    """Guards generated_tokens with staged rollouts: every stage's generated completions count,
    the stored successes taken (from step 4 on, when prompts come round again) do not."""
    sampled = []
    real = rollout.generate

    def counted(*a, **k):
        rows, texts = real(*a, **k)
        sampled.append(int(rows.completion_len.sum()))
        return rows, texts

    monkeypatch.setattr(rollout, "generate", counted)
    out = tmp_path / "run"
    args = [a for a in SMALL if not a.startswith("--max_steps")]
    assert train.main([*args, "--max_steps=6", f"--out_dir={out}", "--eval.n=1",
                       "--eval.greedy=false"]) == 0
    m = lines(out)
    assert sum(r["stages/stored_taken"] for r in m) > 0, "nothing taken: the test proves less"
    evals = 2  # the evals at steps 0 and 6 sample too: one problem, k = 1 each
    per_eval = sampled[:1] + sampled[-1:]
    assert len(sampled) > 6 + evals, "stage 2 never ran"
    assert m[-1]["generated_tokens"] == sum(sampled) - sum(per_eval)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rows_trained"] > 0 and summary["tokens_trained"] > 0


def rows(prompt: list[int], correct: list[bool], group: int, step: int = 0) -> Rollouts:
    """Rows of one prompt's group, as a sampler returns them (reward = correct)."""
    out = Rollouts.empty(len(correct), 4, 0)
    out.tokens[:] = torch.tensor([1, 2, 3, 4])
    out.prompt_len[:] = 2
    out.seq_len[:] = 4
    out.behav_logp[:, 2:] = -0.5
    out.prompt_idx[:] = prompt[0]
    out.group[:] = group
    out.born[:] = step
    out.onpolicy[:] = True
    out.correct = torch.tensor(correct)
    out.reward = out.correct.float()
    return out


def run_stages(st: Stages, sample, counts: list[int], key: tuple):
    """Stages.complete over a stand-in `sample(todo, key)`."""
    return st.complete(sample, counts, key)


def test_stage_unsolved_prompt_takes_its_stored_success_off_policy():
    st = Stages(StageConfig(first=2), pad_id=0)
    calls = []

    def sample_step(n):
        def sample(counts, key):
            calls.append(list(counts))
            done = [rows([7], [n == 0] * c, group=10 + n) for c in counts]
            return Rollouts.cat(done, 0), {"reward/correct_frac": float(n == 0)}
        return sample

    first, _ = run_stages(st, sample_step(0), [4], ("k",))  # solved 2 of 2: stops
    assert calls == [[2]] and len(first) == 2 and 7 not in st.stored
    st.observe(first)  # once the step's rollout is final (train.loop)
    assert 7 in st.stored
    calls.clear()
    # 0 of 2, then 0 of 4: takes the stored row
    second, said = run_stages(st, sample_step(1), [4], ("k",))
    assert calls == [[2], [2]]
    taken = second.select(second.replayed)
    assert len(taken) == 1 and bool(taken.correct.all())
    assert int(taken.group) == 11 and not bool(taken.onpolicy.any())
    assert torch.equal(taken.behav_logp[0, 2:], torch.tensor([-0.5, -0.5]))
    assert said["stages/stored_taken"] == 1.0


def test_stage_take_only_all_wrong_groups_whose_prompt_has_a_stored_success():
    """Stages.take gives a stored success only to a group with no correct row whose prompt has
    one, into that group: a mixed group (its correct row first or last), an all-right group and
    an all-wrong group of a prompt with nothing stored take nothing."""
    st = Stages(StageConfig(first=2), pad_id=0)
    st.observe(Rollouts.cat([rows([p], [True], group=0, step=1) for p in (7, 8, 9, 10, 11)], 0))
    fresh = Rollouts.cat([rows([7], [True, False], 20), rows([8], [False, False], 21),
                          rows([9], [False, True], 22), rows([10], [True, True], 23),
                          rows([5], [False, False], 24), rows([11], [False, False], 25)], 0)
    taken = st.take(fresh)
    assert taken.prompt_idx.tolist() == [8, 11]
    assert taken.group.tolist() == [21, 25]
    assert bool(taken.correct.all() and taken.replayed.all()) and not bool(taken.onpolicy.any())
    assert taken.born.tolist() == [1, 1]
    assert len(st.take(rows([7], [True, False], 20))) == 0
