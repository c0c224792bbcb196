"""A replay strategy defined in this file alone, registered without editing any other file, and run through train.py
in this process: PER-style replay whose priorities learn from the replayed rows' new advantages."""

import json
import math
import signal
from pathlib import Path

import pytest
import torch
from test_replay import MAX_LEN, PAD, push, replayed, rollouts

from replay import STRATEGIES, Replay, ReplayConfig, make_replay
from rollout import Rollouts

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def per_feedback():
    """Define the strategy (defining it registers it), then forget it after the test: tests/test_smoke.py runs every
    strategy registered when it is collected in a subprocess of train.py, which would not know this one."""

    class PerFeedbackReplay(Replay):
        """per_feedback: fresh rows are stored with priority |A| + priority_eps; each update batch adds
        k = round(ratio · n_fresh) rows drawn with replacement ∝ priority; after the update, every replayed row's priority
        becomes |A| + priority_eps of its advantage in that batch (new with replay.advantage=recompute), as prioritized
        experience replay updates the priorities of the transitions it just learned from."""

        name, METRICS = "per_feedback", ("rescored",)

        @staticmethod
        def check(cfg):
            return {"ratio": (0 <= cfg.ratio <= 4, "in [0, 4] for per_feedback (replayed rows per fresh row)"),
                    "priority_eps": (0 < cfg.priority_eps < 1e6, "> 0")}

        def sample(self, fresh, step):
            k = min(round(self.cfg.ratio * len(fresh)), len(self))
            weight = torch.where(self.valid, self.score, 0.0)  # (C,)
            slots = torch.multinomial(weight, k, replacement=True, generator=self.gen) if k else torch.zeros(0, dtype=torch.long)
            return Rollouts.cat([fresh, self._read(slots, fresh)], self.pad_id)

        def push(self, batch, step, entropy):
            again = batch.select(batch.replayed)  # feedback first: the write below may reuse these slots for new rows
            self.score[again.slot] = again.advantage.abs() + self.cfg.priority_eps
            fresh = batch.select(~batch.replayed)
            self._write(fresh, fresh.advantage.abs() + self.cfg.priority_eps)
            self.last |= {"rescored": float(len(torch.unique(again.slot)))}

    yield PerFeedbackReplay
    del STRATEGIES[PerFeedbackReplay.name]


def test_defining_the_class_registers_it_with_its_own_checks(per_feedback):
    assert STRATEGIES["per_feedback"] is per_feedback and per_feedback.__module__ == __name__
    rules = ReplayConfig(strategy="per_feedback", ratio=5.0).check()
    assert {"strategy", "capacity", "advantage", "rlep_source", "ratio", "priority_eps"} <= set(rules)  # shared + its own
    assert rules["strategy"][0] and not rules["ratio"][0]
    with pytest.raises(ValueError, match=r"replay.ratio must be in \[0, 4\] for per_feedback \(replayed rows per fresh row\), got 5.0"):
        make_replay(ReplayConfig(strategy="per_feedback", ratio=5.0), max_len=MAX_LEN, pad_id=PAD, seed=0)


def test_feedback_rescores_exactly_the_replayed_slots(per_feedback):
    cfg = ReplayConfig(strategy="per_feedback", ratio=0.5, advantage="recompute", capacity=16)
    buf = make_replay(cfg, max_len=MAX_LEN, pad_id=PAD, seed=0)
    # prompt 7: rewards 1, 0; prompt 8: rewards 1, 0 (not in the fresh batch); stored priority |±0.5| + 1e-3
    push(buf, rollouts(4, prompt_idx=[7, 7, 8, 8], reward=[1, 0, 1, 0], advantage=[0.5, -0.5, 0.5, -0.5]), 0)
    assert buf.score[:4].tolist() == pytest.approx([0.501] * 4)
    fresh = rollouts(4, prompt_idx=7, group=100, reward=[0, 0, 0, 1], advantage=[-0.5, -0.5, -0.5, 1.5], born=1, seed=1)
    batch = buf.sample(fresh, 1)  # k = round(0.5 · 4) = 2 draws
    again = replayed(batch)
    assert len(again) == 2 and (again.slot >= 0).all() and (batch.slot[:4] == -1).all()
    before = buf.score.clone()
    push(buf, batch, 1)
    # recomputed advantages (unbiased std + 1e-6): reward 1 joining [0,0,0,1] → 0.6 / sqrt(0.3); reward 0 → -0.2 / sqrt(0.2);
    # prompt 8 against its stored rewards [1, 0] → ±0.5 / sqrt(0.5)
    new = {(7, 1.0): 0.6 / (math.sqrt(0.3) + 1e-6), (7, 0.0): 0.2 / (math.sqrt(0.2) + 1e-6),
           (8, 1.0): 0.5 / (math.sqrt(0.5) + 1e-6), (8, 0.0): 0.5 / (math.sqrt(0.5) + 1e-6)}  # fmt: skip
    for s, p, r in zip(again.slot.tolist(), again.prompt_idx.tolist(), again.reward.tolist()):
        assert buf.score[s].item() == pytest.approx(new[(p, r)] + 1e-3, rel=1e-5)
    changed = (buf.score[:4] != before[:4]).nonzero().squeeze(1).tolist()
    assert changed == sorted(set(again.slot.tolist()))  # exactly the replayed slots, no other stored row
    assert buf.score[4:8].tolist() == pytest.approx([0.501, 0.501, 0.501, 1.501])  # the fresh rows, stored after
    assert buf.metrics()["replay/rescored"] == float(len(changed))


def test_custom_strategy_runs_through_train(per_feedback, tmp_path, monkeypatch):
    if not (REPO / "data" / "tiny_model" / "config.json").exists():
        pytest.skip("data/tiny_model not built (python -m data.build_tiny_model)")
    import train
    from config import load_config, validate

    monkeypatch.chdir(REPO)  # configs/tiny.yaml names data/tiny_model relative to the repository
    cfg = load_config("configs/tiny.yaml", [
        "--replay.strategy=per_feedback", "--max_steps=3", "--rollout.batch_size=32", "--rollout.group_size=4",
        "--eval.n=8", "--eval.k=1", "--checkpoint.every=0", "--wandb.mode=disabled", "--threads=1",
        f"--out_dir={tmp_path / 'run'}", "--replay.advantage=recompute"])  # fmt: skip
    validate(cfg)
    handlers, threads = (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)), torch.get_num_threads()
    try:  # train() installs its own signal handlers and thread count: give them back to pytest
        assert train.train(cfg) == 0
    finally:
        signal.signal(signal.SIGTERM, handlers[0]), signal.signal(signal.SIGINT, handlers[1])
        torch.set_num_threads(threads)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[0]["replay/rows"] == 0 and rows[0]["replay/rescored"] == 0.0  # nothing stored before the first push
    assert any(r["replay/rows"] > 0 for r in rows) and any(r["replay/rescored"] > 0 for r in rows)
    assert all(r["replay/rescored"] <= r["replay/rows"] for r in rows)
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["strategy"] == "per_feedback"


def test_registered_only_while_its_tests_run():
    assert "per_feedback" not in STRATEGIES
