"""Unit tests for replay.py: what each strategy stores and draws, staleness and capacity bounds,
the priority and bucket laws (chi-square and binomial checks at fixed seeds), hand-computed
advantages of replayed rows, and exact resume via state_dict. Every hook is called in train.py's
order: plan → (generate) → before_advantages → advantages → sample → update → push."""

import io
import json
import math
from dataclasses import fields

import pytest
import torch

from config import ConfigError, load_config, validate
from data.loaders import Problem
from grpo import group_advantages
from replay import STRATEGIES, Replay, ReplayConfig, make_replay
from batch import Rollouts

PAD, MAX_LEN = 0, 16
BUILT_IN = [s for s, cls in STRATEGIES.items() if cls.__module__ == "replay"]  # none first
CHI2_7DF_P001 = 24.322  # chi-square critical values at p = 0.001, for 7 and 3 degrees of freedom
CHI2_3DF_P001 = 16.266


def rollouts(n, *, prompt_idx=None, group=None, born=0, reward=None, advantage=None, correct=None,
             entropy=None, L=12, seed=0):
    """n rows `prompt (3 tokens) | completion | pad`, with distinct random tokens and behaviour
    log-probs; slot -1."""
    g = torch.Generator().manual_seed(seed)
    ro = Rollouts.empty(n, L, PAD)
    ro.seq_len, ro.prompt_len[:] = torch.randint(5, L + 1, (n,), generator=g), 3
    t = torch.arange(L)[None, :]
    ro.tokens = torch.where(t < ro.seq_len[:, None],
                            torch.randint(1, 50_000, (n, L), generator=g),
                            PAD)
    ro.behav_logp = torch.where(ro.completion_mask(), -torch.rand(n, L, generator=g), 0.0)
    ro.onpolicy[:] = True

    def col(x, default, dtype):
        return torch.as_tensor(default if x is None else x, dtype=dtype).expand(n).clone()

    ro.prompt_idx, ro.group = (col(prompt_idx, torch.arange(n), torch.int64),
                               col(group, torch.arange(n), torch.int64))
    ro.born = col(born, 0, torch.int64)
    ro.reward, ro.correct = (col(reward, torch.ones(n), torch.float32),
                             col(correct, True, torch.bool))
    ro.advantage, ro.entropy = (col(advantage, torch.ones(n), torch.float32),
                                col(entropy, torch.zeros(n), torch.float32))
    return ro


def groups(prompts, G, *, born=0, correct=None, reward=None, counts=None, group0=None, seed=0,
           **kw):
    """One group per prompt of counts[i] rows (default G), group ids group0 + 0..P-1 (default
    100·born: unique per step, as train.py numbers them); reward = correctness unless given;
    advantage = reward − group mean (easy by hand)."""
    counts = torch.tensor([G] * len(prompts) if counts is None else counts)
    n, local = int(counts.sum()), torch.arange(len(prompts)).repeat_interleave(counts)
    if correct is None:
        correct = torch.rand(n, generator=torch.Generator().manual_seed(seed)) < 0.5
    correct = torch.as_tensor(correct, dtype=torch.bool).flatten()
    reward = correct.float() if reward is None else torch.as_tensor(reward, dtype=torch.float32)
    mean = torch.zeros(len(prompts)).index_add_(0, local, reward) / counts
    return rollouts(n, prompt_idx=torch.tensor(prompts).repeat_interleave(counts),
                    group=(100 * born if group0 is None else group0) + local,
                    born=born, reward=reward, correct=correct, advantage=reward - mean[local],
                    seed=seed, **kw)  # fmt: skip


def token_entropy(rows):
    """A stand-in for the current policy's mean token entropy of each row: its first completion
    token, (B,)."""
    return rows.tokens[:, 3].double() if len(rows) else torch.zeros(0, dtype=torch.float64)


def buffer(strategy, *, seed=0, max_len=MAX_LEN, entropy=token_entropy, **kw):
    """make_replay, then start() as train.py calls it (not for a phase-I rlep store, which reads a
    file)."""
    buf = make_replay(ReplayConfig(strategy=strategy, **kw), max_len=max_len, pad_id=PAD, seed=seed)
    if not kw.get("rlep_source"):
        assert buf.start([], [], None, None, entropy) == 0
    return buf


def rejected(**kw):
    """config.validate's one-line message for these replay keys (validation happens there alone)."""
    cfg = load_config(None, [])
    cfg.replay = ReplayConfig(**kw)
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    return str(e.value)


def push(buf, batch, step):
    # no row trained: no strategy here reads it
    buf.push(batch, step, torch.full((len(batch),), math.nan))


def train_step(buf, idx, G, step):
    """One step as train.py runs it, rewards random: plan → generate → before_advantages → grpo
    advantages → sample → push. Returns (the groups advantages were computed over, the update
    batch)."""
    idx, counts = buf.plan(idx, G, step)
    fresh = groups(idx, G, counts=counts, born=step, seed=step)
    fresh.entropy = torch.rand(len(fresh), generator=torch.Generator().manual_seed(step))
    mixed = buf.before_advantages(fresh, step)
    mixed.advantage = group_advantages(mixed.reward, mixed.group)[0]
    batch = buf.sample(mixed, step)
    push(buf, batch, step)
    return mixed, batch


def replayed(batch):
    return batch.select(batch.replayed)


def trim(rows):
    """All rows, trimmed to the longest as `select` and `cat` return them."""
    return rows.select(torch.arange(len(rows)))


def assert_same(a, b):
    assert a is not None and b is not None
    for f in fields(Rollouts):
        assert torch.equal(getattr(a, f.name), getattr(b, f.name)), f.name


def stored_groups(buf):
    """{group id: rows stored} of the valid rows."""
    ids, n = torch.unique(buf.rows.group[buf.valid], return_counts=True)
    return dict(zip(ids.tolist(), n.tolist()))


# ---------------------------------------------------------------- none, storage, capacity


@pytest.mark.fast
def test_none_returns_batch_unchanged_and_draws_nothing():
    buf = buffer("none")
    assert STRATEGIES["none"] is Replay and type(buf) is Replay
    fresh = groups([0, 1], 4, correct=[1, 0, 1, 0, 1, 1, 1, 1])
    global_rng, own_rng = torch.get_rng_state(), buf.gen.get_state()
    for step in range(3):
        assert buf.plan([5, 6], 4, step) == ([5, 6], [4, 4])
        assert buf.before_advantages(fresh, step) is fresh
        assert buf.sample(fresh, step) is fresh  # the update batch is the fresh rows alone
        push(buf, fresh, step)
    assert len(buf) == 0 and buf.rows.tokens.numel() == 0
    assert (torch.equal(buf.gen.get_state(), own_rng)
            and torch.equal(torch.get_rng_state(), global_rng))
    assert buf.metrics()["replay/sampled"] == 0.0


@pytest.mark.fast
def test_rows_come_back_bit_exact():
    buf = buffer("uniform", ratio=0.9)
    stored = rollouts(6, reward=torch.arange(6.0), advantage=torch.linspace(-1, 1, 6),
                      entropy=torch.rand(6), born=2)
    stored.truncated[1] = True
    push(buf, stored, 2)
    fresh = rollouts(1, born=3, seed=1)
    batch = buf.sample(fresh, 3)
    assert_same(batch.select(torch.arange(1)), trim(fresh))  # the fresh row first, as it was
    out = replayed(batch)
    # uniform draws come in random order; reward 0..5 identifies the row
    out = out.select(torch.argsort(out.reward))
    L = int(stored.seq_len.max())
    assert (torch.equal(out.tokens, stored.tokens[:, :L])
            and torch.equal(out.behav_logp, stored.behav_logp[:, :L]))
    for name in ("prompt_len", "seq_len", "truncated", "prompt_idx", "group", "born", "reward",
                 "correct", "advantage", "entropy"):
        assert torch.equal(getattr(out, name), getattr(stored, name)), name
    assert out.replayed.all() and not out.onpolicy.any() and out.tokens.dtype == torch.int64
    assert out.slot.tolist() == [0, 1, 2, 3, 4, 5]  # the first push filled slots 0..5 in order
    # reading marks the copy, not the store
    assert (buf.rows.slot == -1).all() and not buf.rows.replayed.any()


@pytest.mark.fast
def test_row_longer_than_max_len_raises_and_padding_past_it_is_dropped():
    buf = buffer("uniform")
    too_long = rollouts(2, L=MAX_LEN + 4)
    too_long.seq_len[0] = MAX_LEN + 1
    with pytest.raises(ValueError, match="max_len"):
        push(buf, too_long, 0)
    padded = rollouts(3, L=12)
    # 22 columns, rows ≤ 12 tokens
    padded.tokens = torch.nn.functional.pad(padded.tokens, (0, 10), value=PAD)
    padded.behav_logp = torch.nn.functional.pad(padded.behav_logp, (0, 10))
    push(buf, padded, 0)
    assert len(buf) == 3 and torch.equal(buf.rows.tokens[:3, :12], padded.tokens[:, :12])


@pytest.mark.fast
@pytest.mark.parametrize("strategy", BUILT_IN[1:])
def test_capacity_is_never_exceeded(strategy):
    buf = buffer(strategy, capacity=10, tau_max=1000)
    pushed = 0
    for step in range(30):
        # step 20: one push larger than the buffer
        idx = list(range(7)) if step == 20 else [step % 5, 5 + step % 3]
        _, batch = train_step(buf, idx, 4, step)
        pushed += int((~batch.replayed).sum())
        assert (len(buf) <= 10
                and buf.rows.tokens.shape == (10, MAX_LEN)
                and buf.valid.shape == (10,))
        if strategy == "group":  # whole informative groups only, even after the oversized push
            assert set(stored_groups(buf).values()) <= {4}
            assert all(buf.rows.reward[buf.valid & (buf.rows.group == g)].unique().numel() > 1
                       for g in stored_groups(buf))
    # FIFO: the buffer holds exactly the newest 10 rows, the rest were evicted
    if strategy == "uniform":
        assert len(buf) == 10 and pushed == 10 + buf.evicted["capacity"]
        assert sorted(buf.rows.born[buf.valid].tolist()) == [28] * 2 + [29] * 8


# ---------------------------------------------------------------- uniform


@pytest.mark.fast
def test_uniform_ratio_max_age_and_distinct_rows():
    buf = buffer("uniform", ratio=0.75, max_age=2, capacity=1000)
    for step in range(12):
        fresh = groups([0, 1], 4, born=step, seed=step)
        batch = buf.sample(fresh, step)
        assert_same(batch.select(torch.arange(8)), trim(fresh))
        out = replayed(batch)
        # 3 replayed per fresh row, capped by size
        assert len(out) == (0 if step == 0 else min(24, 16 if step >= 2 else 8))
        if step:
            age = step - out.born
            assert age.min() >= 1 and age.max() <= 2
            assert len(out.slot.unique()) == len(out)  # no row twice in one batch
            rows = torch.stack([out.born, out.reward, out.tokens[:, 3].float()], 1)
            assert len(torch.unique(rows, dim=0)) == len(out)
            # replayed rows keep their own groups
            assert set(out.group.tolist()).isdisjoint(fresh.group.tolist())
        push(buf, batch, step)
    assert buf.evicted["age"] > 0


# ---------------------------------------------------------------- aper


@pytest.mark.fast
def test_aper_never_samples_older_than_tau_max():
    tau = 3
    buf = buffer("aper", tau_max=tau, ratio=2.0, capacity=500)
    g = torch.Generator().manual_seed(0)
    for step in range(40):
        n = int(torch.randint(2, 12, (1,), generator=g))
        fresh = rollouts(n, born=step, advantage=torch.randn(n, generator=g), seed=step)
        batch = buf.sample(fresh, step)
        out = replayed(batch)
        if step > 0:
            assert len(out) == min(2 * n, len(buf))
            age = step - out.born
            assert age.min() >= 1 and age.max() <= tau
            assert buf.metrics()["replay/age_max"] <= tau
        assert ((step - buf.rows.born[buf.valid]) <= tau).all()
        push(buf, batch, step)
    assert buf.evicted["age"] > 0


@pytest.mark.fast
def test_aper_keeps_every_fresh_row_and_adds_k():
    buf = buffer("aper", ratio=0.5, tau_max=4)
    push(buf, groups([0, 1, 2, 3], 4, born=0, correct=[1, 0, 0, 0] * 4), 0)
    fresh = groups([4, 5, 6], 4, born=1, seed=1, correct=[1, 0, 1, 0] * 3)
    before = [getattr(fresh, f.name).clone() for f in fields(Rollouts)]
    batch = buf.sample(fresh, 1)  # what train.py updates on
    out = replayed(batch)
    assert len(batch) - len(fresh) == len(out) == round(0.5 * len(fresh)) == 6
    for f, old in zip(fields(Rollouts), before):
        assert torch.equal(getattr(fresh, f.name), old), f"sample mutated fresh.{f.name}"
        new = getattr(batch, f.name)[: len(fresh)]
        assert torch.equal(new[:, : old.shape[-1]] if old.dim() == 2 else new, old)
    assert batch.replayed[len(fresh) :].all() and not batch.replayed[: len(fresh)].any()
    assert (batch.slot[: len(fresh)] == -1).all() and (out.slot >= 0).all()
    assert (out.born < 1).all() and not out.onpolicy.any()
    assert set(out.group.tolist()).isdisjoint(fresh.group.tolist())


@pytest.mark.fast
def test_aper_does_not_store_zero_advantage_rows():
    buf = buffer("aper")
    batch = groups([0, 1, 2], 4, correct=[1, 1, 1, 1, 0, 0, 0, 0, 1, 0, 0, 0])
    push(buf, batch, 0)
    assert len(buf) == 4 and buf.rows.prompt_idx[buf.valid].tolist() == [2, 2, 2, 2]
    # |A|^1 + eps
    assert buf.score[buf.valid].tolist() == pytest.approx([0.75 + 1e-3] + [0.25 + 1e-3] * 3)


@pytest.mark.fast  # (tests/regressions.py's aper_alpha: no other fast test notices it)
@pytest.mark.parametrize("alpha", [1.0, 0.5, 2.0])
def test_aper_sampling_frequency_follows_priority(alpha):
    A = torch.tensor([0.1, -0.2, 0.4, -0.8, 1.0, 1.5, -2.0, 3.0])
    buf = buffer("aper", alpha=alpha, ratio=1.0, tau_max=10**6, seed=1234)
    push(buf, rollouts(8, advantage=A, reward=torch.arange(8.0)), 0)
    # k = ratio × 8 = 8 i.i.d. draws per call (with replacement)
    fresh = rollouts(8, born=1, seed=1, reward=-1.0)
    counts = torch.zeros(8)
    for _ in range(1000):
        out = replayed(buf.sample(fresh, 1))
        assert len(out) == 8
        counts += torch.bincount(out.reward.long(), minlength=8)
    n = counts.sum()

    def chi2(p):
        expected = n * p / p.sum()
        return float(((counts - expected) ** 2 / expected).sum())

    assert chi2(A.abs() ** alpha + 1e-3) < CHI2_7DF_P001
    # the test can tell a different exponent apart
    assert chi2(A.abs() ** (alpha + 0.5) + 1e-3) > CHI2_7DF_P001
    assert buf.used[:8].sum() == n


# ---------------------------------------------------------------- rlep


def check_rlep_mix(buf, mixed, fresh, n):
    """Fresh rows untouched and first in each group; appended rows are verified successes of the
    group's prompt."""
    L = int(fresh.seq_len.max())
    assert torch.equal(mixed.tokens[~mixed.replayed][:, :L], fresh.tokens[:, :L])
    assert torch.equal(mixed.reward[~mixed.replayed], fresh.reward)
    added = replayed(mixed)
    assert added.correct.all() and added.onpolicy.all()
    prompt_of_group = dict(zip(fresh.group.tolist(), fresh.prompt_idx.tolist()))
    for g, p in zip(added.group.tolist(), added.prompt_idx.tolist()):
        assert prompt_of_group[g] == p
    assert (torch.unique(added.group, return_counts=True)[1] <= n).all()
    rows = mixed.group.tolist()
    assert rows == sorted(rows)  # each group's rows adjacent
    for g in set(rows):  # fresh rows first within a group
        flags = mixed.replayed[mixed.group == g].tolist()
        assert flags == sorted(flags)
    for b, s in enumerate(added.slot.tolist()):  # `slot` points at the ring's row (-1: phase I's)
        assert s >= 0 or buf.store is not None
        n = added.seq_len[b]
        if s >= 0:
            assert torch.equal(buf.rows.tokens[s, :n], added.tokens[b, :n])
    return added


@pytest.mark.fast
def test_rlep_online_replays_only_verified_successes_of_the_same_prompt():
    buf = buffer("rlep", rlep_n=2, capacity=64)
    seen = set()
    for step in range(25):
        fresh = groups([step % 6, (step + 2) % 6, 7], 4, born=step, seed=step)
        fresh.correct[fresh.prompt_idx == 7] = False  # prompt 7 is never solved
        mixed = buf.before_advantages(fresh, step)
        added = check_rlep_mix(buf, mixed, fresh, 2)
        assert (added.prompt_idx != 7).all() and (added.born < step).all()
        for p in fresh.prompt_idx.unique().tolist():  # a prompt gets min(n, its stored successes)
            have = int((buf.valid & (buf.rows.prompt_idx == p) & buf.rows.correct).sum())
            assert int((added.prompt_idx == p).sum()) == min(2, have)
        seen |= set(added.prompt_idx.tolist())
        assert buf.sample(mixed, step) is mixed  # the update batch is the mixed groups
        push(buf, mixed, step)
    assert buf.rows.correct[buf.valid].all() and not buf.rows.replayed[buf.valid].any() and seen


@pytest.mark.fast
def test_rlep_phase_one_store_is_fixed(tmp_path):
    cfg = load_config(None, [])
    problems = [Problem(f"problem {i}", str(i), f"id{i}") for i in range(3)]
    prompts = [[5, 6, 7], [8, 9, 10], [11, 12, 13]]
    src = tmp_path / "solutions.jsonl"
    lines = [{"problem": "problem 0", "completion_ids": [20 + i, 30 + i, 2],
              "behav_logp": [-0.5, -0.25, -0.125]} for i in range(4)]
    lines.insert(2, {"prompt_idx": 1, "completion_ids": [40, 2], "behav_logp": [-1.0, -0.75]})
    src.write_text("".join(json.dumps(r) + "\n" for r in lines))
    (tmp_path / "solutions.jsonl.meta.json").write_text(json.dumps({"generated_tokens": 1234}))
    buf = buffer("rlep", rlep_n=3, rlep_source=str(src), capacity=2)  # the ring's: does not apply
    # phase I's generation counts in the run's total
    assert buf.start(problems, prompts, None, cfg) == 1234
    store = buf.store
    assert len(buf) == len(store) == 5 and store.ids.dtype == torch.int32  # rows of prompt 0 first
    want = [[20, 30, 2], [21, 31, 2], [22, 32, 2], [23, 33, 2], [40, 2]]
    assert [store.completion(i) for i in range(5)] == want
    assert store.prompt_idx.tolist() == [0, 0, 0, 0, 1] and store.first.tolist() == [0, 4, 5, 5]
    row = store.rollouts(torch.tensor([4]), prompts, PAD, cfg.reward.correct)
    assert row.tokens[0].tolist() == [8, 9, 10, 40, 2] and row.behav_logp[0].tolist() == [0.0] * 5
    assert row.correct.all() and (row.reward == cfg.reward.correct).all() and row.onpolicy.all()

    bad_rows = [({"problem": "unknown", "completion_ids": [1]}, ":1: problem is not among"),
                ({"problem": "problem 0", "completion_ids": []}, ":1: completion_ids must be")]
    for bad, message in bad_rows:
        (tmp_path / "bad.jsonl").write_text(json.dumps(bad) + "\n")
        with pytest.raises(ValueError, match=message):
            buffer("rlep", rlep_source=str(tmp_path / "bad.jsonl")).start(
                problems, prompts, None, cfg)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="holds no solutions"):
        buffer("rlep", rlep_source=str(tmp_path / "empty.jsonl")).start(
            problems, prompts, None, cfg)

    fresh = groups([0, 1, 2], 4, born=1, seed=1)
    mixed = buf.before_advantages(fresh, 1)
    added = check_rlep_mix(buf, mixed, fresh, 3)
    assert torch.bincount(added.prompt_idx).tolist() == [3, 1]
    completions = [added.tokens[b, 3 : added.seq_len[b]].tolist() for b in range(len(added))]
    assert len({tuple(c) for c in completions[:3]}) == 3  # without replacement
    assert all(c in [store.completion(i) for i in range(5)] for c in completions)
    push(buf, buf.sample(mixed, 1), 1)
    assert len(buf) == 5 and buf.valid.sum() == 0  # phase II never adds to a phase-I store
    message = rejected(strategy="aper", rlep_source="solutions.jsonl")
    assert message.startswith("replay.rlep_source must be empty: it is read by rlep only, got ")


# ---------------------------------------------------------------- exgrpo, as released


def latched(G=4, **kw):
    """An exgrpo buffer whose experience is on: one push of a half-solved batch (0.5 >
    exgrpo_min_solve 0.35)."""
    buf = buffer("exgrpo", **kw)
    push(buf, groups([999], G, correct=[1] * (G // 2) + [0] * (G - G // 2)), 0)
    assert buf.latched and len(buf) == 0  # the latching push itself stores nothing
    return buf


@pytest.mark.fast
def test_exgrpo_mixed_group_is_one_stored_success_plus_g_minus_one_fresh():
    buf = latched(ratio=0.5)
    # 11 solved 4/4: retired, not stored
    push(buf, groups([10, 11], 4, born=1, correct=[1, 0, 0, 0, 1, 1, 1, 1]), 1)
    assert buf.rows.prompt_idx[buf.valid].tolist() == [10]
    slot = int(buf.stored()[0])

    # n_exp = min(1 stored, int(0.5 · 2)) = 1: question 10 takes 21's place
    idx, counts = buf.plan([20, 21], 4, 2)
    assert (idx, counts) == ([20, 10], [4, 3])
    fresh = groups(idx, 4, counts=counts, born=2, seed=2, correct=[1, 0, 0, 0] + [0, 0, 0])
    mixed = buf.before_advantages(fresh, 2)
    assert (mixed.group.tolist() == [200] * 4 + [201] * 4
            and mixed.replayed.tolist() == [False] * 7 + [True])
    row = mixed.select(torch.tensor([7]))
    assert row.prompt_idx.item() == 10 and row.slot.item() == slot and row.born.item() == 1
    # off-policy: its ratio is taken against stored μ
    assert row.correct.item() and not row.onpolicy.item()
    assert torch.equal(row.tokens[0, : row.seq_len[0]], buf.rows.tokens[slot, : row.seq_len[0]])
    adv, _ = group_advantages(mixed.reward, mixed.group)
    # group 201 rewards [0, 0, 0, 1]: mean 0.25, unbiased std sqrt((3 · 0.0625 + 0.5625) / 3) = 0.5
    assert adv[7].item() == pytest.approx(0.75 / (0.5 + 1e-6), rel=1e-6)
    assert adv[4:7].tolist() == pytest.approx([-0.25 / (0.5 + 1e-6)] * 3, rel=1e-6)
    assert buf.metrics()["replay/sampled"] == 1.0


def exgrpo_with(questions, G=4, **kw):
    """A latched exgrpo buffer holding one success (1 of G correct) of each question, pushed at
    step 1."""
    buf = latched(G, **kw)
    push(buf, groups(questions, G, born=1, correct=([1] + [0] * (G - 1)) * len(questions)), 1)
    assert sorted(buf.rows.prompt_idx[buf.valid].tolist()) == sorted(questions)
    return buf


@pytest.mark.fast
def test_exgrpo_question_level_mix_ratio():
    stream, stored = list(range(100, 108)), [10, 11, 12, 13]
    # int(3.6) = 3; int(7.2) = 7, 4 stored; int(0.8) = 0
    for ratio, n_exp in [(0.45, 3), (0.9, 4), (0.1, 0)]:
        idx, counts = exgrpo_with(stored, ratio=ratio).plan(stream, 4, 2)
        # the last ones make way
        assert (idx[: 8 - n_exp] == stream[: 8 - n_exp]
                and counts == [4] * (8 - n_exp) + [3] * n_exp)
        assert len(set(idx[8 - n_exp :])) == n_exp and set(idx[8 - n_exp :]) <= set(stored)

    buf = exgrpo_with(stored, ratio=0.45)
    push(buf, groups([101, 103], 4, born=2, correct=[1] * 8), 2)  # solved 4/4: retired
    assert buf.retired.tolist() == [101, 103]
    # retired questions leave the stream; n_exp still counts the 8 asked for
    idx, counts = buf.plan(stream, 4, 3)
    assert (idx[:5] == [100, 102, 104, 105, 106]
            and set(idx[5:]) <= set(stored)
            and counts == [4] * 5 + [3] * 3)


@pytest.mark.fast
def test_exgrpo_replays_the_lowest_entropy_success_under_the_current_policy():
    calls, sign = [], [1.0]

    def current_policy(rows):
        calls.append(rows.prompt_idx.tolist())
        return sign[0] * token_entropy(rows)

    buf = buffer("exgrpo", ratio=0.5, entropy=current_policy)
    push(buf, groups([999], 4, correct=[1, 1, 0, 0]), 0)
    batch = groups([10], 4, born=1, correct=[1, 1, 1, 0], entropy=[0.1, 0.2, 0.3, 0.4])
    # the current policy's "entropy" of the three successes
    batch.tokens[:3, 3] = torch.tensor([30, 10, 20])
    push(buf, batch, 1)
    assert len(buf) == 3 and calls == []  # nothing is measured before experience is drawn

    # re-measured at every plan
    for s, (want_token, birth_entropy) in [(1.0, (10, 0.2)), (-1.0, (30, 0.1))]:
        sign[0] = s
        idx, counts = buf.plan([20, 21], 4, 2)
        # every stored success of the drawn question, measured
        assert idx == [20, 10] and calls[-1] == [10, 10, 10]
        row = replayed(buf.before_advantages(groups(idx, 4, counts=counts, born=2), 2))
        assert len(row) == 1 and row.tokens[0, 3].item() == want_token
        # chosen by the policy now, not by the entropy at birth
        assert row.entropy.item() == pytest.approx(birth_entropy)


@pytest.mark.fast
def test_exgrpo_measures_every_latched_step_even_with_nothing_to_measure():
    calls = []

    # under FSDP forwards are collective: every rank measures every latched step, rows or not
    def stand_in(rows):
        calls.append(len(rows))
        return torch.zeros(len(rows))

    buf = buffer("exgrpo", entropy=stand_in)
    push(buf, groups([999], 4, correct=[1, 1, 0, 0]), 0)
    # latched, nothing stored yet
    assert buf.plan([1, 2], 4, 1) == ([1, 2], [4, 4]) and calls == [0]
    mixed = buf.before_advantages(groups([1, 2], 4, born=1), 1)
    assert not mixed.replayed.any() and len(mixed) == 8


@pytest.mark.parametrize("sigma", [1.0, 2.0])
def test_exgrpo_bucket_weight_is_gaussian_in_success_counts(sigma):
    G = 8
    buf = latched(G, ratio=0.5, exgrpo_sigma=sigma, seed=7)
    push(buf, groups([10, 11], G, born=1,
                     correct=[1, 1, 1, 1, 0, 0, 0, 0] + [1, 0, 0, 0, 0, 0, 0, 0]), 1)
    assert buf.score[buf.valid & (buf.rows.prompt_idx == 10)].tolist() == [4.0] * 4
    assert buf.score[buf.valid & (buf.rows.prompt_idx == 11)].tolist() == [1.0]
    draws = []
    for _ in range(1000):  # n_exp = int(0.5 · 2) = 1: one bucket, then one question of it
        idx, counts = buf.plan([100, 101], G, 2)
        assert counts == [G, G - 1]
        draws.append(idx[-1])
    draws = torch.tensor(draws)
    w4, w1 = 1.0, math.exp(-0.5 * ((1 - G / 2) / sigma) ** 2)  # N(k; G/2, σ) at k = 4 and k = 1
    p, sd = w4 / (w4 + w1), lambda p: 4 * math.sqrt(p * (1 - p) / 1000)
    freq = float((draws == 10).float().mean())
    assert abs(freq - p) < sd(p) and set(draws.tolist()) <= {10, 11}
    # σ read as a width in solve RATE: told apart
    p_rate = 1 / (1 + math.exp(-0.5 * ((1 / G - 0.5) / sigma) ** 2))
    assert abs(freq - p_rate) > sd(p_rate)


@pytest.mark.fast
def test_exgrpo_latch_starts_experience_once_and_for_good():
    buf = buffer("exgrpo", ratio=0.5, exgrpo_min_solve=0.5)
    # 4/8 = 0.5, not more than 0.5
    push(buf, groups([1, 2], 4, correct=[1, 1, 0, 0, 1, 1, 0, 0]), 0)
    assert not buf.latched and len(buf) == 0 and buf.metrics()["replay/experience_on"] == 0.0
    assert buf.plan([1, 2], 4, 1) == ([1, 2], [4, 4])
    # 5/8 > 0.5: on from the next step
    push(buf, groups([3, 4], 4, born=1, correct=[1, 1, 1, 0, 1, 1, 0, 0]), 1)
    assert buf.latched and len(buf) == 0 and buf.metrics()["replay/experience_on"] == 1.0
    # 1/8: a bad batch does not switch it off
    push(buf, groups([5, 6], 4, born=2, correct=[1, 0, 0, 0, 0, 0, 0, 0]), 2)
    assert (buf.latched
            and buf.rows.prompt_idx[buf.valid].tolist() == [5]
            and buf.score[buf.valid].tolist() == [1.0])
    assert buf.plan([7, 8], 4, 3) == ([7, 5], [4, 3])


@pytest.mark.fast
def test_exgrpo_retires_questions_solved_by_all_g_rows():
    buf = latched(ratio=0.5)
    push(buf, groups([10, 11], 4, born=1, correct=[1, 0, 0, 0, 1, 1, 0, 0]), 1)
    assert buf.score[buf.valid].tolist() == [1.0, 2.0, 2.0]
    idx, counts = buf.plan([20, 21, 22, 23], 4, 2)  # int(0.5 · 4) = 2: both stored questions drawn
    assert idx[:2] == [20, 21] and sorted(idx[2:]) == [10, 11] and counts == [4, 4, 3, 3]
    # fresh rows; each replayed row is a success
    outcome = {20: [1, 0, 0, 0], 21: [1, 1, 1, 1], 10: [1, 1, 1], 11: [1, 1, 0]}
    fresh = groups(idx, 4, counts=counts, born=2, seed=2,
                   correct=[c for p in idx for c in outcome[p]])
    mixed = buf.before_advantages(fresh, 2)
    mixed.advantage = group_advantages(mixed.reward, mixed.group)[0]
    push(buf, buf.sample(mixed, 2), 2)
    # 10: 3 fresh + the replayed row = 4/4, retired with its stored row; 21: 4/4 fresh, retired,
    # never stored; 11: 2 fresh + the replayed row = 3/4, so every stored row of 11 (2 old, 2 new)
    # learns k = 3; 20: 1/4
    assert buf.retired.tolist() == [10, 21] and buf.evicted["retired"] == 1
    got = sorted(zip(buf.rows.prompt_idx[buf.valid].tolist(), buf.score[buf.valid].tolist()))
    assert got == [(11, 3.0)] * 4 + [(20, 1.0)]
    m = buf.metrics()
    assert m["replay/retired"] == 2.0 and m["replay/evicted_retired"] == 1.0
    # retired questions are never sampled fresh again
    idx, counts = buf.plan([10, 21, 30, 31], 4, 3)
    assert idx[:2] == [30, 31] and sorted(idx[2:]) == [11, 20] and counts == [4, 4, 3, 3]

    # retirement needs no latch (the release's skip set fills from the first step)
    early = buffer("exgrpo", exgrpo_min_solve=1.0)
    push(early, groups([5], 4, correct=[1, 1, 1, 1]), 0)
    assert (early.retired.tolist() == [5]
            and not early.latched
            and early.plan([5, 6], 4, 1) == ([6], [4]))


@pytest.mark.fast
def test_exgrpo_stores_each_new_correct_trajectory_once():
    buf = latched()
    batch = groups([10], 4, born=1, correct=[1, 1, 1, 0])
    # the same completion sampled twice
    batch.tokens[1], batch.seq_len[1] = batch.tokens[0], batch.seq_len[0]
    push(buf, batch, 1)
    assert len(buf) == 2  # rows 0 (= 1) and 2
    again = groups([10], 4, born=2, seed=5, correct=[1, 1, 0, 0])
    again.tokens[0], again.seq_len[0] = batch.tokens[2], batch.seq_len[2]  # already stored
    push(buf, again, 2)
    # one new row; all learn the latest k = 2
    assert len(buf) == 3 and buf.score[buf.valid].tolist() == [2.0] * 3


# ---------------------------------------------------------------- group substitution


@pytest.mark.fast
def test_group_replaces_only_flat_groups_with_whole_stored_groups():
    buf = buffer("group", tau_max=2, capacity=64)
    first = groups([0, 1, 2], 4, born=0, correct=[1, 0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0])
    push(buf, first, 0)
    assert stored_groups(buf) == {0: 4, 2: 4}  # the flat group 1 is never stored
    # priority Σ|A_i| · std(r), std unbiased: [1,0,0,0] → 1.5 · 0.5 = 0.75; [1,1,0,0] → 2 ·
    # sqrt(1/3)
    assert buf.score[buf.valid].tolist() == pytest.approx([0.75] * 4 + [2 / math.sqrt(3)] * 4,
                                                          rel=1e-6)

    # 3 flat, 2 stored
    fresh = groups([5, 6, 7, 8], 4, born=1, seed=1,
                   correct=[1] * 4 + [0] * 4 + [1, 0, 1, 0] + [1] * 4)
    batch = buf.sample(fresh, 1)
    kept = batch.select(~batch.replayed)
    # the first two flat groups made way, the third stays
    assert torch.unique(kept.group).tolist() == [102, 103]
    assert_same(kept, fresh.select(fresh.group >= 102))
    out = replayed(batch)
    assert (torch.unique(out.group, return_counts=True)[1].tolist() == [4, 4]
            and set(out.group.tolist()) == {0, 2})
    assert (torch.equal(out.advantage, buf.rows.advantage[out.slot])
            and not out.onpolicy.any()
            and (out.born == 0).all())
    by_group = {g: first.advantage[first.group == g].tolist() for g in (0, 2)}
    # stored, as at birth
    assert all(sorted(out.advantage[out.group == g].tolist()) == sorted(by_group[g])
               for g in (0, 2))
    assert (buf.metrics()["replay/groups_replaced"] == 2.0
            and buf.metrics()["replay/flat_groups"] == 3.0)

    one_flat = groups([5, 6], 4, born=1, seed=2, correct=[1, 1, 0, 0] + [0] * 4)
    batch = buf.sample(one_flat, 1)
    assert (len(replayed(batch)) == 4
            and torch.unique(batch.group[~batch.replayed]).tolist() == [100])
    no_flat = groups([5], 4, born=1, correct=[1, 0, 0, 0])
    assert_same(buf.sample(no_flat, 1), trim(no_flat))


@pytest.mark.fast
def test_group_drops_a_group_the_ring_overwrites_in_part():
    buf = buffer("group", capacity=10, tau_max=100)
    push(buf, groups([0, 1], 4, born=0, correct=[1, 0, 0, 0] * 2), 0)  # slots 0-7
    # slots 8, 9, 0, 1: group 0 loses two rows, so all four
    push(buf, groups([2], 4, born=1, correct=[1, 1, 0, 0]), 1)
    assert stored_groups(buf) == {1: 4, 100: 4} and buf.evicted["capacity"] == 4
    # 12 rows > capacity: the last two groups fit
    push(buf, groups([3, 4, 5], 4, born=2, correct=[1, 0, 0, 0] * 3), 2)
    assert stored_groups(buf) == {201: 4, 202: 4} and buf.evicted["capacity"] == 4 + 8 + 4
    assert all(len(replayed(buf.sample(groups([9], 4, born=3, correct=[0] * 4), 3))) == 4
               for _ in range(5))


@pytest.mark.fast
def test_group_age_bound_and_stores_only_informative_groups():
    tau = 2
    buf, replays = buffer("group", tau_max=tau, capacity=48), 0
    for step in range(30):
        _, batch = train_step(buf, [3 * step % 11, (3 * step + 1) % 11, (3 * step + 2) % 11],
                              4, step)
        out = replayed(batch)
        if len(out):
            assert 1 <= (step - out.born).min() and (step - out.born).max() <= tau
            assert set(torch.unique(out.group, return_counts=True)[1].tolist()) == {4}
        replays += len(out)
        assert ((step - buf.rows.born[buf.valid]) <= tau).all()
        assert all(n == 4 and buf.rows.reward[buf.valid & (buf.rows.group == g)].std() > 0
                   for g, n in stored_groups(buf).items())
    assert buf.evicted["age"] > 0 and replays > 0


def test_group_priority_law():
    buf = buffer("group", tau_max=10**6, seed=11)
    # Σ|A_i| · std(r) per group: [1,0,0,0] 1.5 · 0.5; [1,1,0,0] 2 · sqrt(1/3); [2,0,0,0] 3 · 1;
    # [0.5,0,0,0] 0.75 · 0.25
    push(buf, groups([0, 1, 2, 3], 4, reward=[1, 0, 0, 0, 1, 1, 0, 0, 2, 0, 0, 0, 0.5, 0, 0, 0]), 0)
    # one flat group: one stored group drawn per call
    flat = groups([9], 4, born=1, correct=[0] * 4)
    counts = torch.zeros(4)
    for _ in range(1000):
        out = replayed(buf.sample(flat, 1))
        assert len(out) == 4 and out.group.unique().numel() == 1
        counts[out.group[0]] += 1

    def chi2(p):
        expected = 1000 * p / p.sum()
        return float(((counts - expected) ** 2 / expected).sum())

    assert chi2(torch.tensor([0.75, 2 / math.sqrt(3), 3.0, 0.1875])) < CHI2_3DF_P001
    assert chi2(torch.tensor([1.5, 2.0, 3.0, 0.75])) > CHI2_3DF_P001  # Σ|A| alone is told apart
    assert chi2(torch.tensor([0.5, 1 / math.sqrt(3), 1.0, 0.25])) > CHI2_3DF_P001  # std alone too


# ---------------------------------------------------------------- advantages of replayed rows


@pytest.mark.fast
def test_recomputed_advantages_match_hand_computed_values():
    buf = buffer("uniform", ratio=0.9, advantage="recompute")
    # prompt 7 (also in the fresh batch): rewards 1, 0; prompt 8: one row; prompt 9: two equal
    # rewards; prompt 10: rewards 1, 0 and not in the fresh batch. Stored advantages are markers.
    stored = rollouts(7, prompt_idx=[7, 7, 8, 9, 9, 10, 10], reward=[1, 0, 1, 1, 1, 1, 0],
                      advantage=[9, 9, 0.5, 0.3, 0.3, 9, 9])
    push(buf, stored, 0)
    fresh = rollouts(4, prompt_idx=7, group=0, reward=[0, 0, 0, 1], born=1, seed=1)
    out = replayed(buf.sample(fresh, 1))
    assert len(out) == 7
    got = {(p, r): a
           for p, r, a in zip(out.prompt_idx.tolist(), out.reward.tolist(), out.advantage.tolist())}

    def grpo_adv(r, ref):  # the row joins the reference rewards; unbiased std + 1e-6
        m = sum(ref) / len(ref)
        s = math.sqrt(sum((x - m) ** 2 for x in ref) / (len(ref) - 1))
        return (r - m) / (s + 1e-6)

    # = 0.6 / sqrt(0.3)
    assert got[(7, 1.0)] == pytest.approx(grpo_adv(1, [0, 0, 0, 1, 1]), rel=1e-6)
    # = -0.2 / sqrt(0.2)
    assert got[(7, 0.0)] == pytest.approx(grpo_adv(0, [0, 0, 0, 1, 0]), rel=1e-6)
    # from the buffer: the prompt's stored rows
    assert got[(10, 1.0)] == pytest.approx(grpo_adv(1, [1, 0]), rel=1e-6)
    assert got[(10, 0.0)] == pytest.approx(grpo_adv(0, [1, 0]), rel=1e-6)
    # < 2 rewards / no spread: stored
    assert got[(8, 1.0)] == pytest.approx(0.5) and got[(9, 1.0)] == pytest.approx(0.3)
    # the store keeps the advantage at birth
    assert torch.equal(buf.rows.advantage[:7], stored.advantage)

    # all-correct fresh group: a success adds nothing
    solved = rollouts(4, prompt_idx=7, group=0, reward=1.0, born=1, seed=1)
    out = replayed(buf.sample(solved, 1))
    assert out.advantage[(out.prompt_idx == 7) & (out.reward == 1)].tolist() == [0.0]

    buf = buffer("uniform", ratio=0.9)  # stored (default): the advantage at birth
    push(buf, stored, 0)
    assert (sorted(replayed(buf.sample(fresh, 1)).advantage.tolist())
            == sorted(stored.advantage.tolist()))


# ---------------------------------------------------------------- resume, metrics, config


@pytest.mark.fast
@pytest.mark.parametrize("strategy", BUILT_IN[1:])
def test_state_dict_round_trips_exactly(strategy):
    kw = {"capacity": 40, "ratio": 0.5, "tau_max": 3, "max_age": 5, "advantage": "recompute"}

    def prompts(step):
        return [step % 7, (step + 3) % 7, (step + 5) % 7]

    a = buffer(strategy, seed=3, **kw)
    for step in range(8):
        train_step(a, prompts(step), 4, step)
    saved = io.BytesIO()
    torch.save(a.state_dict(), saved)
    b = buffer(strategy, seed=99, **kw)  # a different seed: everything must come from the state
    b.load_state_dict(torch.load(io.BytesIO(saved.getvalue()), weights_only=True))
    assert b.metrics() == a.metrics() and len(b) == len(a) > 0
    replays = 0
    for step in range(8, 20):
        (mixed_a, out_a), (mixed_b, out_b) = (train_step(a, prompts(step), 4, step),
                                              train_step(b, prompts(step), 4, step))
        assert_same(mixed_a, mixed_b)
        assert_same(out_a, out_b)
        replays += int(out_a.replayed.sum())
        assert a.metrics() == b.metrics()
    assert replays > 0
    for k, v in a.state_dict().items():
        assert (torch.equal(v, b.state_dict()[k]) if torch.is_tensor(v)
                else v == b.state_dict()[k]), k


@pytest.mark.fast
def test_state_dict_is_a_copy():
    buf = buffer("uniform")
    push(buf, rollouts(3), 0)
    sd = buf.state_dict()
    push(buf, rollouts(3, seed=1), 1)
    assert int(sd["valid"].sum()) == 3 and sd["head"] == 3
    with pytest.raises(ValueError, match="replay state holds"):
        buffer("uniform", capacity=8).load_state_dict(sd)


@pytest.mark.fast
def test_metrics_are_prefixed_floats():
    buf = buffer("aper")
    push(buf, groups([0, 1], 4, correct=[1, 0, 0, 0, 1, 1, 0, 0]), 0)
    buf.sample(groups([2], 4, born=1), 1)
    m = buf.metrics()
    assert all(k.startswith("replay/") and isinstance(v, float) for k, v in m.items())
    assert m["replay/size"] == 8 and m["replay/sampled"] == 2 and m["replay/age_mean"] == 1.0
    assert (m["replay/replayed_share"] == pytest.approx(2 / 6)
            and m["replay/priority_max"] >= m["replay/priority_min"] > 0)


@pytest.mark.fast
@pytest.mark.parametrize("strategy", BUILT_IN)
def test_metrics_have_the_same_keys_every_step(strategy):
    buf = buffer(strategy, capacity=32)
    keys = set(buf.metrics())
    for step in range(6):
        train_step(buf, [step % 4, 4 + step % 3], 4, step)
        assert set(buf.metrics()) == keys


BAD_CONFIGS = [({"strategy": "fifo"},
                "replay.strategy must be one of none, uniform, aper, rlep, exgrpo, group"),
               ({"strategy": "aper", "tau_max": 0}, "replay.tau_max must be ≥ 1, got 0"),
               ({"strategy": "group", "tau_max": 0}, "replay.tau_max must be ≥ 1, got 0"),
               ({"strategy": "uniform", "ratio": 1.0},
                "replay.ratio must be in [0, 1) for uniform"),
               ({"strategy": "aper", "ratio": 5.0}, "replay.ratio must be in [0, 4] for aper"),
               ({"strategy": "exgrpo", "ratio": 1.0},
                "replay.ratio must be in [0, 1) for exgrpo"),
               ({"strategy": "exgrpo", "exgrpo_sigma": 0.0},
                "replay.exgrpo_sigma must be > 0, got 0.0"),
               ({"strategy": "exgrpo", "exgrpo_min_solve": 1.5},
                "replay.exgrpo_min_solve must be in [0, 1], got 1.5"),
               ({"strategy": "rlep", "rlep_n": 0}, "replay.rlep_n must be ≥ 1, got 0"),
               ({"strategy": "uniform", "max_age": -1}, "replay.max_age must be ≥ 0"),
               ({"advantage": "fresh"},
                "replay.advantage must be stored or recompute, got 'fresh'"),
               ({"capacity": 0}, "replay.capacity must be ≥ 1, got 0"),
               ({"module": "no_such_module"}, "replay.module must be a module name on sys.path"),
               ({"module": "replay.py"},
                "replay.module must be a module name on sys.path")]  # fmt: skip


@pytest.mark.fast
@pytest.mark.parametrize("bad,message", BAD_CONFIGS)
def test_bad_config_is_rejected(bad, message):
    assert not all(ok for ok, _ in ReplayConfig(**bad).check().values())
    assert rejected(**bad).startswith(message)
