"""Unit tests for grpo.py: hand-computed values on tiny float64 tensors, plus exactness properties
(on-policy gradient, padding invariance, micro-batch accumulation)."""

import math
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from config import ConfigError, load_config, validate
from grpo import (
    GRPOConfig,
    group_advantages,
    group_stats,
    policy_loss,
)
from support.logprobs import token_logprobs

F64 = torch.float64
AGGS = ("grpo", "dapo", "dr_grpo")
MODES = ("behaviour", "decoupled")
pytestmark = pytest.mark.fast  # every test here, in the fast tier (docs/testing.md)


def t(x, **kw):
    return torch.tensor(x, dtype=F64, **kw)


def leaf(x):
    return t(x, requires_grad=True)


# ---------------------------------------------------------------- advantages

# Groups 7 (rows 0, 2, 4), 3 (rows 1, 3) and 9 (rows 5, 6, all equal): not adjacent, ids not
# contiguous.
REWARDS = [1.0, 0.0, 0.0, 1.0, 0.0, 2.0, 2.0]
GROUPS = [7, 3, 7, 3, 7, 9, 9]


def test_group_advantages_group_scale():
    r, g = t(REWARDS), torch.tensor(GROUPS)
    r0, g0 = r.clone(), g.clone()
    adv, metrics = group_advantages(r, g, scale="group", eps=0.0)
    # group 7: mean 1/3, unbiased std sqrt(1/3); group 3: mean 1/2, std sqrt(1/2);
    # group 9: zero variance
    expected = [1.1547005383792515, -0.7071067811865475, -0.5773502691896257, 0.7071067811865475,
                -0.5773502691896257, 0.0, 0.0]
    torch.testing.assert_close(adv, t(expected), rtol=0, atol=1e-12)
    assert metrics["adv/zero_std_frac"] == pytest.approx(1 / 3)
    assert metrics["adv/groups"] == 3
    assert torch.equal(r, r0) and torch.equal(g, g0)  # inputs untouched


def test_group_advantages_eps_in_denominator():
    adv, _ = group_advantages(t([0.0, 1.0]), torch.tensor([0, 0]), scale="group", eps=0.5)
    # std = sqrt(1/2) = 0.70710678; A = ±0.5 / (0.70710678 + 0.5)
    torch.testing.assert_close(adv, t([-0.41421356237309503, 0.41421356237309503]),
                               rtol=0, atol=1e-12)


def test_group_advantages_batch_scale():
    adv, _ = group_advantages(t(REWARDS), torch.tensor(GROUPS), scale="batch", eps=0.0)
    # centred rewards 2/3, -1/2, -1/3, 1/2, -1/3, 0, 0; their unbiased std over the 7 rows is
    # sqrt(7)/6 = 0.440958552
    expected = [1.5118578920369088, -1.1338934190276817, -0.7559289460184544, 1.1338934190276817,
                -0.7559289460184544, 0.0, 0.0]
    torch.testing.assert_close(adv, t(expected), rtol=0, atol=1e-12)


def test_group_advantages_no_scale():
    adv, _ = group_advantages(t(REWARDS), torch.tensor(GROUPS), scale="none")
    torch.testing.assert_close(adv, t([2 / 3, -0.5, -1 / 3, 0.5, -1 / 3, 0.0, 0.0]),
                               rtol=0, atol=1e-12)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_zero_variance_groups_get_exactly_zero(scale):
    # 0.1 summed three times is not 0.3, so the group mean differs from 0.1 by round-off; with
    # eps = 0 a naive (r - mean) / std would be ±1 or NaN here. The single-row group 5 is
    # zero-variance too.
    r = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 3.0], dtype=torch.float32)
    adv, metrics = group_advantages(r, torch.tensor([2, 2, 2, 4, 4, 5]), scale=scale, eps=0.0)
    assert adv.dtype == torch.float32
    assert adv[[0, 1, 2, 5]].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert adv[3] > 0 > adv[4]
    assert metrics["adv/zero_std_frac"] == pytest.approx(2 / 3)


def test_group_stats_hand_computed():
    s = group_stats(t(REWARDS), torch.tensor(GROUPS))  # groups 3 (rows 1, 3), 7 (0, 2, 4), 9 (5, 6)
    assert s.ids.tolist() == [3, 7, 9] and s.index.tolist() == [1, 0, 1, 0, 1, 2, 2]
    assert s.count.tolist() == [2, 3, 2] and s.total.tolist() == [1, 1, 4]
    torch.testing.assert_close(s.mean, t([0.5, 1 / 3, 2.0]), rtol=0, atol=1e-15)
    torch.testing.assert_close(s.std, t([0.5**0.5, (1 / 3) ** 0.5, 0.0]), rtol=0, atol=1e-15)
    assert s.flat.tolist() == [False, False, True]
    # round-off in the mean: std > 0
    one = group_stats(t([0.1, 0.1, 0.1, 4.0]), torch.tensor([0, 0, 0, 1]))
    assert one.flat.tolist() == [True, True] and one.std[0] > 0 and one.std[1] == 0


# ---------------------------------------------------------------- token log-probs


class Bigram(torch.nn.Module):
    """logits[b, t] = table[tokens[b, t]]: known logits for hand-computed log-probs (a one-hot
    hidden state read out by an output layer whose weight is the table's transpose, as
    token_logprobs needs an output layer)."""

    def __init__(self, table):
        super().__init__()
        self.head = torch.nn.Linear(table.shape[0], table.shape[1], bias=False, dtype=table.dtype)
        with torch.no_grad():
            self.head.weight.copy_(table.T)

    def get_output_embeddings(self):
        return self.head

    def forward(self, input_ids, attention_mask):
        V = self.head.in_features
        hidden = torch.nn.functional.one_hot(input_ids, V).to(self.head.weight.dtype)
        return SimpleNamespace(logits=self.head(hidden))


class TinyLM(torch.nn.Module):
    """A causal toy LM in float64: position t sees the running mean of the embeddings up to t."""

    def __init__(self, V=7, D=5, seed=0, noise=0.0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.nn.Parameter(torch.randn(V, D, generator=g, dtype=F64))
        self.out = torch.nn.Linear(D, V, bias=True, dtype=F64)
        with torch.no_grad():
            self.out.weight.copy_(torch.randn(V, D, generator=g, dtype=F64))
            self.out.bias.copy_(torch.randn(V, generator=g, dtype=F64))
        if noise:  # a nearby policy, e.g. the weights before the last optimizer step
            with torch.no_grad():
                for p in self.parameters():
                    p.add_(noise * torch.randn(p.shape, generator=g, dtype=F64))

    def get_output_embeddings(self):
        return self.out

    def forward(self, input_ids, attention_mask):
        h = self.emb[input_ids] * attention_mask[..., None]
        h = h.cumsum(1) / torch.arange(1, input_ids.shape[1] + 1, dtype=F64)[:, None]
        return SimpleNamespace(logits=self.out(torch.tanh(h)))


BIGRAM = torch.log(t([[0.5, 0.25, 0.25], [0.1, 0.2, 0.7], [1 / 3, 1 / 3, 1 / 3]]))


def test_token_logprobs_hand_values_with_temperature():
    model = Bigram(BIGRAM.clone())
    tokens, am = torch.tensor([[0, 1, 2, 0]]), torch.tensor([[1, 1, 1, 0]])
    logp, ent = token_logprobs(model, tokens, am, temperature=1.0)
    torch.testing.assert_close(logp, t([[0.0, math.log(0.25), math.log(0.7), 0.0]]),
                               rtol=0, atol=1e-12)
    assert ent is None
    # T = 2 turns probabilities p into sqrt(p) / sum(sqrt(p)): [0.41421, 0.29289, 0.29289] and
    # [0.19763, 0.27949, 0.52288]
    logp, ent = token_logprobs(model, tokens, am, temperature=2.0, with_entropy=True)
    torch.testing.assert_close(logp, t([[0.0, -1.2279471772995156, -0.6484044667392591, 0.0]]),
                               rtol=0, atol=1e-12)
    torch.testing.assert_close(ent, t([[0.0, 1.0843916958452147, 1.0157572668600388, 0.0]]),
                               rtol=0, atol=1e-12)
    assert logp.requires_grad and not ent.requires_grad  # entropy is measured, never differentiated


def test_token_logprobs_matches_manual_log_softmax():
    model = TinyLM()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 7, (3, 6), generator=g)
    am = (torch.arange(6)[None] < torch.tensor([[6], [4], [2]])).long()
    logp, ent = token_logprobs(model, tokens, am, temperature=0.7, with_entropy=True)
    with torch.no_grad():
        lsm = torch.log_softmax(model(tokens, am).logits / 0.7, dim=-1)  # (B, L, V)
    for b in range(3):
        for i in range(6):
            valid = 0 < i and am[b, i] == 1
            exp_logp = lsm[b, i - 1, tokens[b, i]] if valid else 0.0
            exp_ent = -(lsm[b, i - 1].exp() * lsm[b, i - 1]).sum() if valid else 0.0
            assert logp[b, i].item() == pytest.approx(float(exp_logp), abs=1e-12)
            assert ent[b, i].item() == pytest.approx(float(exp_ent), abs=1e-12)


def make_batch(B=6, L=9, seed=0):
    """Right-padded rows `prompt | completion | pad` of different lengths, as rollout.py builds
    them."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 7, (B, L), generator=g)
    prompt_len = torch.tensor([2, 3, 2, 2, 3, 2])[:B]
    seq_len = torch.tensor([9, 5, 7, 4, 8, 6])[:B]
    pos = torch.arange(L)[None]
    am = (pos < seq_len[:, None]).long()
    tokens = torch.where(am.bool(), tokens, 0)
    mask = (pos >= prompt_len[:, None]) & (pos < seq_len[:, None])
    return tokens, am, mask, g


# ---------------------------------------------------------------- policy loss: hand values


def run(cfg, logp, behav, adv, mask, onpolicy, *, n_seqs=None, n_tokens=None, max_new_tokens=4,
        **kw):
    """policy_loss with totals defaulting to this batch; returns loss, d loss / d logp and
    metrics."""
    mask = torch.tensor(mask)
    n_seqs = len(adv) if n_seqs is None else n_seqs
    n_tokens = int(mask.sum()) if n_tokens is None else n_tokens
    loss, metrics = policy_loss(logp, behav, t(adv), mask, torch.tensor(onpolicy), cfg,
                                n_seqs=n_seqs, n_tokens=n_tokens, max_new_tokens=max_new_tokens,
                                **kw)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.item(), grad, metrics


@pytest.mark.parametrize(
    "agg, loss, g0, g1",
    [
        ("grpo", -0.25, -0.25, 0.5 / 3 / 2),  # (-1·2/2 + 0.5·3/3) / 2 seqs
        ("dapo", -0.1, -0.2, 0.1),  # (-1·2 + 0.5·3) / 5 tokens
        ("dr_grpo", -0.0625, -0.125, 0.0625),  # (-2 + 1.5) / (2 seqs · 4 max_new_tokens)
    ],
)
def test_aggregations(agg, loss, g0, g1):
    # on-policy (ratio 1): per-token loss is -A. Row 0: A = 1, 2 tokens; row 1: A = -0.5, 3 tokens.
    mask = [[False, True, True, False], [False, True, True, True]]
    logp = leaf([[0.0, -1.0, -2.0, 0.0], [0.0, -0.5, -0.3, -0.2]])
    got, grad, m = run(GRPOConfig(loss_agg=agg), logp, torch.zeros(2, 4, dtype=F64), [1.0, -0.5],
                       mask, [True, True])
    assert got == pytest.approx(loss, abs=1e-12)
    torch.testing.assert_close(grad, t([[0.0, g0, g0, 0.0], [0.0, g1, g1, g1]]), rtol=0, atol=1e-12)
    assert m["tokens"] == 5 and m["clip_low"] == m["clip_high"] == 0


# Four replayed rows of one completion token each, behaviour log-prob 0 (μ = 1), so ratio = π:
#   row 0: A = -1, ratio 0.5 -> low clip active,  loss max(0.5, 0.8) = 0.8,     grad 0
#   row 1: A = -1, ratio 1.5 -> not clipped,       loss max(1.5, 1.28) = 1.5,   grad -A·ratio = 1.5
#   row 2: A = +1, ratio 1.5 -> high clip active,  loss max(-1.5, -1.28) = -1.28, grad 0
#   row 3: A = +1, ratio 0.5 -> not clipped,       loss max(-0.5, -0.8) = -0.5,  grad -0.5
CLIP_LOGP = [[0.0, math.log(0.5)], [0.0, math.log(1.5)], [0.0, math.log(1.5)], [0.0, math.log(0.5)]]
CLIP_ADV = [-1.0, -1.0, 1.0, 1.0]
ONE_TOKEN = [[False, True]] * 4


def test_clip_low_and_high():
    logp = leaf(CLIP_LOGP)
    loss, grad, m = run(GRPOConfig(loss_agg="dapo"), logp, torch.zeros(4, 2, dtype=F64), CLIP_ADV,
                        ONE_TOKEN, [False] * 4)
    assert loss == pytest.approx(0.13, abs=1e-12)  # (0.8 + 1.5 - 1.28 - 0.5) / 4
    torch.testing.assert_close(grad[:, 1], t([0.0, 0.375, 0.0, -0.125]), rtol=0, atol=1e-12)
    assert m["clip_low"] == 1 and m["clip_high"] == 1 and m["clip_dual"] == 0
    # 2·(0.5 - ln 1.5) + 2·(-0.5 + ln 2)
    assert m["approx_kl"] == pytest.approx(0.5753641449035618, abs=1e-12)
    assert m["is_weight_min"] == pytest.approx(0.5) and m["is_weight_max"] == pytest.approx(1.5)


def test_symmetric_clip():
    logp = leaf(CLIP_LOGP)
    cfg = GRPOConfig(loss_agg="dapo", eps_low=0.2, eps_high=0.2)
    loss, _, _ = run(cfg, logp, torch.zeros(4, 2, dtype=F64), CLIP_ADV, ONE_TOKEN, [False] * 4)
    assert loss == pytest.approx(0.15, abs=1e-12)  # (0.8 + 1.5 - 1.2 - 0.5) / 4


def test_dual_clip():
    # A = -1 with ratio 5: max(5, 1.28) = 5 is bounded at c·|A| = 3, grad 0. A = -1 with ratio 2:
    # 2 < 3, untouched, grad 2. A = +1 with ratio 5: dual clip never applies to positive advantages,
    # high clip gives -1.28.
    logp = leaf([[0.0, math.log(5.0)], [0.0, math.log(2.0)], [0.0, math.log(5.0)]])
    behav, mask = torch.zeros(3, 2, dtype=F64), [[False, True]] * 3
    loss, grad, m = run(GRPOConfig(loss_agg="dapo", dual_clip=3.0), logp, behav, [-1.0, -1.0, 1.0],
                        mask, [False] * 3)
    assert loss == pytest.approx(1.24, abs=1e-12)  # (3 + 2 - 1.28) / 3
    torch.testing.assert_close(grad[:, 1], t([0.0, 2 / 3, 0.0]), rtol=0, atol=1e-12)
    assert m["clip_dual"] == 1 and m["clip_high"] == 1
    loss_off, _, _ = run(GRPOConfig(loss_agg="dapo"), leaf(logp.detach().tolist()), behav,
                         [-1.0, -1.0, 1.0], mask, [False] * 3)
    assert loss_off == pytest.approx(1.9066666666666667, abs=1e-12)  # (5 + 2 - 1.28) / 3 without it


def test_k3_kl():
    # A = 0, so only the KL term: d = ln 0.25 - ln 0.5 = -ln 2, exp(d) - d - 1 = 0.5 + ln 2 - 1 =
    # 0.19314718; second token has ref = logp, KL 0. d/dlogp of the k3 term is 1 - exp(d) = 0.5.
    logp = leaf([[0.0, math.log(0.5), math.log(0.5)]])
    ref = t([[0.0, math.log(0.25), math.log(0.5)]])
    cfg = GRPOConfig(loss_agg="dapo", beta=0.1)
    loss, grad, m = run(cfg, logp, logp.detach(), [0.0], [[False, True, True]], [True],
                        ref_logp=ref)
    assert loss == pytest.approx(0.00965735902799727, abs=1e-12)  # 0.1 · 0.19314718 / 2
    torch.testing.assert_close(grad, t([[0.0, 0.025, 0.0]]), rtol=0, atol=1e-12)
    assert m["kl_ref"] == pytest.approx(0.1931471805599454, abs=1e-12)
    with pytest.raises(ValueError, match="ref_logp"):
        run(cfg, logp, logp.detach(), [0.0], [[False, True, True]], [True])


def test_decoupled_weights_truncation_and_onpolicy_rows():
    # logp = prox (ratio 1). Row 0: π_prox/μ = 0.6/0.4 = 1.5. Row 1: 0.9/0.3 = 3, truncated at
    # C = 2. Row 2 is on-policy: its μ (0.1) is ignored and the weight is exactly 1, although
    # π_prox/μ would be 5.
    prox = t([[0.0, math.log(0.6)], [0.0, math.log(0.9)], [0.0, math.log(0.5)]])
    behav = t([[0.0, math.log(0.4)], [0.0, math.log(0.3)], [0.0, math.log(0.1)]])
    logp = leaf(prox.tolist())
    cfg = GRPOConfig(loss_agg="dapo", offpolicy="decoupled", is_cap=2.0)
    loss, grad, m = run(cfg, logp, behav, [1.0, 1.0, -1.0], [[False, True]] * 3,
                        [False, False, True], prox_logp=prox)
    assert loss == pytest.approx(-2.5 / 3, abs=1e-12)  # (-1.5 - 2 + 1) / 3
    torch.testing.assert_close(grad[:, 1], t([-0.5, -2 / 3, 1 / 3]), rtol=0, atol=1e-12)
    assert m["is_capped"] == 1
    assert m["is_weight_min"] == 1.0  # the on-policy row, exactly
    assert m["is_weight_max"] == pytest.approx(3.0, abs=1e-12)  # reported before truncation
    # a token sum: / tokens once added up
    assert m["is_weight_mean"] == pytest.approx(5.5, abs=1e-12)


def test_replayed_row_clipped_against_mu_or_prox():
    # Replayed row: current π = 0.63, π_prox = 0.6, stored μ = 0.4, A = 1.
    prox, behav = t([[0.0, math.log(0.6)]]), t([[0.0, math.log(0.4)]])
    logp = leaf([[0.0, math.log(0.63)]])
    # behaviour: ratio π/μ = 1.575 > 1.28 -> clipped, loss -1.28, no gradient
    loss, grad, m = run(GRPOConfig(loss_agg="dapo"), logp, behav, [1.0], [[False, True]], [False],
                        prox_logp=prox)
    assert loss == pytest.approx(-1.28, abs=1e-12) and grad[0, 1] == 0 and m["clip_high"] == 1
    assert m["is_weight_max"] == pytest.approx(1.5, abs=1e-12)
    # decoupled: ratio π/π_prox = 1.05 is inside the trust region, weight 1.5 -> loss -1.575,
    # grad -1.575
    cfg = GRPOConfig(loss_agg="dapo", offpolicy="decoupled")
    loss, grad, m = run(cfg, logp, behav, [1.0], [[False, True]], [False], prox_logp=prox)
    assert (loss == pytest.approx(-1.575, abs=1e-12)
            and grad[0, 1].item() == pytest.approx(-1.575, abs=1e-12))
    assert m["clip_high"] == 0 and m["is_capped"] == 0
    # the same row flagged on-policy: its μ is ignored in both modes -> ratio π/π_prox = 1.05,
    # weight 1, loss -1.05
    for mode in MODES:
        loss, _, m = run(GRPOConfig(loss_agg="dapo", offpolicy=mode), logp, behav, [1.0],
                         [[False, True]], [True], prox_logp=prox)
        assert loss == pytest.approx(-1.05, abs=1e-12) and m["is_weight_max"] == 1.0


def test_onpolicy_behaviour_mode_ignores_stored_mu():
    # μ differs from the training forward (here by a lot, really by KV-cache numerics): an on-policy
    # row still has ratio exactly 1 in behaviour mode, while a replayed row with the same numbers is
    # clipped.
    logp, behav = leaf([[0.0, math.log(0.5)]] * 2), t([[0.0, math.log(0.1)]] * 2)
    loss, grad, m = run(GRPOConfig(loss_agg="dapo"), logp, behav, [1.0, 1.0], [[False, True]] * 2,
                        [True, False])
    assert loss == pytest.approx((-1.0 - 1.28) / 2, abs=1e-12)
    torch.testing.assert_close(grad[:, 1], t([-0.5, 0.0]), rtol=0, atol=1e-12)
    assert m["clip_high"] == 1 and m["approx_kl"] == pytest.approx(5 - 1 - math.log(5), abs=1e-12)


def test_unknown_keys_raise():
    # policy_loss trusts its settings: config.validate rejects them once, before the run
    for key, value in (("loss_agg", "mean"), ("offpolicy", "vtrace")):
        with pytest.raises(ConfigError, match=f"grpo.{key} must be"):
            validate(load_config(None, [f"--grpo.{key}={value}"]))
    with pytest.raises(ValueError):
        group_advantages(t([1.0, 0.0]), torch.tensor([0, 0]), scale="global")


# ---------------------------------------------------------------- policy loss: exactness properties


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("mode", MODES)
def test_onpolicy_gradient_is_plain_policy_gradient(agg, mode):
    model = TinyLM()
    tokens, am, mask, g = make_batch()
    adv = torch.randn(6, generator=g, dtype=F64)
    behav = torch.randn(tokens.shape, generator=g, dtype=F64)  # stored μ, ignored on on-policy rows
    cfg = GRPOConfig(loss_agg=agg, offpolicy=mode, dual_clip=3.0)
    n_seqs, n_tokens, max_new = 6, int(mask.sum()), 8

    logp, _ = token_logprobs(model, tokens, am, temperature=0.9)
    loss, m = policy_loss(logp, behav, adv, mask, torch.ones(6, dtype=torch.bool), cfg,
                          n_seqs=n_seqs, n_tokens=n_tokens, max_new_tokens=max_new)
    grads = torch.autograd.grad(loss, list(model.parameters()))

    # REINFORCE surrogate -A·log π, with each aggregation's normaliser written per token
    logp, _ = token_logprobs(model, tokens, am, temperature=0.9)
    per_seq = {"grpo": mask.sum(1, keepdim=True) * n_seqs, "dapo": n_tokens,
               "dr_grpo": n_seqs * max_new}[agg]
    surrogate = (-adv[:, None] * logp * mask / per_seq).sum()
    expected = torch.autograd.grad(surrogate, list(model.parameters()))
    for a, b in zip(grads, expected):
        assert b.abs().max() > 1e-3
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    # ratio 1
    assert loss.item() == pytest.approx(-(adv[:, None] * mask / per_seq).sum().item(), abs=1e-12)
    assert m["is_weight_min"] == m["is_weight_max"] == 1.0 and m["approx_kl"] == 0.0


def random_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    B, L = 3, 5
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1], [0, 1, 0, 0, 0]], dtype=torch.bool)
    prox = -torch.rand(B, L, generator=g, dtype=F64) * 2
    x = {
        "logp": prox + 0.4 * torch.randn(B, L, generator=g, dtype=F64),
        "behav_logp": prox + 0.8 * torch.randn(B, L, generator=g, dtype=F64),
        "prox_logp": prox,
        "ref_logp": prox + 0.3 * torch.randn(B, L, generator=g, dtype=F64),
        "entropy": torch.rand(B, L, generator=g, dtype=F64),
    }
    x = {k: torch.where(mask, v, 0.0) for k, v in x.items()}
    return x, torch.tensor([-1.5, -0.7, 2.0], dtype=F64), mask, torch.tensor([False, True, False])


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("mode", MODES)
def test_padding_never_changes_the_loss(agg, mode):
    x, adv, mask, onpolicy = random_inputs()
    cfg = GRPOConfig(loss_agg=agg, offpolicy=mode, dual_clip=1.5, beta=0.05, is_cap=1.45)
    kw = {"n_seqs": 3, "n_tokens": int(mask.sum()), "max_new_tokens": 6}

    logp = x["logp"].clone().requires_grad_()
    loss, m = policy_loss(logp, x["behav_logp"], adv, mask, onpolicy, cfg,
                          prox_logp=x["prox_logp"], ref_logp=x["ref_logp"], entropy=x["entropy"],
                          **kw)
    (grad,) = torch.autograd.grad(loss, logp)
    assert (m["clip_low"] + m["clip_high"] > 0
            and m["clip_dual"] > 0
            and m["is_capped"] == (mode == "decoupled"))  # all paths exercised

    # Garbage in every masked slot of the original rows, plus 2 pad columns and 1 pad row, all
    # garbage.
    garbage = [math.nan, math.inf, -math.inf, 1e4, -1e4]
    padded_mask = torch.nn.functional.pad(mask, (0, 2, 0, 1))
    fill = t(garbage * 6)[: 4 * 7].reshape(4, 7)

    def pad(v):
        return torch.where(padded_mask, torch.nn.functional.pad(v, (0, 2, 0, 1)), fill)

    p = {k: pad(v) for k, v in x.items()}
    logp_p = p["logp"].clone().requires_grad_()
    adv_p, onpolicy_p = (torch.cat([adv, t([math.nan])]),
                         torch.cat([onpolicy, torch.tensor([False])]))
    loss_p, m_p = policy_loss(logp_p, p["behav_logp"], adv_p, padded_mask, onpolicy_p, cfg,
                              prox_logp=p["prox_logp"], ref_logp=p["ref_logp"],
                              entropy=p["entropy"], **kw)
    (grad_p,) = torch.autograd.grad(loss_p, logp_p)

    assert loss_p.item() == pytest.approx(loss.item(), abs=1e-12)
    torch.testing.assert_close(grad_p, torch.nn.functional.pad(grad, (0, 2, 0, 1)),
                               rtol=0, atol=1e-12)  # 0 on padding
    assert torch.isfinite(grad_p).all()
    assert {k: float(v) for k, v in m_p.items()} == pytest.approx(
        {k: float(v) for k, v in m.items()})


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("mode", MODES)
def test_microbatch_accumulation_equals_one_batch(agg, mode):
    model, old = TinyLM(), TinyLM(noise=0.3)  # old: the weights at the start of the step (π_prox)
    ref = TinyLM(noise=0.2)
    tokens, am, mask, g = make_batch()
    T = 0.9
    with torch.no_grad():
        prox, _ = token_logprobs(old, tokens, am, T)
        ref_logp, _ = token_logprobs(ref, tokens, am, T)
    behav = torch.where(mask, prox + 0.5 * torch.randn(tokens.shape, generator=g, dtype=F64), 0.0)
    adv = torch.randn(6, generator=g, dtype=F64)
    onpolicy = torch.tensor([True, False, False, True, False, False])
    cfg = GRPOConfig(loss_agg=agg, offpolicy=mode, dual_clip=2.5, beta=0.1)
    kw = {"n_seqs": 6, "n_tokens": int(mask.sum()), "max_new_tokens": 8}

    logp, ent = token_logprobs(model, tokens, am, T, with_entropy=True)
    loss, m = policy_loss(logp, behav, adv, mask, onpolicy, cfg, prox_logp=prox, ref_logp=ref_logp,
                          entropy=ent, **kw)
    full = torch.autograd.grad(loss, list(model.parameters()))
    # the clip and the weights are exercised
    assert m["clip_low"] + m["clip_high"] > 0 and m["is_weight_max"] > 1.5

    model.zero_grad()
    total, parts = 0.0, []
    for rows in (slice(0, 2), slice(2, 3), slice(3, 6)):
        n = int(am[rows].sum(1).max())  # each micro-batch trimmed to its longest row
        lp, e = token_logprobs(model, tokens[rows, :n], am[rows, :n], T, with_entropy=True)
        part, pm = policy_loss(lp, behav[rows, :n], adv[rows], mask[rows, :n], onpolicy[rows], cfg,
                               prox_logp=prox[rows, :n], ref_logp=ref_logp[rows, :n], entropy=e,
                               **kw)
        part.backward()
        total += part.item()
        parts.append(pm)
    for a, p in zip(full, model.parameters()):
        torch.testing.assert_close(p.grad, a, rtol=0, atol=1e-6)
        assert (p.grad - a).abs().max() < 1e-12
    assert total == pytest.approx(loss.item(), abs=1e-12)
    for k in m:  # every metric adds up over micro-batches, but the importance-weight extremes
        added = max(pm[k] for pm in parts) if k == "is_weight_max" else min(pm[k] for pm in parts) \
            if k == "is_weight_min" else sum(pm[k] for pm in parts)
        assert float(added) == pytest.approx(float(m[k]), abs=1e-12), k


def test_policy_loss_does_not_mutate_inputs():
    x, adv, mask, onpolicy = random_inputs(seed=3)
    x["logp"] = x["logp"].clone().requires_grad_()
    before = {k: v.detach().clone() for k, v in x.items()}
    cfg = replace(GRPOConfig(), offpolicy="decoupled", beta=0.1, dual_clip=2.0)
    loss, _ = policy_loss(x["logp"], x["behav_logp"], adv, mask, onpolicy, cfg, n_seqs=3,
                          n_tokens=6, max_new_tokens=4, prox_logp=x["prox_logp"],
                          ref_logp=x["ref_logp"], entropy=x["entropy"])
    loss.backward()
    for k, v in x.items():
        assert torch.equal(v.detach(), before[k])
