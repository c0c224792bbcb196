"""methods/lookahead.py (lookahead.method: SFPO, GXPO) and the update's token passes: the
reposition and the extrapolation against values worked by hand; SFPO's fast passes are optim.epochs'
passes and its slow pass starts from the repositioned point; AdamW's state runs on through every
pass; the degenerate settings are GRPO bit for bit through train.py; a run SIGKILLed inside the
passes resumes bit-exactly; tokens/fwd_bwd and tokens/no_grad equal the positions the model's
forwards ran, counted by a hook.

  python -m pytest -q tests/test_lookahead.py      # ~3 min on 2 idle CPU cores
"""

import copy
import json

import pytest
import test_checkpoint as reliability
import torch
from test_epochs import CPU, epochs_cfg
from test_scale import synthetic_batch, tiny_qwen3

import grpo
from config import ConfigError, load_config, update_settings, validate
from support import parallel
from methods import lookahead
from methods.lookahead import GXPO, SFPO, LookaheadConfig, lookahead_factor, reposition

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_reposition_is_theta0_plus_alpha_times_the_fast_move():
    p = [torch.tensor([1.0, 2.0, -4.0])]
    p0 = [torch.tensor([0.0, 4.0, -4.0])]
    reposition(p, p0, 0.8)
    torch.testing.assert_close(p[0], torch.tensor([0.8, 2.4, -4.0]), rtol=0, atol=1e-6)
    q = [torch.tensor([3.0, -1.0])]
    reposition(q, [torch.tensor([0.5, 0.25])], 0.0)
    assert torch.equal(q[0], torch.tensor([0.5, 0.25])), "α = 0 is θ0 exactly"


def test_gxpo_factor_by_hand():
    """r = g1/g0 per coordinate; q = S_5(r)/S_2(r) clamped to [1, 3.5]; no signal: q = 1."""
    g0 = torch.tensor([1.0, 1.0, 0.0, -2.0, 1.0, 1.0])
    g1 = torch.tensor([0.5, -1.0, 1.0, -1.0, 10.0, -0.5])
    q = lookahead_factor(g0, g1, 5)
    half = (1 + 0.5 + 0.25 + 0.125 + 0.0625) / 1.5  # r = 0.5
    neg = (1 - 0.5 + 0.25 - 0.125 + 0.0625) / 0.5  # r = −0.5: 1.375
    # r = −1: S_2 = 0, q = 1; g0 = 0: no signal; r = 10 is clamped to 3: 121/4, then to 3.5
    expected = torch.tensor([half, 1.0, 1.0, half, 3.5, neg])
    torch.testing.assert_close(q, expected, rtol=0, atol=1e-6)


def sfpo_settings(K: int, alpha: float):
    cfg = epochs_cfg(1)
    cfg.lookahead.method, cfg.lookahead.fast_steps, cfg.lookahead.alpha = "sfpo", K, alpha
    return cfg


def test_sfpo_fast_passes_are_epochs_then_the_reposition_then_one_slow_pass(monkeypatch):
    """SFPO K = 3 against optim.epochs = 3 from the same start: the same θ3 (bit for bit), then
    θ̃ = θ0 + α(θ3 − θ0) exactly, then a fourth optimizer step from θ̃; AdamW's step count is
    K + 1 = 4 (its moments run on across the reposition)."""
    base, batch = tiny_qwen3(300), synthetic_batch(300)
    epochs = copy.deepcopy(base)
    opt = torch.optim.AdamW(epochs.parameters(), lr=1e-2)
    grpo.update_policy(update_settings(epochs_cfg(3)), epochs, epochs, opt, batch, CPU)
    theta3 = {k: v.detach().clone() for k, v in epochs.named_parameters()}

    model = copy.deepcopy(base)
    theta0 = {k: v.detach().clone() for k, v in model.named_parameters()}
    seen = {}
    real = lookahead.reposition

    def spy(params, start, alpha):
        seen["fast"] = {k: v.detach().clone() for k, v in model.named_parameters()}
        real(params, start, alpha)
        seen["repositioned"] = {k: v.detach().clone() for k, v in model.named_parameters()}

    monkeypatch.setattr(lookahead, "reposition", spy)
    cfg = sfpo_settings(3, 0.8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sfpo = SFPO(cfg.lookahead)
    metrics, _, reasons, _ = sfpo(update_settings(cfg), model, model, opt, batch, CPU)
    assert reasons == [None] * 4 and metrics["optim/epochs_run"] == 4.0
    for k, v in theta3.items():
        assert torch.equal(seen["fast"][k], v), f"fast passes differ from epochs=3 at {k}"
        expected = theta0[k] + 0.8 * (v - theta0[k])
        assert torch.equal(seen["repositioned"][k], expected), k
    moved = (model.lm_head.weight - seen["repositioned"]["model.embed_tokens.weight"]).abs().max()
    assert moved > 1e-4, "the slow pass steps from θ̃"
    steps = {int(s["step"]) for s in opt.state.values()}
    assert steps == {4}, "AdamW saw K + 1 steps"
    assert metrics["lookahead/active"] == 1.0


def test_gxpo_moves_from_theta0_by_alpha_q_times_two_fast_steps(monkeypatch):
    """GXPO: the corrective pass runs at θ̃ = θ0 + α·q⊙(θ2 − θ0), q from the raw (pre-clip)
    gradients of the two fast passes, taken here by a spy on the gradient clip."""
    model, batch = tiny_qwen3(300), synthetic_batch(300)
    batch.reward = torch.ones(len(batch))  # no zero rewards: GXPO is active
    cfg = epochs_cfg(1)
    cfg.lookahead.method, cfg.lookahead.fast_steps, cfg.lookahead.alpha = "gxpo", 5, 0.5
    theta0 = {k: v.detach().clone() for k, v in model.named_parameters()}
    grads, at = [], {}
    clip = torch.nn.utils.clip_grad_norm_

    def raw(params, *a, **k):
        grads.append({n: v.grad.detach().clone() for n, v in model.named_parameters()})
        return clip(params, *a, **k)

    gx = GXPO(cfg.lookahead)
    real_extrapolate = gx._extrapolate

    def extrapolate(*args):
        at["theta2"] = {n: v.detach().clone() for n, v in model.named_parameters()}
        real_extrapolate(*args)
        at["tilde"] = {n: v.detach().clone() for n, v in model.named_parameters()}

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", raw)
    monkeypatch.setattr(gx, "_extrapolate", extrapolate)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    metrics, _, reasons, _ = gx(update_settings(cfg), model, model, opt, batch, CPU)
    assert reasons == [None] * 3 and metrics["lookahead/active"] == 1.0
    assert len(grads) == 3
    spread = []
    for name, p0 in theta0.items():
        q = lookahead_factor(grads[0][name], grads[1][name], 5)
        expected = p0 + 0.5 * q * (at["theta2"][name] - p0)
        torch.testing.assert_close(at["tilde"][name], expected, rtol=0, atol=1e-7, msg=name)
        spread.append(float(q.max() - q.min()))
    assert max(spread) > 0.1, "q differs between coordinates"
    tilde = at["tilde"]["model.embed_tokens.weight"]
    assert not torch.equal(model.lm_head.weight, tilde), "the corrective pass stepped"
    assert {int(s["step"]) for s in opt.state.values()} == {3}, "AdamW saw the three passes"
    assert gx.stopped == (abs(metrics["lookahead/z"]) >= 0.5)


def passes(update, cfg, batch, model=None) -> int:
    """The optimizer steps (one mini-batch: passes) an update ran over `batch`."""
    model = model or tiny_qwen3(300)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _, _, reasons, _ = update(update_settings(cfg), model, model, opt, batch, CPU)
    return len(reasons)


def test_gxpo_falls_back_to_one_pass_on_a_mostly_failed_batch_and_after_its_switch():
    cfg = epochs_cfg(1)
    cfg.lookahead.method, cfg.lookahead.fast_steps, cfg.lookahead.alpha = "gxpo", 5, 0.5
    cfg.lookahead.gate_z = 1e5
    gx = GXPO(cfg.lookahead)
    batch = synthetic_batch(300)
    batch.reward = torch.zeros(len(batch))
    assert passes(gx, cfg, batch) == 1
    batch.reward = torch.ones(len(batch))
    assert passes(gx, cfg, batch) == 3
    gx.stopped = True
    assert passes(gx, cfg, batch) == 1


def test_gxpo_is_not_scored_on_a_step_with_nothing_to_learn_and_says_when_it_switches_off():
    """max_zero_share 1 and every advantage 0: the passes are all skipped, so the gradient norm
    (0) is not scored and GXPO stays on; a gate that fires says so in one line."""
    cfg = epochs_cfg(1)
    cfg.lookahead.method, cfg.lookahead.max_zero_share = "gxpo", 1.0
    said = []
    gx = GXPO(cfg.lookahead, said.append)
    batch = synthetic_batch(300)
    batch.reward = torch.zeros(len(batch))
    batch.advantage = torch.zeros(len(batch))
    assert passes(gx, cfg, batch) == 3 and not gx.stopped and not said
    cfg.lookahead.gate_z = 0.0  # any score switches it off
    gx = GXPO(cfg.lookahead, said.append)
    batch = synthetic_batch(300)
    batch.reward = torch.ones(len(batch))
    passes(gx, cfg, batch)
    assert gx.stopped and len(said) == 1 and "gxpo switched to plain GRPO" in said[0]


def test_entropy_surge_rule_by_hand():
    """z = (newest − mean) / (population std + 1e-9) over the last `window` entropies."""
    assert not lookahead.entropy_surged([1.0, 1.1, 0.9], 4, 1.0), "the window (4) is not full"
    assert lookahead.entropy_surged([1.0, 1.1, 0.9, 2.0], 4, 1.0)  # z = 0.75/0.43 = 1.73
    assert not lookahead.entropy_surged([1.0, 1.1, 0.9, 2.0], 4, 1.8)
    assert not lookahead.entropy_surged([1.0, 1.1, 0.9, 2.0], 0, 1.0), "window 0: never"


def test_sfpo_stop_rule_latches_on_an_entropy_surge():
    cfg = sfpo_settings(3, 0.8)
    cfg.lookahead.stop_window, cfg.lookahead.stop_z = 4, 1.0
    sf = SFPO(cfg.lookahead)
    batch = synthetic_batch(300)
    sf.entropies = [1.0, 1.1, 0.9]
    assert passes(sf, cfg, batch) == 4, "3 entropies: the window (4) is not full"
    sf.entropies = [1.0, 1.1, 0.9, 2.0]  # z = (2 − 1.25)/0.43 = 1.73
    assert passes(sf, cfg, batch) == 1 and sf.stopped
    sf.entropies = [1.0] * 4
    assert passes(sf, cfg, batch) == 1, "the stop is for good"


def test_token_passes_equal_the_positions_the_forwards_ran():
    """tokens/fwd_bwd: positions through forwards with grad; tokens/no_grad: without (π_old). A
    forward hook counts them; with gradient checkpointing every forward runs whole rows."""
    model, batch = tiny_qwen3(300), synthetic_batch(300)
    cfg = sfpo_settings(2, 0.8)
    cfg.model.gradient_checkpointing = True
    counts = {True: 0, False: 0}

    def hook(module, args, kwargs):
        mask = kwargs["attention_mask"]
        counts[torch.is_grad_enabled()] += int(mask[:, -kwargs["input_ids"].shape[1]:].sum())

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    try:
        metrics, _, _, _ = SFPO(cfg.lookahead)(update_settings(cfg), model, model, opt, batch,
                                               CPU)
    finally:
        handle.remove()
    assert metrics["tokens/fwd_bwd"] == counts[True] > 0
    assert metrics["tokens/no_grad"] == counts[False] > 0
    trained = int(batch.seq_len[batch.advantage != 0].sum())
    assert counts[True] == 3 * trained, "K + 1 = 3 passes over the rows with an advantage"


def test_sfpos_stop_latch_survives_a_checkpoint():
    """Once SFPO's stop has fired it holds for the rest of the run, also after --resume: the
    latch is in the state checkpoints save, even where the entropy window alone (flat here) would
    not fire again."""
    cfg = sfpo_settings(2, 0.8)
    cfg.lookahead.stop_window, cfg.lookahead.stop_z = 3, 2.0
    before = SFPO(cfg.lookahead)
    before.entropies, before.stopped = [0.5, 0.5, 0.5], True
    assert not lookahead.entropy_surged(before.entropies, 3, 2.0)
    after = SFPO(cfg.lookahead)
    after.load_state_dict(copy.deepcopy(before.state_dict()))
    model, batch = tiny_qwen3(300), synthetic_batch(300)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    metrics = after(update_settings(cfg), model, model, opt, batch, CPU)[0]
    assert after.stopped and metrics["lookahead/active"] == 0.0
    assert metrics["optim/epochs_run"] == 1.0  # one plain pass, not K + 1


def test_the_reference_models_pass_is_counted_in_no_grad_tokens():
    """With grpo.beta > 0 plain GRPO's one pass runs the reference once over the batch, no grad:
    tokens/no_grad counts exactly its positions (the compute comparisons' no-grad term), and none
    without it."""
    model, ref, batch = tiny_qwen3(300), tiny_qwen3(300, seed=1), synthetic_batch(300)
    cfg = epochs_cfg(1)
    cfg.grpo.beta = 0.04
    cfg.model.gradient_checkpointing = True  # every forward runs whole rows (as above)
    counts = {"policy": 0, "ref": 0}

    def counter(name):
        def hook(module, args, kwargs):
            if not torch.is_grad_enabled():
                mask = kwargs["attention_mask"]
                counts[name] += int(mask[:, -kwargs["input_ids"].shape[1]:].sum())
        return hook

    handles = [model.register_forward_pre_hook(counter("policy"), with_kwargs=True),
               ref.register_forward_pre_hook(counter("ref"), with_kwargs=True)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    try:
        metrics = grpo.update_policy(update_settings(cfg), model, model, opt, batch, CPU,
                                     ref=ref)[0]
    finally:
        for handle in handles:
            handle.remove()
    assert counts["policy"] == 0 and counts["ref"] > 0
    assert metrics["tokens/no_grad"] == counts["ref"]


def test_lookahead_rules_refuse_what_would_mean_something_else(tmp_path):
    for args, key in ((["--lookahead.method=sfpo", "--optim.epochs=2"], "lookahead.method"),
                      (["--lookahead.method=gxpo", "--lookahead.fast_steps=1"],
                       "lookahead.fast_steps"),
                      (["--lookahead.method=gxpo", "--rollout.batch_size=64",
                        "--optim.minibatches=2"], "lookahead.method"),
                      (["--lookahead.method=lookahead"], "lookahead.method"),
                      (["--lookahead.gate_ema=0"], "lookahead.gate_ema")):
        cfg = load_config("configs/tiny.yaml", args)
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            validate(cfg)


# ------------------------------------------------------------------------- through train.py

@reliability.needs_model
@pytest.mark.parametrize("degenerate,active", [
    (("--lookahead.method=sfpo", "--lookahead.fast_steps=0"), 1.0),  # θ0 kept, moved back by 0
    (("--lookahead.method=gxpo", "--lookahead.max_zero_share=0"), 0.0),  # a plain pass each step
])
def test_degenerate_lookahead_is_grpo_bit_for_bit(tmp_path, degenerate, active):
    """Through train.py: SFPO with no fast pass (its snapshot, reposition and slow pass all run)
    and GXPO falling back on every batch log GRPO's lines and end on its weights, bit for bit."""
    ref, out = tmp_path / "ref", tmp_path / "run"
    assert reliability.run_train(ref, steps=3).returncode == 0
    r = reliability.run_train(out, *degenerate, steps=3)
    assert r.returncode == 0, r.stderr[-2000:]
    a, b = reliability.metrics(ref), reliability.metrics(out)
    for row_a, row_b in zip(a, b, strict=True):
        assert row_b.pop("lookahead/active") == active
        assert row_a == row_b
    for k, v in reliability.weights(ref / "final").items():
        assert torch.equal(v, reliability.weights(out / "final")[k]), k


@pytest.mark.long
@reliability.needs_model
@pytest.mark.parametrize("method", ["sfpo", "gxpo"])
def test_lookahead_sigkill_inside_the_passes_then_resume_is_bit_identical(tmp_path, method):
    """SIGKILL during step 4 (its rollout or its passes; after step 3's line, the checkpoint is
    step 2's): the resumed run logs the same lines and ends on the same weights; the stop rule's
    state came back too (a window of 2 steps, so it is in play)."""
    # SFPO: a window of 2 and z ≥ 0.5 stop it at the first rise of entropy; GXPO: τ 0.5 (its z
    # starts from a mean and variance of 1, the tiny model's norm is ~0.4: it stops at once)
    args = (f"--lookahead.method={method}", "--lookahead.stop_window=2",
            "--lookahead.stop_z=0.5", "--lookahead.max_zero_share=1", "--lookahead.gate_z=0.5")
    ref, out = tmp_path / "ref", tmp_path / "run"
    r = reliability.run_train(ref, *args)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = reliability.metrics(ref)
    assert rows[0]["optim/epochs_run"] > 1, "the passes ran"
    active = [row["lookahead/active"] for row in rows]
    assert 1.0 in active[:4] and 0.0 in active[2:], f"the stop rule is in play: {active}"
    r = reliability.kill_after_step_then_resume(out, args)
    assert "step_000002 (step 2)" in r.stderr, "resumed from the step-2 checkpoint"
    reliability.assert_same_run(ref, out)
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 6


def test_lookahead_reads_the_float32_shards_after_a_forward_left_fsdps_root_gathered(tmp_path):
    """SFPO's θ0 and reposition, GXPO's moves, and the step's copy a stop puts back
    (support/preempt.StepStart) act on `support.parallel.trained(model)`: under FSDP2 the
    optimizer's float32 shards. A forward (a no-grad pass before the update) leaves the root
    unit's weights gathered, bf16 copies under mixed precision; read then, the root's weights
    (the tied embedding and output layer, the final norm) would be those copies, which the next
    backward drops. One process, FSDP2 as support/models.py applies it."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        model = tiny_qwen3(100)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for unit in [*model.model.layers, model]:
            fully_shard(unit, mp_policy=mp)
        shards = [p.to_local().data_ptr() for p in model.parameters()]
        with torch.no_grad():
            model(input_ids=torch.tensor([[5, 6, 7]]))
        assert any(p.dtype == torch.bfloat16 for p in model.parameters())  # the root, gathered
        got = parallel.trained(model)
        assert [t.data_ptr() for t in got] == shards
        assert all(t.dtype == torch.float32 for t in got)
    finally:
        dist.destroy_process_group()
