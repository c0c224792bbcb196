"""Unit tests for replay.py: what each strategy stores and draws, staleness and capacity bounds, the priority law
(a chi-square test at a fixed seed), hand-computed recomputed advantages, and exact resume via state_dict."""

import io
import math
from dataclasses import fields

import pytest
import torch

from replay import ReplayConfig, make_replay
from rollout import Rollouts

PAD, MAX_LEN = 0, 16
CHI2_7DF_P001 = 24.322  # chi-square critical value, 7 degrees of freedom, p = 0.001


def rollouts(n, *, prompt_idx=None, group=None, born=0, reward=None, advantage=None, correct=None, entropy=None, L=12, seed=0):
    """n rows `prompt (3 tokens) | completion | pad`, with distinct random tokens and behaviour log-probs."""
    g = torch.Generator().manual_seed(seed)
    seq_len = torch.randint(5, L + 1, (n,), generator=g)
    prompt_len = torch.full((n,), 3)
    t = torch.arange(L)[None, :]
    tokens = torch.where(t < seq_len[:, None], torch.randint(1, 50_000, (n, L), generator=g), PAD)
    completion = (t >= prompt_len[:, None]) & (t < seq_len[:, None])
    ones, zeros = torch.ones(n), torch.zeros(n)

    def col(x, default, dtype):
        return torch.as_tensor(default if x is None else x, dtype=dtype).expand(n).clone()

    return Rollouts(
        tokens=tokens, prompt_len=prompt_len, seq_len=seq_len,
        behav_logp=torch.where(completion, -torch.rand(n, L, generator=g), 0.0),
        truncated=torch.zeros(n, dtype=torch.bool),
        prompt_idx=col(prompt_idx, torch.arange(n), torch.int64), group=col(group, torch.arange(n), torch.int64),
        born=col(born, 0, torch.int64), reward=col(reward, ones, torch.float32), correct=col(correct, True, torch.bool),
        advantage=col(advantage, ones, torch.float32), entropy=col(entropy, zeros, torch.float32),
        replayed=torch.zeros(n, dtype=torch.bool), onpolicy=torch.ones(n, dtype=torch.bool),
    )  # fmt: skip


def groups(prompts, G, *, born=0, correct=None, seed=0, **kw):
    """One group of G rows per prompt, group ids 0..P-1; rewards = correctness; advantages group-centred."""
    P = len(prompts)
    if correct is None:
        correct = torch.rand(P * G, generator=torch.Generator().manual_seed(seed)) < 0.5
    correct = torch.as_tensor(correct, dtype=torch.bool).flatten()
    reward = correct.float()
    adv = reward - reward.view(P, G).mean(1).repeat_interleave(G)
    return rollouts(P * G, prompt_idx=torch.tensor(prompts).repeat_interleave(G), group=torch.arange(P).repeat_interleave(G),
                    born=born, reward=reward, correct=correct, advantage=adv, seed=seed, **kw)  # fmt: skip


def buffer(strategy, *, seed=0, max_len=MAX_LEN, **kw):
    return make_replay(ReplayConfig(strategy=strategy, **kw), max_len=max_len, pad_id=PAD, seed=seed)


def assert_same(a, b):
    assert a is not None and b is not None
    for f in fields(Rollouts):
        assert torch.equal(getattr(a, f.name), getattr(b, f.name)), f.name


# ---------------------------------------------------------------- none, storage, capacity


def test_none_returns_batch_unchanged_and_draws_nothing():
    buf = buffer("none")
    fresh = groups([0, 1], 4, correct=[1, 0, 1, 0, 1, 1, 1, 1])
    global_rng, own_rng = torch.get_rng_state(), buf.gen.get_state()
    for step in range(3):
        assert buf.before_advantages(fresh, step) is fresh
        assert buf.sample(fresh, step) is None
        buf.push(fresh, step)
    assert len(buf) == 0 and buf.tokens.numel() == 0
    assert torch.equal(buf.gen.get_state(), own_rng) and torch.equal(torch.get_rng_state(), global_rng)
    assert buf.metrics()["replay/sampled"] == 0.0


def test_rows_come_back_bit_exact():
    buf = buffer("uniform", ratio=0.9)
    stored = rollouts(6, reward=torch.arange(6.0), advantage=torch.linspace(-1, 1, 6), entropy=torch.rand(6), born=2)
    stored.truncated[1] = True
    buf.push(stored, 2)
    out = buf.sample(rollouts(1, born=3, seed=1), 3)
    out = out.select(torch.argsort(out.reward))  # uniform draws come in random order; reward 0..5 identifies the row
    L = int(stored.seq_len.max())
    assert torch.equal(out.tokens, stored.tokens[:, :L]) and torch.equal(out.behav_logp, stored.behav_logp[:, :L])
    for name in ("prompt_len", "seq_len", "truncated", "prompt_idx", "born", "reward", "correct", "advantage", "entropy"):
        assert torch.equal(getattr(out, name), getattr(stored, name)), name
    assert out.replayed.all() and not out.onpolicy.any() and out.tokens.dtype == torch.int64


def test_row_longer_than_max_len_raises_and_padding_past_it_is_dropped():
    buf = buffer("uniform")
    too_long = rollouts(2, L=MAX_LEN + 4)
    too_long.seq_len[0] = MAX_LEN + 1
    with pytest.raises(ValueError, match="max_len"):
        buf.push(too_long, 0)
    padded = rollouts(3, L=12)
    padded.tokens = torch.nn.functional.pad(padded.tokens, (0, 10), value=PAD)  # 22 columns, rows ≤ 12 tokens
    padded.behav_logp = torch.nn.functional.pad(padded.behav_logp, (0, 10))
    buf.push(padded, 0)
    assert len(buf) == 3


@pytest.mark.parametrize("strategy", ["uniform", "aper", "rlep", "exgrpo"])
def test_capacity_is_never_exceeded(strategy):
    buf = buffer(strategy, capacity=10, tau_max=1000)
    pushed = 0
    for step in range(30):
        batch = groups([step % 5, 5 + step % 3], 4, born=step, seed=step)
        if step == 20:
            batch = groups(list(range(7)), 4, born=step, seed=step)  # one push larger than the whole buffer
        buf.sample(batch, step)
        buf.push(batch, step)
        pushed += len(batch)
        assert len(buf) <= 10 and buf.tokens.shape == (10, MAX_LEN) and buf.valid.shape == (10,)
    if strategy == "uniform":  # FIFO: the buffer holds exactly the newest 10 rows, the rest were evicted
        assert len(buf) == 10 and pushed == 10 + buf.evicted["capacity"]
        assert sorted(buf.born[buf.valid].tolist()) == [28] * 2 + [29] * 8


# ---------------------------------------------------------------- uniform


def test_uniform_ratio_max_age_and_distinct_rows():
    buf = buffer("uniform", ratio=0.75, max_age=2, capacity=1000)
    for step in range(12):
        fresh = groups([0, 1], 4, born=step, seed=step)
        out = buf.sample(fresh, step)
        if out is not None:
            age = step - out.born
            assert age.min() >= 1 and age.max() <= 2
            assert len(out) == min(24, 16 if step >= 2 else 8)  # ratio 0.75 → 3 replayed per fresh row, capped by size
            slots = torch.stack([out.born, out.reward, out.tokens[:, 3].float()], 1)
            assert len(torch.unique(slots, dim=0)) == len(out)  # no row twice in one batch
            assert set(out.group.tolist()).isdisjoint(fresh.group.tolist())
        buf.push(fresh, step)
    assert buf.evicted["age"] > 0


# ---------------------------------------------------------------- aper


def test_aper_never_samples_older_than_tau_max():
    tau = 3
    buf = buffer("aper", tau_max=tau, ratio=2.0, capacity=500)
    g = torch.Generator().manual_seed(0)
    for step in range(40):
        n = int(torch.randint(2, 12, (1,), generator=g))
        fresh = rollouts(n, born=step, advantage=torch.randn(n, generator=g), seed=step)
        out = buf.sample(fresh, step)
        if step > 0:
            assert out is not None
            age = step - out.born
            assert age.min() >= 1 and age.max() <= tau
            assert buf.metrics()["replay/age_max"] <= tau
        assert ((step - buf.born[buf.valid]) <= tau).all()
        buf.push(fresh, step)
    assert buf.evicted["age"] > 0


def test_aper_keeps_every_fresh_row_and_adds_k():
    buf = buffer("aper", ratio=0.5, tau_max=4)
    buf.push(groups([0, 1, 2, 3], 4, born=0, correct=[1, 0, 0, 0] * 4), 0)
    fresh = groups([4, 5, 6], 4, born=1, seed=1, correct=[1, 0, 1, 0] * 3)
    before = [getattr(fresh, f.name).clone() for f in fields(Rollouts)]
    out = buf.sample(fresh, 1)
    batch = Rollouts.cat([fresh, out], PAD)  # what train.py builds
    assert len(out) == round(0.5 * len(fresh)) == 6
    for f, old in zip(fields(Rollouts), before):
        assert torch.equal(getattr(fresh, f.name), old), f"sample mutated fresh.{f.name}"
        assert torch.equal(getattr(batch, f.name)[: len(fresh), : old.shape[-1]] if old.dim() == 2 else getattr(batch, f.name)[: len(fresh)], old)
    assert batch.replayed[len(fresh) :].all() and not batch.replayed[: len(fresh)].any()
    assert (out.born < 1).all() and not out.onpolicy.any()
    assert set(out.group.tolist()).isdisjoint(fresh.group.tolist())


def test_aper_does_not_store_zero_advantage_rows():
    buf = buffer("aper")
    batch = groups([0, 1, 2], 4, correct=[1, 1, 1, 1, 0, 0, 0, 0, 1, 0, 0, 0])
    buf.push(batch, 0)
    assert len(buf) == 4 and buf.prompt_idx[buf.valid].tolist() == [2, 2, 2, 2]


@pytest.mark.parametrize("alpha", [1.0, 0.5, 2.0])
def test_aper_sampling_frequency_follows_priority(alpha):
    A = torch.tensor([0.1, -0.2, 0.4, -0.8, 1.0, 1.5, -2.0, 3.0])
    buf = buffer("aper", alpha=alpha, ratio=1.0, tau_max=10**6, seed=1234)
    buf.push(rollouts(8, advantage=A, reward=torch.arange(8.0)), 0)
    fresh = rollouts(8, born=1, seed=1)  # k = ratio × 8 = 8 i.i.d. draws per call (with replacement)
    counts = torch.zeros(8)
    for _ in range(1000):
        counts += torch.bincount(buf.sample(fresh, 1).reward.long(), minlength=8)
    n = counts.sum()

    def chi2(p):
        expected = n * p / p.sum()
        return float(((counts - expected) ** 2 / expected).sum())

    assert chi2(A.abs() ** alpha + 1e-3) < CHI2_7DF_P001
    assert chi2(A.abs() ** (alpha + 0.5) + 1e-3) > CHI2_7DF_P001  # the test can tell a different exponent apart
    assert buf.times_sampled[:8].sum() == n


# ---------------------------------------------------------------- rlep


def check_rlep_mix(mixed, fresh, n):
    """Fresh rows untouched and first in each group; appended rows are verified successes of the group's prompt."""
    L = int(fresh.seq_len.max())
    assert torch.equal(mixed.tokens[~mixed.replayed][:, :L], fresh.tokens[:, :L])
    assert torch.equal(mixed.reward[~mixed.replayed], fresh.reward)
    added = mixed.select(mixed.replayed)
    assert added.correct.all() and added.onpolicy.all()
    prompt_of_group = dict(zip(fresh.group.tolist(), fresh.prompt_idx.tolist()))
    for g, p in zip(added.group.tolist(), added.prompt_idx.tolist()):
        assert prompt_of_group[g] == p
    assert (torch.bincount(added.group) <= n).all()
    rows = mixed.group.tolist()
    assert rows == sorted(rows)  # each group's rows are adjacent
    return added


def test_rlep_online_replays_only_verified_successes_of_the_same_prompt():
    buf = buffer("rlep", rlep_n=2, capacity=64)
    seen = set()
    for step in range(25):
        fresh = groups([step % 6, (step + 2) % 6, 7], 4, born=step, seed=step)
        fresh.correct[fresh.prompt_idx == 7] = False  # prompt 7 is never solved
        mixed = buf.before_advantages(fresh, step)
        added = check_rlep_mix(mixed, fresh, 2)
        assert (added.prompt_idx != 7).all() and (added.born < step).all()
        for p in fresh.prompt_idx.unique().tolist():  # a prompt gets min(n, its stored successes)
            have = int((buf.valid & (buf.prompt_idx == p) & buf.correct).sum())
            assert int((added.prompt_idx == p).sum()) == min(2, have)
        seen |= set(added.prompt_idx.tolist())
        buf.push(fresh, step)
    assert buf.correct[buf.valid].all() and seen


def test_rlep_phase_one_store_is_fixed():
    buf = buffer("rlep", rlep_n=3, rlep_source="solutions.jsonl")
    bad = rollouts(2, prompt_idx=[0, 1], correct=[True, False])
    with pytest.raises(ValueError, match="verified correct"):
        buf.load_rlep_solutions(bad)
    buf.load_rlep_solutions(rollouts(5, prompt_idx=[0, 0, 0, 0, 1], group=-1, reward=1.0))
    fresh = groups([0, 1, 2], 4, born=1, seed=1)
    mixed = buf.before_advantages(fresh, 1)
    added = check_rlep_mix(mixed, fresh, 3)
    assert torch.bincount(added.prompt_idx).tolist() == [3, 1]
    buf.push(fresh, 1)
    assert len(buf) == 5  # phase II never adds to a phase-I store
    with pytest.raises(ValueError, match="replay.rlep_source is read by rlep only"):
        buffer("aper", rlep_source="solutions.jsonl")


# ---------------------------------------------------------------- exgrpo


def test_exgrpo_retires_solved_prompts_and_replays_lowest_entropy_success():
    buf = buffer("exgrpo", ratio=0.5, exgrpo_min_solve=0.35)
    batch = groups([0, 1, 2], 4, correct=[1, 1, 1, 1, 1, 1, 0, 0, 1, 0, 0, 0])
    batch.entropy = torch.tensor([0.1, 0.1, 0.1, 0.1, 0.9, 0.3, 0.05, 0.05, 0.7, 0.0, 0.0, 0.0])
    buf.push(batch, 0)
    assert sorted(buf.prompt_idx[buf.valid].tolist()) == [1, 1, 2] and buf.retired.tolist() == [0]
    assert buf.solve_rate[buf.valid & (buf.prompt_idx == 1)].tolist() == [0.5, 0.5]

    assert buf.sample(groups([5], 4, born=1, correct=[1, 0, 0, 0]), 1) is None  # solve rate 0.25 < 0.35: no experience
    out = buf.sample(groups([5], 4, born=1, correct=[1, 1, 0, 0]), 1)
    assert sorted(zip(out.prompt_idx.tolist(), out.entropy.tolist())) == [(1, pytest.approx(0.3)), (2, pytest.approx(0.7))]
    assert out.correct.all() and not out.onpolicy.any()

    buf.push(groups([1, 0], 4, born=1, correct=[1, 1, 1, 1, 1, 1, 1, 0]), 1)  # prompt 1 solved; retired 0 stays out
    assert buf.prompt_idx[buf.valid].tolist() == [2] and buf.evicted["retired"] == 2 and buf.retired.tolist() == [0, 1]


def test_exgrpo_bucket_weight_peaks_at_medium_difficulty():
    buf = buffer("exgrpo", ratio=0.5, exgrpo_mu=0.5, exgrpo_sigma=0.2)
    buf.push(groups([0, 1], 8, correct=[1, 1, 1, 1, 0, 0, 0, 0] + [1, 0, 0, 0, 0, 0, 0, 0]), 0)  # rates 0.5, 0.125
    fresh = rollouts(1, prompt_idx=9, born=1)  # solve rate 1 ≥ min_solve; k = 1
    draws = torch.tensor([int(buf.sample(fresh, 1).prompt_idx) for _ in range(1000)])
    w_half, w_eighth = 1.0, math.exp(-0.5 * (0.375 / 0.2) ** 2)
    p = w_half / (w_half + w_eighth)
    assert abs(float((draws == 0).float().mean()) - p) < 4 * math.sqrt(p * (1 - p) / 1000)


# ---------------------------------------------------------------- advantages of replayed rows


def test_recomputed_advantages_match_hand_computed_values():
    buf = buffer("uniform", ratio=0.9, advantage="recompute")
    # prompt 7 (also in the fresh batch): rewards 1, 0; prompt 8: one row; prompt 9: two equal rewards;
    # prompt 10: rewards 1, 0 and not in the fresh batch. Stored advantages are markers.
    stored = rollouts(7, prompt_idx=[7, 7, 8, 9, 9, 10, 10], reward=[1, 0, 1, 1, 1, 1, 0], advantage=[9, 9, 0.5, 0.3, 0.3, 9, 9])
    buf.push(stored, 0)
    fresh = rollouts(4, prompt_idx=7, group=0, reward=[0, 0, 0, 1], born=1, seed=1)
    out = buf.sample(fresh, 1)
    assert len(out) == 7
    got = {(p, r): a for p, r, a in zip(out.prompt_idx.tolist(), out.reward.tolist(), out.advantage.tolist())}

    def grpo_adv(r, ref):  # the row joins the reference rewards; unbiased std + 1e-6
        m = sum(ref) / len(ref)
        s = math.sqrt(sum((x - m) ** 2 for x in ref) / (len(ref) - 1))
        return (r - m) / (s + 1e-6)

    assert got[(7, 1.0)] == pytest.approx(grpo_adv(1, [0, 0, 0, 1, 1]), rel=1e-6)  # = 0.6 / sqrt(0.3)
    assert got[(7, 0.0)] == pytest.approx(grpo_adv(0, [0, 0, 0, 1, 0]), rel=1e-6)  # = -0.2 / sqrt(0.2)
    assert got[(10, 1.0)] == pytest.approx(grpo_adv(1, [1, 0]), rel=1e-6)  # from the buffer: the prompt's stored rows
    assert got[(10, 0.0)] == pytest.approx(grpo_adv(0, [1, 0]), rel=1e-6)
    assert got[(8, 1.0)] == pytest.approx(0.5) and got[(9, 1.0)] == pytest.approx(0.3)  # < 2 rewards / no spread: stored

    solved = rollouts(4, prompt_idx=7, group=0, reward=1.0, born=1, seed=1)  # all-correct fresh group: a success adds nothing
    out = buf.sample(solved, 1)
    assert out.advantage[(out.prompt_idx == 7) & (out.reward == 1)].tolist() == [0.0]

    buf = buffer("uniform", ratio=0.9)  # stored (default): the advantage at birth
    buf.push(stored, 0)
    assert sorted(buf.sample(fresh, 1).advantage.tolist()) == sorted(stored.advantage.tolist())


# ---------------------------------------------------------------- resume, metrics, config


@pytest.mark.parametrize("strategy", ["uniform", "aper", "rlep", "exgrpo"])
def test_state_dict_round_trips_exactly(strategy):
    kw = {"capacity": 40, "ratio": 0.5, "tau_max": 3, "max_age": 5, "advantage": "recompute"}

    def step_once(buf, step):
        fresh = groups([step % 7, (step + 3) % 7], 4, born=step, seed=step)
        fresh.entropy = torch.rand(len(fresh), generator=torch.Generator().manual_seed(step))
        mixed = buf.before_advantages(fresh, step)
        out = buf.sample(mixed, step)
        buf.push(mixed, step)
        return mixed, out

    a = buffer(strategy, seed=3, **kw)
    for step in range(8):
        step_once(a, step)
    saved = io.BytesIO()
    torch.save(a.state_dict(), saved)
    b = buffer(strategy, seed=99, **kw)  # a different seed: everything must come from the state
    b.load_state_dict(torch.load(io.BytesIO(saved.getvalue()), weights_only=False))
    assert b.metrics() == a.metrics()
    replays = 0
    for step in range(8, 20):
        (mixed_a, out_a), (mixed_b, out_b) = step_once(a, step), step_once(b, step)
        assert_same(mixed_a, mixed_b)
        assert (out_a is None) == (out_b is None)
        if out_a is not None:
            assert_same(out_a, out_b)
        replays += int(mixed_a.replayed.sum()) + (len(out_a) if out_a is not None else 0)
        assert a.metrics() == b.metrics()
    assert replays > 0


def test_state_dict_is_a_copy():
    buf = buffer("uniform")
    buf.push(rollouts(3), 0)
    sd = buf.state_dict()
    buf.push(rollouts(3, seed=1), 1)
    assert int(sd["valid"].sum()) == 3 and sd["head"] == 3


def test_metrics_are_prefixed_floats():
    buf = buffer("aper")
    buf.push(groups([0, 1], 4, correct=[1, 0, 0, 0, 1, 1, 0, 0]), 0)
    buf.sample(groups([2], 4, born=1), 1)
    m = buf.metrics()
    assert all(k.startswith("replay/") and isinstance(v, float) for k, v in m.items())
    assert m["replay/size"] == 8 and m["replay/sampled"] == 2 and m["replay/age_mean"] == 1.0
    assert m["replay/replayed_share"] == pytest.approx(2 / 6) and m["replay/priority_max"] >= m["replay/priority_min"] > 0


BAD_CONFIGS = [{"strategy": "fifo"}, {"strategy": "aper", "tau_max": 0}, {"strategy": "uniform", "ratio": 1.0},
               {"strategy": "aper", "ratio": 5.0}, {"advantage": "fresh"}, {"capacity": 0}]  # fmt: skip


@pytest.mark.parametrize("bad", BAD_CONFIGS)
def test_bad_config_is_rejected(bad):
    with pytest.raises(ValueError, match="replay"):
        make_replay(ReplayConfig(**bad), max_len=MAX_LEN, pad_id=PAD, seed=0)
