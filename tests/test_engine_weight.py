"""grpo.engine_is_cap (grpo.py, departure 12): fresh rows an inference engine sampled get the
truncated importance weight min(π_prox/μ, C), detached; other rows and the default (0 = off) are
untouched. Hand values."""

import math

import pytest
import torch

from grpo import GRPOConfig, engine_rows, policy_loss
from batch import Rollouts


def loss_and_grad(cap: float, rows):
    # row 0: log π − log μ = ln 1.5 and ln 3 on its two tokens, A = +1; row 1: π = μ, A = −1
    logp = torch.tensor(
        [[0.0, math.log(1.5), math.log(3.0)], [0.0, -1.0, -2.0]], requires_grad=True
    )
    behav = torch.tensor([[0.0, 0.0, 0.0], [0.0, -1.0, -2.0]])
    mask = torch.tensor([[False, True, True], [False, True, True]])
    loss, metrics = policy_loss(
        logp,
        behav,
        torch.tensor([1.0, -1.0]),
        mask,
        torch.ones(2, dtype=torch.bool),
        GRPOConfig(engine_is_cap=cap),
        n_seqs=2,
        n_tokens=4,
        max_new_tokens=2,
        engine_rows=rows,
    )
    loss.backward()
    return loss.item(), logp.grad, metrics


def test_engine_rows_get_the_truncated_weight():
    loss, grad, metrics = loss_and_grad(2.0, torch.tensor([True, False]))
    # row 0: weights min(1.5, 2) and min(3, 2) = 2, each times −A·r = −1; row 1: 1 × +1 per token
    assert loss == pytest.approx((-1.5 - 2.0 + 1.0 + 1.0) / 4)
    assert grad[0, 1:].tolist() == pytest.approx(
        [-1.5 / 4, -2.0 / 4]
    )  # the weight is not differentiated
    assert grad[1, 1:].tolist() == pytest.approx([0.25, 0.25])
    assert metrics["engine_is_weight_mean"].item() == pytest.approx(
        1.5 + 2.0 + 1.0 + 1.0
    )  # a token sum


@pytest.mark.parametrize(
    "cap, rows", [(0.0, torch.tensor([True, False])), (2.0, None)], ids=["off", "hf"]
)
def test_off_by_default_and_without_an_engine(cap, rows):
    loss, grad, metrics = loss_and_grad(cap, rows)
    assert loss == pytest.approx(0.0) and "engine_is_weight_mean" not in metrics
    assert grad[0, 1:].tolist() == pytest.approx([-0.25, -0.25])


def test_only_fresh_rows_count_as_the_engines():
    rows = Rollouts.empty(3, 4, 0)
    rows.replayed = torch.tensor([False, True, False])
    assert engine_rows("vllm", rows, torch.device("cpu")).tolist() == [True, False, True]
    assert engine_rows("hf", rows, torch.device("cpu")) is None
