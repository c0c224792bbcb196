"""Reuse inside a step (optim.epochs = E, GRPO's μ) and gradient gating (optim.gate): E = 1 is
the update as it was before epochs existed, bit for bit; E passes are E hand-run passes over the
same shuffles; π_old is fixed at the start of the step; torchrun's E = 2 update is one process's;
a gate crossing drops the update and stops the passes; a SIGKILLed E = 2 run resumes bit-exactly.

  python -m pytest -q tests/test_epochs.py -k "epochs or gate"   # ~4 min on 2 idle CPU cores
"""

import contextlib
import copy
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import test_checkpoint as reliability
import torch
from fixtures import worker_results, write_result
from test_scale import model_dir, shard, synthetic_batch, tiny_qwen3  # noqa: F401
from transformers import AutoModelForCausalLM

import grpo
from methods import compose_update
from config import Config, update_settings
from methods.gate import OutputGrad
from support.logprobs import completion_logprobs

BEFORE_EPOCHS = "c6970d2"  # main before optim.epochs: "today's update"
CPU = torch.device("cpu")


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def epochs_cfg(epochs: int, minibatches: int = 1, gate: float = 0.0,
               offpolicy: str = "behaviour") -> Config:
    cfg = Config()
    cfg.rollout.max_new_tokens, cfg.rollout.temperature = 10, 0.9
    cfg.optim.micro_batch_size, cfg.optim.grad_clip = 3, 1.0  # several micro-batches; clipping on
    cfg.optim.epochs, cfg.optim.minibatches, cfg.optim.gate = epochs, minibatches, gate
    cfg.grpo.offpolicy = offpolicy
    return cfg


def run_update(update_policy, model, batch, cfg, seed: int = 0, sgd: bool = False):
    """update_policy with AdamW (or SGD) from a fixed global RNG state: its outputs, the weights
    and the RNG state after, the optimizer."""
    params = model.parameters()
    opt = torch.optim.SGD(params, lr=1.0) if sgd else torch.optim.AdamW(params, lr=1e-2)
    torch.manual_seed(seed)
    metrics, entropy, reasons, _ = update_policy(cfg, model, model, opt, batch, CPU)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return metrics, entropy, reasons, weights, torch.get_rng_state(), opt


def new_update(cfg, *args):
    """Today's update, as train.py composes it for `cfg` (methods.compose_update: with
    optim.epochs > 1 methods/gate.reuse_update), called as the one before optim.epochs was (with
    the Config)."""
    return compose_update(cfg, {})(update_settings(cfg), *args)


def old_grpo():
    """grpo.py as it was before optim.epochs, read from git history, as a module of its own."""
    try:
        git = ["git", "show", f"{BEFORE_EPOCHS}:grpo.py"]
        done = subprocess.run(git, cwd=reliability.REPO, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip(f"no git history with {BEFORE_EPOCHS} here")
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"grpo_{BEFORE_EPOCHS}_{os.getpid()}.py"
    path.write_text(done.stdout)
    spec = importlib.util.spec_from_file_location(f"grpo_{BEFORE_EPOCHS}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
    finally:
        path.unlink()
    # The log-prob code moved on since (#24: the output layer in float32 chunks): compare the
    # update around it, with today's log-probs in both.
    module.completion_logprobs = completion_logprobs
    return module


# ------------------------------------------------------------------------------ E = 1 and E passes


@pytest.mark.parametrize("minibatches,offpolicy",
                         [(1, "behaviour"), (2, "behaviour"), (2, "decoupled")])
def test_epochs_1_is_bit_identical_to_the_update_before_epochs(minibatches, offpolicy):
    """Weights, metrics, entropies, skip reasons and the RNG stream after: equal, bit for bit."""
    base, batch = tiny_qwen3(300), synthetic_batch(300)
    cfg = epochs_cfg(1, minibatches, offpolicy=offpolicy)
    new = run_update(new_update, copy.deepcopy(base), batch, cfg)
    old = run_update(old_grpo().update_policy, copy.deepcopy(base), batch, cfg)
    assert new[2] == old[2] == [None] * minibatches
    assert all(torch.equal(new[3][k], old[3][k]) for k in old[3])
    moved = not torch.equal(old[3]["lm_head.weight"], base.state_dict()["lm_head.weight"])
    assert moved, "the update changed the weights"
    assert torch.equal(new[4], old[4]), "the same RNG draws"
    assert torch.equal(new[1].nan_to_num(-1), old[1].nan_to_num(-1))
    added = ("optim/", "rollout/", "tokens/")  # metrics new since (#47: the token passes)
    kept = {k: v for k, v in new[0].items() if not k.startswith(added)}
    assert kept.pop("rows") > 0  # the rows trained on (#42's update compute), new since
    assert kept == old[0]
    assert new[0]["optim/epochs_run"] == 1.0 and new[0]["optim/gated"] == 0.0


def hand_run(model, batch, cfg, perms: list[torch.Tensor]) -> dict:
    """The E passes written out: π_old from one no-grad forward at the start; per mini-batch one
    forward over its rows, the loss with its own totals, clip, SGD step; π_old = the forward (ratio
    1) before the first step. SGD, so that rounding (other micro-batches, other padding) stays
    rounding, where AdamW's first step is lr·sign(g)."""
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    T, n = cfg.rollout.temperature, cfg.optim.minibatches
    with torch.no_grad():
        old, _ = completion_logprobs(model, batch.tokens, batch.prompt_len, batch.seq_len, T)
    first = True
    for perm in perms:
        for rows in perm.tensor_split(n):
            mb = batch.select(rows)
            logp, _ = completion_logprobs(model, mb.tokens, mb.prompt_len, mb.seq_len, T)
            prox = None if first else old[rows, : mb.tokens.shape[1]]
            loss, _ = grpo.policy_loss(logp, mb.behav_logp, mb.advantage, mb.completion_mask(),
                                       mb.onpolicy, cfg.grpo, n_seqs=len(rows),
                                       n_tokens=int(mb.completion_len.sum()),
                                       max_new_tokens=cfg.rollout.max_new_tokens, prox_logp=prox)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
            opt.step()
            first = False
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("minibatches", [1, 2])
def test_epochs_2_equals_two_hand_run_passes_over_the_same_shuffles(minibatches):
    base, batch = tiny_qwen3(300), synthetic_batch(300)
    cfg = epochs_cfg(2, minibatches)
    model = copy.deepcopy(base)
    _, _, reasons, weights, _, _ = run_update(new_update, model, batch, cfg, 3, sgd=True)
    torch.manual_seed(3)  # the shuffles update_policy drew: one per pass, none for one mini-batch
    n = len(batch)
    perms = [torch.randperm(n) if minibatches > 1 else torch.arange(n) for _ in range(2)]
    if minibatches > 1:
        assert not torch.equal(perms[0], perms[1]), "each pass reshuffles"
    expected = hand_run(copy.deepcopy(base), batch, cfg, perms)
    assert reasons == [None] * 2 * minibatches
    for k in expected:
        torch.testing.assert_close(weights[k], expected[k], atol=1e-6, rtol=0, msg=k)
    one_pass = hand_run(copy.deepcopy(base), batch, cfg, perms[:1])
    second = (weights["lm_head.weight"] - one_pass["lm_head.weight"]).abs().max()
    assert second > 1e-3, "the second pass counts"


def test_epochs_first_minibatch_ratio_is_exactly_1_and_pi_old_stays_fixed(monkeypatch):
    """Every fresh row's ratio r = exp(logp − base) in the loss: exactly 1 in the first mini-batch
    of the first pass; not 1 in the first mini-batch of the second pass (π_old is the start of the
    step, not of the pass)."""
    base, batch = tiny_qwen3(300), synthetic_batch(300)
    fresh = batch.select(torch.nonzero(batch.onpolicy).squeeze(1))
    steps, real_loss, real_step = [[]], grpo.policy_loss, grpo._optimizer_step

    def loss_spy(logp, behav_logp, advantages, mask, onpolicy, cfg, **kw):
        prox = kw.get("prox_logp")
        base_ = logp.detach() if prox is None else prox  # policy_loss's base of fresh rows
        steps[-1].append(torch.exp(logp.detach() - base_)[mask.bool()])  # (tokens,)
        return real_loss(logp, behav_logp, advantages, mask, onpolicy, cfg, **kw)

    def step_spy(*a, **k):
        steps.append([])
        return real_step(*a, **k)

    monkeypatch.setattr(grpo, "policy_loss", loss_spy)
    monkeypatch.setattr(grpo, "_optimizer_step", step_spy)
    model, cfg = copy.deepcopy(base), epochs_cfg(2, 2)
    _, _, reasons, _, _, _ = run_update(new_update, model, fresh, cfg)
    assert reasons == [None] * 4 and len(steps) == 5 and steps[-1] == []
    first, second_pass = torch.cat(steps[0]), torch.cat(steps[2])
    assert first.numel() > 0 and torch.equal(first, torch.ones_like(first))
    assert (second_pass - 1).abs().max() > 1e-4


# ------------------------------------------------------------------------------------- the gate


def untied_twin(model):
    """The same network with the output projection untied: its own copy of the embedding matrix."""
    twin = copy.deepcopy(model)
    twin.config.tie_word_embeddings = False
    twin.lm_head.weight = torch.nn.Parameter(twin.model.embed_tokens.weight.detach().clone())
    return twin


def test_gate_measures_the_output_projections_share_of_a_tied_gradient():
    """‖G^T·H‖ from the hooks equals the .grad of an untied copy's lm_head (the output projection's
    share), and differs from the tied matrix's whole .grad (which adds the input embedding's)."""
    model, batch = tiny_qwen3(300), synthetic_batch(300)
    twin = untied_twin(model)
    head = OutputGrad(model)
    for m in (model, twin):
        logp, _ = completion_logprobs(m, batch.tokens, batch.prompt_len, batch.seq_len, 0.9)
        (logp * batch.advantage[:, None]).sum().backward()
    norm = head.pop_norm()
    head.close()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert norm == pytest.approx(float(twin.lm_head.weight.grad.norm()), rel=1e-5)
    assert abs(norm - float(model.lm_head.weight.grad.norm())) > 1e-3 * norm
    assert head.pop_norm() == 0.0, "popped: the next step starts from zero"


def test_gate_measures_a_frozen_output_layer():
    """LoRA freezes the base, lm_head included: the hooks measure the same gradient whether or not
    the weight gets a .grad (frozen: only the RMSNorm weights train)."""
    model, batch = tiny_qwen3(300), synthetic_batch(300)
    norms = []
    for frozen in (False, True):
        m = copy.deepcopy(model)
        for name, p in m.named_parameters():
            p.requires_grad_(not frozen or "norm" in name)
        head = OutputGrad(m)
        logp, _ = completion_logprobs(m, batch.tokens, batch.prompt_len, batch.seq_len, 0.9)
        (logp * batch.advantage[:, None]).sum().backward()
        norms.append(head.pop_norm())
        head.close()
    assert m.lm_head.weight.grad is None and m.model.norm.weight.grad is not None
    assert norms[1] == pytest.approx(norms[0], rel=1e-6) and norms[0] > 0


def test_gate_forced_crossing_skips_the_update_and_stops_the_epochs():
    """gate = 1e-9: the first reuse step crosses; it is dropped (weights and AdamW state as after
    E = 1's single step) and the passes stop; the metrics say so."""
    base, batch = tiny_qwen3(300), synthetic_batch(300)
    def update(cfg):
        return run_update(new_update, copy.deepcopy(base), batch, cfg)

    gated, single = update(epochs_cfg(4, gate=1e-9)), update(epochs_cfg(1))
    open_gate = update(epochs_cfg(4, gate=1e6))
    metrics, reasons = gated[0], gated[2]
    assert reasons == [None, "gated"], "stopped at the first reuse step: no third or fourth pass"
    assert metrics["optim/gated"] == 1.0 and metrics["optim/epochs_run"] == 1.0
    assert metrics["optim/lm_head_grad_ratio_max"] > 0 and metrics["optim/lm_head_grad_norm"] > 0
    assert metrics["tokens"] == single[0]["tokens"], "the dropped step trained no token"
    assert all(torch.equal(gated[3][k], single[3][k]) for k in single[3])
    moments = [[s["exp_avg"] for s in run[5].state.values()] for run in (gated, single)]
    assert all(torch.equal(a, b) for a, b in zip(*moments)), "AdamW never saw the dropped gradient"
    assert open_gate[2] == [None] * 4 and open_gate[0]["optim/epochs_run"] == 4.0
    assert open_gate[0]["optim/gated"] == 0.0


def test_gate_with_two_minibatches_refers_to_the_first_step_and_gates_passes_2_on(monkeypatch):
    """Guards the gate with optim.minibatches = 2 and E = 3: the reference is pass 1's FIRST
    optimizer step's lm_head norm (not its last), pass 1's own steps are never gated however
    large, and a crossing in pass 2 drops that step and stops every remaining one."""
    base, batch = tiny_qwen3(300), synthetic_batch(300)
    real, seen = OutputGrad.pop_norm, []

    def spy(self):  # the real norms, recorded
        seen.append(real(self))
        return seen[-1]

    monkeypatch.setattr(OutputGrad, "pop_norm", spy)
    cfg = epochs_cfg(3, minibatches=2, gate=1e6)
    metrics, _, reasons, *_ = run_update(new_update, copy.deepcopy(base), batch, cfg)
    assert reasons == [None] * 6 and len(seen) == 6 and seen[0] != seen[1]
    ratio = max(seen[2:]) / seen[0]
    assert metrics["optim/lm_head_grad_ratio_max"] == pytest.approx(ratio, rel=1e-6)
    scripted = iter([1.0, 5.0, 3.0, 0.5, 0.5, 0.5])  # pass 1: 1, 5; pass 2: 3 > 2 × 1
    monkeypatch.setattr(OutputGrad, "pop_norm", lambda self: real(self) * 0 + next(scripted))
    cfg = epochs_cfg(3, minibatches=2, gate=2.0)
    metrics, _, reasons, *_ = run_update(new_update, copy.deepcopy(base), batch, cfg)
    assert reasons == [None, None, "gated"], "pass 1 never gated; the crossing stops the rest"
    assert metrics["optim/gated"] == 1.0 and metrics["optim/lm_head_grad_ratio_max"] == 3.0


def test_gate_validation_needs_epochs():
    from config import validate

    cfg = Config()
    cfg.optim.gate = 2.0
    with pytest.raises(ValueError, match="optim.gate must be 0 .off., or > 0 with optim.epochs"):
        validate(cfg)
    cfg.optim.epochs = 2
    validate(cfg)


@reliability.needs_model
def test_gate_crossing_shows_in_the_run_metrics(tmp_path):
    args = ("--optim.epochs=3", "--optim.gate=1e-9", "--replay.strategy=none")
    rows = reliability.run_in_process(tmp_path / "run", *args)
    assert [r["optim/gated"] for r in rows] == [1.0, 1.0]
    assert [r["optim/epochs_run"] for r in rows] == [1.0, 1.0]
    assert [r["skipped/gated"] for r in rows] == [1, 2]
    assert all(r["optim/lm_head_grad_norm"] > 0 for r in rows)


@reliability.needs_model
@pytest.mark.parametrize("args,passes", [
    (("--optim.epochs=2", "--optim.minibatches=2"), 2),
    (("--optim.epochs=3", "--optim.minibatches=2", "--optim.gate=1e-9"), 1)])
def test_trained_rows_count_every_pass_and_mini_batch(tmp_path, monkeypatch, args, passes):
    """Guards the count of trained rows (grpo update's `rows`, train.py's trained_rows, the
    summary's rows_trained) with 2 mini-batches: each row with a gradient (advantage ≠ 0, not
    masked) counts once per pass that applied, summed over the mini-batches; a gated pass adds
    none. Counted here from the batches the update was given."""
    real, want = grpo.start_update, []

    def counted(s, model, policy, optimizer, batch, *a, **k):
        trained = ~batch.truncated if s.mask_truncated else torch.ones(len(batch), dtype=bool)
        want.append(passes * int((trained & (batch.advantage != 0)).sum()))
        return real(s, model, policy, optimizer, batch, *a, **k)

    monkeypatch.setattr(grpo, "start_update", counted)  # every update starts with it
    rows = reliability.run_in_process(tmp_path / "run", *args, "--replay.strategy=none")
    assert [r["optim/epochs_run"] for r in rows] == [passes] * 2 and all(want)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["rows_trained"] == sum(want)


# ------------------------------------------------------------------------------------- torchrun


def worker(mode: str, folder: str, out: str) -> None:
    """Under torchrun: each rank updates on its shard with E = 2 (gate measured, open) and E = 4
    (gate forced closed), the model wrapped as train.py wraps it; writes the updates and metrics."""
    import torch.distributed as dist

    from support import parallel
    from support.models import load_policy

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    result = {}
    for name, cfg in (("open", epochs_cfg(2, gate=1e6)), ("forced", epochs_cfg(4, gate=1e-9))):
        cfg.model.path, cfg.model.parallel = folder, mode
        model, policy, _, _, compute = load_policy(cfg, folder, CPU, world)
        batch = shard(synthetic_batch(model.config.vocab_size), rank, world)
        delta, metrics, reasons = sgd_update(policy, model, batch, cfg, compute)
        result[name] = {"delta": delta.tolist(), "metrics": metrics, "reasons": reasons}
    write_result(out, result)
    del model, policy  # DDP's wrapper goes before its process group
    parallel.close()


def sgd_update(policy, model, batch, cfg, compute=None):
    """update_policy with SGD at lr 0.1; the change of the full weights (FSDP's shards gathered)."""
    from torch.distributed.tensor import DTensor

    def flat():
        full = [p.full_tensor() if isinstance(p, DTensor) else p for p in model.parameters()]
        return torch.cat([p.detach().flatten().clone() for p in full])

    before = flat()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    update = compose_update(cfg, {})  # with optim.epochs > 1: methods/gate.reuse_update
    metrics, _, reasons, _ = update(update_settings(cfg), model, policy, opt, batch, CPU,
                                    compute or contextlib.nullcontext())
    return before - flat(), metrics, reasons


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_torchrun_epochs_2_update_equals_single_process(model_dir, tmp_path, mode):  # noqa: F811
    out = tmp_path / f"{mode}.json"
    ranks = worker_results(__file__, mode, str(model_dir), out=out)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    batch = synthetic_batch(base.config.vocab_size)
    assert len(shard(batch, 0, 2)) != len(shard(batch, 1, 2)), "the ranks' row counts differ"
    for name, cfg in (("open", epochs_cfg(2, gate=1e6)), ("forced", epochs_cfg(4, gate=1e-9))):
        model = copy.deepcopy(base)
        delta, metrics, reasons = sgd_update(model, model, batch, cfg)
        assert reasons == ([None, None] if name == "open" else [None, "gated"])
        keys = ("loss", "optim/lm_head_grad_norm", "optim/lm_head_grad_ratio_max")
        for r in ranks:  # both ranks applied the global batch's update and took the same decision
            assert r[name]["reasons"] == reasons
            torch.testing.assert_close(torch.tensor(r[name]["delta"]), delta, atol=1e-5, rtol=0)
            for k in keys:
                assert r[name]["metrics"][k] == pytest.approx(metrics[k], abs=1e-5), (name, k)
        assert delta.abs().max() > 1e-3


# --------------------------------------------------------------------------------------- resume


@pytest.mark.fast
@pytest.mark.long
@reliability.needs_model
def test_epochs_2_sigkill_then_resume_is_bit_identical(tmp_path):
    """E = 2 over 2 shuffled mini-batches, gate on: a run SIGKILLed after step 3 and resumed from
    its step-2 checkpoint logs the same lines and ends with the same weights as an uninterrupted
    one."""
    args = ("--optim.epochs=2", "--optim.minibatches=2", "--optim.gate=1.5")
    ref, out = tmp_path / "ref", tmp_path / "run"
    r = reliability.run_train(ref, *args)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(ln) for ln in (ref / "metrics.jsonl").read_text().splitlines()]
    assert any(row["optim/epochs_run"] == 2.0 for row in rows), "the passes ran"
    r = reliability.kill_after_step_then_resume(out, args)
    assert "resuming from" in r.stderr
    reliability.assert_same_run(ref, out)


def test_epochs_arms_have_their_own_compare_label(tmp_path):
    """eval.py --compare puts a reuse run in an arm of its own, never in the `none` baseline."""
    import yaml

    from analysis.compare import load_run

    cases = [(1, 0.0, "none", "none"), (2, 0.0, "none", "epochs2"),
             (4, 1.0, "none", "epochs4+gate"), (2, 0.0, "aper", "aper+epochs2")]
    for epochs, gate, strategy, label in cases:
        run = tmp_path / label
        run.mkdir()
        (run / "summary.json").write_text(json.dumps({"strategy": strategy, "seed": 0}))
        config = {"replay": {"strategy": strategy}, "optim": {"epochs": epochs, "gate": gate}}
        (run / "config.yaml").write_text(yaml.safe_dump(config))
        (run / "metrics.jsonl").write_text('{"step": 1, "generated_tokens": 10}\n')  # (a row: #49)
        assert load_run(run)["strategy"] == label


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    worker(*sys.argv[2:5])

