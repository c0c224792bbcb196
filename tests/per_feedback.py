"""A replay strategy defined outside replay.py, as README's "How to add a replay strategy" shows:
python train.py --config configs/tiny.yaml --replay.module=per_feedback
    --replay.strategy=per_feedback
(with this folder on PYTHONPATH). tests/test_replay_custom.py tests it and trains with it."""

import torch

from replay import Replay
from batch import Rollouts


class PerFeedbackReplay(Replay):
    """per_feedback: fresh rows are stored with priority |A| + priority_eps; each update batch adds
    k = round(ratio · n_fresh) rows drawn with replacement ∝ priority; after the update, every
    replayed row's priority becomes |A| + priority_eps of its advantage in that batch (new with
    replay.advantage=recompute), as prioritized experience replay updates the priorities of the
    transitions it just learned from."""

    name = "per_feedback"
    METRICS = ("rescored",)

    @staticmethod
    def check(cfg):
        share = "in [0, 4] for per_feedback (replayed rows per fresh row)"
        return {"ratio": (0 <= cfg.ratio <= 4, share),
                "priority_eps": (0 < cfg.priority_eps < 1e6, "> 0")}

    def sample(self, fresh, step):
        k = min(round(self.cfg.ratio * len(fresh)), len(self))
        weight = torch.where(self.valid, self.score, 0.0)  # (C,)
        slots = self.stored()[:0]
        if k:
            slots = torch.multinomial(weight, k, replacement=True, generator=self.gen)
        return Rollouts.cat([fresh, self.read(slots, fresh)], self.pad_id)

    def push(self, batch, step, entropy):
        again = batch.select(batch.replayed)  # feedback first: the write may reuse these slots
        self.score[again.slot] = again.advantage.abs() + self.cfg.priority_eps
        fresh = batch.select(~batch.replayed)
        self.write(fresh, fresh.advantage.abs() + self.cfg.priority_eps)
        self.last["rescored"] = float(len(torch.unique(again.slot)))
