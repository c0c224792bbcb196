"""Unit tests for methods/greso.py (prompt skipping) and methods/stages.py (staged rollouts):
hand-computed skip probabilities on made-up traces, the p nudge and its clamps, choose()'s
replacement in data order, exact resume, and the stage rule on every pattern of stage-1 results."""

import io
import itertools

import pytest
import torch

from methods import stages
from data.loaders import next_prompts
from methods.greso import PromptSkip, SkipConfig

ON = SkipConfig(enabled=True)  # (off, choose takes the next n and update learns nothing)
# a long run at p_min skips with 1 − 1e-9: never drawn as kept
SURE = SkipConfig(enabled=True, floor=1e-9)


def visit(sk, prompt, *means):
    """One update per mean, for one prompt; flat when the mean is 0 or 1 (0/1 rewards)."""
    for m in means:
        sk.update([prompt], torch.tensor([m]), torch.tensor([m in (0.0, 1.0)]))


def recorded(order, looked):
    """The prompts of `order`, each noted in `looked` as choose() takes it."""
    for i in order:
        looked.append(i)
        yield i


def make_skippable(sk, prompts):
    """Each listed prompt on a 20-visit easy run, p_easy at p_min: skipped for sure under SURE."""
    for i in prompts:
        visit(sk, i, *[1.0] * 20)
    sk.p_easy = sk.cfg.p_min


def test_greso_skip_prob_easy_run():
    sk = PromptSkip(ON, 4, seed=0)
    visit(sk, 0, 1.0, 0.99, 1.0)
    sk.p_easy = 0.5  # the updates moved it
    assert sk.skip_prob(0) == 1 - 0.5**3  # k = 3: 0.875
    visit(sk, 1, 1.0, 0.5, 1.0, 0.98)  # the 0.5 breaks the run: k = 2
    sk.p_easy = 0.5
    assert sk.skip_prob(1) == 1 - 0.5**2


def test_greso_skip_hard_run_only_when_last_visit_hard():
    sk = PromptSkip(ON, 4, seed=0)
    visit(sk, 0, 0.0, 0.0, 0.5)  # two hard visits, then one that is neither: no run
    visit(sk, 1, 0.0, 0.1, 0.0)  # k_h = 3
    visit(sk, 2, 1.0, 1.0, 0.0)  # the easy run ends; k_h = 1
    visit(sk, 3, 0.0, 1.0)  # the hard run ends; k_e = 1
    sk.p_easy, sk.p_hard = 0.5, 0.25
    assert sk.skip_prob(0) == 0.0
    assert sk.skip_prob(1) == 1 - 0.25**3
    assert sk.skip_prob(2) == 1 - 0.25
    assert sk.skip_prob(3) == 1 - 0.5
    assert int(sk.hard_run[0]) == 0 and int(sk.easy_run[0]) == 0


def test_greso_skip_floor():
    sk = PromptSkip(ON, 2, seed=0)
    visit(sk, 0, *[1.0] * 6)
    visit(sk, 1, *[1.0] * 7)
    sk.p_easy = 0.5
    assert sk.skip_prob(0) == 1 - 0.5**6  # 0.015625: above the floor
    assert sk.skip_prob(1) == 1 - 0.01  # 0.5^7 < 0.01: the floor keeps 1 % of visits


def test_greso_nudge_direction_and_clamp():
    sk = PromptSkip(ON, 6, seed=0)
    prompts = list(range(6))
    flat = torch.ones(6, dtype=torch.bool)
    # first visits: p holds still (GRESO: epoch 0)
    sk.update(prompts, torch.tensor([1.0, 0.0, 0.0, 0.5, 0.5, 0.5]), flat)
    assert (sk.p_easy, sk.p_hard) == (0.5, 0.5)
    # 1/6 easy ≥ 0.25/3: skip more easy (p down); 0 hard < 0.25·2/3: skip fewer hard (p up)
    sk.update(prompts, torch.tensor([1.0, 0.5, 0.5, 0.5, 0.5, 0.5]), flat)
    assert sk.p_easy == pytest.approx(0.49) and sk.p_hard == pytest.approx(0.51)
    # 0 easy: p_easy up; 1/6 hard, exactly the hard target: at target counts as above (GRESO ≥)
    sk.update(prompts, torch.tensor([0.0, 0.5, 0.5, 0.5, 0.5, 0.5]), flat)
    assert sk.p_easy == pytest.approx(0.50) and sk.p_hard == pytest.approx(0.50)
    # an easy mean in a group that is not flat is not counted as a flat-easy group
    sk.update(prompts, torch.tensor([0.99, 0.5, 0.5, 0.5, 0.5, 0.5]), ~flat)
    assert sk.p_easy == pytest.approx(0.51)
    assert sk.metrics()["greso/flat_easy"] == 0.0
    # clamps at p_min and p_max
    sk.p_easy, sk.p_hard = 0.055, 0.945
    sk.update(prompts, torch.tensor([1.0, 0.5, 0.5, 0.5, 0.5, 0.5]), flat)
    assert sk.p_easy == 0.05 and sk.p_hard == 0.95
    sk.update(prompts, torch.tensor([1.0, 0.5, 0.5, 0.5, 0.5, 0.5]), flat)
    assert sk.p_easy == 0.05 and sk.p_hard == 0.95
    sk.p_easy, sk.p_hard = 0.945, 0.055
    sk.update(prompts, torch.tensor([0.0, 0.0, 0.5, 0.5, 0.5, 0.5]), flat)
    assert sk.p_easy == 0.95 and sk.p_hard == 0.05
    m = sk.metrics()
    assert m["greso/flat_easy"] == 0.0 and m["greso/flat_hard"] == pytest.approx(2 / 6)
    assert (m["greso/p_easy"], m["greso/p_hard"]) == (0.95, 0.05)


def test_greso_nudge_targets_a_third_easy_two_thirds_hard():
    sk = PromptSkip(ON, 12, seed=0)
    prompts = list(range(12))
    flat = torch.ones(12, dtype=torch.bool)
    visit(sk, 0, 0.5)  # one prompt seen before: p may move from the next update on
    mean = torch.full((12,), 0.5)
    mean[0], mean[1] = 1.0, 0.0  # 1/12 flat easy, 1/12 flat hard
    sk.update(prompts, mean, flat)
    # 1/12 is the easy target 0.25/3 (at target: p_easy down); under 0.25·2/3 (p_hard up)
    assert sk.p_easy == pytest.approx(0.49) and sk.p_hard == pytest.approx(0.51)


def test_greso_unseen_prompts_never_skipped():
    N = 2000
    sk = PromptSkip(ON, N, seed=0)
    seen = list(range(0, N, 2))  # even prompts on an easy run; odd ones never visited
    sk.update(seen, torch.ones(len(seen)), torch.ones(len(seen), dtype=torch.bool))
    sk.p_easy, sk.p_hard = 1e-6, 1e-6  # below p_min on purpose: skip as much as possible
    assert sk.skip_prob(1) == 0.0
    looked, skipped, evens = [], 0, 0
    stream = recorded(range(N), looked)
    for _ in range(50):
        c = sk.choose(stream, 10)
        unseen = [i for i in looked if i % 2 == 1]
        assert set(unseen) <= set(c.prompts)
        skipped += c.skipped
        evens += len(looked) - len(unseen)
        looked.clear()
    assert skipped >= 0.95 * evens  # the seen ones were skipped (the floor keeps 1 %)


def test_greso_choose_replaces_skipped_by_next_in_order():
    sk = PromptSkip(SURE, 10, seed=0)
    make_skippable(sk, [1, 3, 4])
    order = iter(range(10))
    c = sk.choose(order, 5)
    assert c.prompts == [0, 2, 5, 6, 7] and c.consumed == 8 and c.skipped == 3
    assert sk.metrics()["greso/skipped"] == 3.0
    assert sk.choose(order, 2).prompts == [8, 9]  # the caller's order goes on where it stopped


def test_greso_choose_cap_takes_the_rest_unskipped():
    sk = PromptSkip(SkipConfig(enabled=True, floor=1e-9, max_scan=2), 20, seed=0)
    make_skippable(sk, range(20))
    c = sk.choose(iter(range(20)), 3)
    assert c.prompts == [6, 7, 8] and c.consumed == 9 and c.skipped == 6


def test_greso_state_dict_round_trip():
    N, n = 50, 8
    sk = PromptSkip(ON, N, seed=3)
    g = torch.Generator().manual_seed(1)
    run = torch.randint(0, 3, (N,), generator=g) / 2  # each prompt always 0, 0.5 or 1
    position = 0

    def step(s, position):
        c = s.choose((i % N for i in itertools.count(position)), n)
        s.update(c.prompts, run[c.prompts], run[c.prompts] != 0.5)
        return c, position + c.consumed

    for _ in range(18):
        _, position = step(sk, position)
    assert sk.p_easy != 0.5 and sk.p_hard != 0.5  # both p moved: their resume is tested
    buf = io.BytesIO()
    torch.save(sk.state_dict(), buf)
    buf.seek(0)
    resumed = PromptSkip(ON, N, seed=999)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    a, b = [], []
    pa = pb = position
    for _ in range(20):
        ca, pa = step(sk, pa)
        cb, pb = step(resumed, pb)
        a.append((ca, sk.p_easy, sk.p_hard))
        b.append((cb, resumed.p_easy, resumed.p_hard))
    assert a == b
    assert sum(c.skipped for c, _, _ in a) > 0  # the test exercised skipping
    with pytest.raises(ValueError, match="prompts"):
        PromptSkip(ON, N + 1, seed=0).load_state_dict(sk.state_dict())


def test_greso_config_check():
    assert all(ok for ok, _ in SkipConfig().check().values())
    bad = SkipConfig(p_init=0.99, easy=0.1, floor=0.0, max_scan=0).check()
    failed = sorted(k for k, (ok, _) in bad.items() if not ok)
    assert failed == ["easy", "floor", "max_scan", "p_init"]


def test_stage_rule_stops_exactly_all_correct_prompts():
    G, g1 = 8, 3
    patterns = [list(p) for p in itertools.product([False, True], repeat=g1)]  # all 8
    assert stages.next_counts([[]] * 3, G, g1) == [g1] * 3
    counts = stages.next_counts(patterns, G, g1)
    for p, more in zip(patterns, counts):
        assert more == (0 if all(p) else G - g1)
    assert counts.count(0) == 1
    filled = [p + [False] * more for p, more in zip(patterns, counts)]
    assert stages.next_counts(filled, G, g1) == [0] * len(patterns)  # two stages at most


def test_stage_off_and_bad_first():
    assert stages.next_counts([[], []], 8, 0) == [8, 8]
    assert stages.next_counts([[True] * 8, [False] * 8], 8, 0) == [0, 0]
    with pytest.raises(ValueError, match="G − 1 = 7"):
        stages.next_counts([[]], 8, 8)
    assert stages.StageConfig(first=-1).check()["first"][0] is False


def test_stage_unsolved_outcomes_and_metrics():
    correct = torch.tensor([True, False, False, True, True, False, False])  # (B,)
    group = torch.tensor([5, 7, 7, 5, 5, 9, 9])  # (B,)
    got = stages.outcomes(correct, group, [5, 7, 9])
    assert got == [[True, True, True], [False, False], [False, False]]
    assert stages.unsolved(got) == [False, True, True]
    m = stages.metrics([[True] * 2, [True, False, False, False], [False] * 4], G=4)
    assert m == {"stages/stopped": 1 / 3, "stages/unsolved": 1 / 3, "stages/sample_share": 10 / 12}


def test_skip_off_takes_the_next_n_of_the_data_order():
    """skip.enabled false (the default): the prompts are the data order itself
    (data.loaders.next_prompts, no draw); no PromptSkip is made (train.compose_rollout)."""
    got = next_prompts(iter(range(8)), 4)
    assert got.prompts == [0, 1, 2, 3] and got.consumed == 4 and got.skipped == 0
    order = iter(range(8))
    next_prompts(order, 3)
    assert next_prompts(order, 2).prompts == [3, 4], "the caller's order goes on where it stopped"
