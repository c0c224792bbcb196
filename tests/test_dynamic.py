"""DAPO's dynamic sampling (rollout.dynamic_sampling) through train.py on the embedded model: only
groups with a reward spread reach the update, every generated token is counted, and the round cap
stops it and says so."""

import json

import pytest

import rollout
import train
from config import load_config, validate

from fixtures import REPO  # (tests/fixtures.py: the repository's root)
pytestmark = pytest.mark.skipif(not (REPO / "data" / "tiny_model" / "config.json").exists(),
                                reason="no tiny model")


def run(tmp_path, monkeypatch, *args):
    """Two steps of 4 prompts x 8; returns the metric rows and the tokens every generate call
    produced."""
    made = []
    real = rollout.generate

    def counting(model, tokenizer, prompts, cfg, stop, prompt_idx=None, *a, **k):
        ro, texts = real(model, tokenizer, prompts, cfg, stop, prompt_idx, *a, **k)
        if prompt_idx is not None:  # a training step's: the evals' calls carry no prompt indices
            made.append(int(ro.completion_len.sum()))
        return ro, texts

    monkeypatch.setattr(rollout, "generate", counting)
    cfg = load_config(str(REPO / "configs" / "tiny.yaml"), [
        f"--out_dir={tmp_path / 'run'}", "--max_steps=2", "--rollout.batch_size=32", "--eval.n=4",
        "--eval.k=1",
        "--eval.every=0", "--checkpoint.every=0", "--wandb.mode=disabled", "--threads=1", *args])
    validate(cfg)
    assert train.train(cfg) == 0
    rows = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return rows, made


def test_only_informative_groups_reach_the_update_and_every_token_counts(tmp_path, monkeypatch):
    rows, made = run(tmp_path, monkeypatch, "--rollout.dynamic_sampling=8")
    # a full batch of signal
    assert all(r["adv/zero_std_frac"] == 0 and r["dynamic/capped"] == 0 for r in rows)
    # every round's tokens, dropped groups included
    assert rows[-1]["generated_tokens"] == sum(made)
    # (this seed needs a second round at least once)
    assert sum(r["dynamic/rounds"] for r in rows) == len(made) > 2
    for r in rows:  # each round draws 4 new prompts; 4 groups make the update, the rest are dropped
        assert r["dynamic/groups_dropped"] == 4 * r["dynamic/rounds"] - 4


def test_round_cap_stops_and_says_so(tmp_path, monkeypatch):
    """Rewards all equal: every group is flat, every round is spent, and the step trains on flat
    groups (no update)."""
    rows, made = run(tmp_path, monkeypatch, "--rollout.dynamic_sampling=3", "--reward.correct=0",
                     "--reward.wrong=0",
                     "--reward.no_answer=0")
    assert ([r["dynamic/rounds"] for r in rows] == [3, 3]
            and all(r["dynamic/capped"] == 1 for r in rows))
    # 12 made, 4 fill the batch
    assert [r["dynamic/groups_dropped"] for r in rows] == [8, 8] and len(made) == 6
    assert rows[-1]["generated_tokens"] == sum(made) and rows[-1]["skipped/zero_adv"] == 2
