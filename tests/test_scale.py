"""Performance and scale: the speed-ups change nothing the loss sees, the real-model settings run on CPU, and
torchrun data parallelism computes exactly the single-process update.

  python -m pytest tests/test_scale.py -q          # ~1-2 min on 2 CPU cores; a tiny random Qwen3, no model files needed

The torchrun tests start 2 processes with `python -m torch.distributed.run` (gloo backend, one thread each).
"""

import copy
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

import grpo
import train
from config import Config, load_config, validate
from data.build_tiny_model import build_tokenizer
from rollout import Rollouts, format_prompt, generate

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled",
       "TOKENIZERS_PARALLELISM": "false"}
LOSS_AGGS = ("dapo", "grpo", "dr_grpo")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread, as the configs use: a second thread on a shared 2-core machine mostly waits."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_qwen3(vocab_size: int, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=256, tie_word_embeddings=True)
    return AutoModelForCausalLM.from_config(cfg)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A randomly initialised 2-layer Qwen3 with the tiny character tokenizer, saved like any HF model."""
    out = tmp_path_factory.mktemp("qwen3")
    tok = build_tokenizer()
    model = tiny_qwen3(len(tok))
    model.config.pad_token_id, model.config.eos_token_id = tok.pad_token_id, tok.eos_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def synthetic_batch(vocab_size: int, n_prompts: int = 6, G: int = 4, n_replayed: int = 5, seed: int = 0) -> Rollouts:
    """Groups of G rows sharing a prompt (one group with equal rewards, so A = 0), plus stale replayed rows whose
    behaviour log-probs differ from the policy's (ratios away from 1, some clipped). Deterministic in `seed`."""
    g = torch.Generator().manual_seed(seed)
    rows = []  # (tokens, prompt_len, group, onpolicy)
    for i in range(n_prompts):
        prompt = torch.randint(4, vocab_size, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g)
        for _ in range(G):
            comp = torch.randint(4, vocab_size, (int(torch.randint(1, 11, (1,), generator=g)),), generator=g)
            rows.append((torch.cat([prompt, comp]), len(prompt), i, True))
    for k in range(n_replayed):
        seq, plen, _, _ = rows[int(torch.randint(len(rows), (1,), generator=g))]
        rows.append((seq, plen, 100 + k, False))
    B, L = len(rows), max(len(r[0]) for r in rows)
    tokens = torch.zeros(B, L, dtype=torch.long)
    for b, r in enumerate(rows):
        tokens[b, : len(r[0])] = r[0]
    prompt_len, seq_len = torch.tensor([r[1] for r in rows]), torch.tensor([len(r[0]) for r in rows])
    group, onpolicy = torch.tensor([r[2] for r in rows]), torch.tensor([r[3] for r in rows])
    t = torch.arange(L)[None]
    completion = (t >= prompt_len[:, None]) & (t < seq_len[:, None])
    behav = torch.where(completion, -torch.rand(B, L, generator=g) * 5, 0.0)
    reward = (torch.rand(B, generator=g) < 0.5).float()
    reward[:G] = 1.0  # group 0: every row right, advantage 0
    advantage, _ = grpo.group_advantages(reward, group)
    advantage[~onpolicy] = torch.randn(int((~onpolicy).sum()), generator=g)  # replayed rows keep their stored advantage
    zeros = torch.zeros(B)
    return Rollouts(tokens=tokens, prompt_len=prompt_len, seq_len=seq_len, behav_logp=behav, truncated=zeros.bool(),
                    prompt_idx=group.clone(), group=group, born=zeros.long(), reward=reward, correct=reward > 0,
                    advantage=advantage, entropy=zeros.clone(), replayed=~onpolicy, onpolicy=onpolicy)


def shard(batch: Rollouts, rank: int, world: int) -> Rollouts:
    """Rank `rank`'s rows, whole groups per rank as train.py's prompt sharding gives."""
    return batch.select(torch.nonzero(batch.group % world == rank).squeeze(1))


def update_cfg(loss_agg: str) -> Config:
    cfg = Config()
    cfg.grpo.loss_agg, cfg.rollout.max_new_tokens, cfg.rollout.temperature = loss_agg, 10, 0.9
    cfg.optim.micro_batch_size, cfg.optim.grad_clip = 3, 0.0  # several micro-batches; no clipping, so the step is the gradient
    return cfg


def one_update(policy, model, batch: Rollouts, cfg: Config, **kw) -> tuple[float, torch.Tensor, dict]:
    """train.update_policy with SGD at lr 1: the parameter change is minus the gradient it applied."""
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    metrics, entropy, reasons, _ = train.update_policy(cfg, policy, opt, sched, batch, device=torch.device("cpu"), **kw)
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert reasons == [None]
    return metrics[0]["loss"], before - after, {"metrics": metrics[0], "entropy": entropy}


# ---------------------------------------------------------------------------------------------- exactness of the speed-ups


def test_sampler_behaviour_logprobs_are_the_sampling_distribution(model_dir):
    tok = build_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    prompts = [format_prompt(tok, p, "{problem}") for p in ("1+1", "12*3", "what is 7/8 + 1/8?")]
    for temperature, top_p, batch_size in [(1.0, 1.0, 64), (0.7, 1.0, 5), (0.7, 0.8, 64)]:
        torch.manual_seed(0)
        ro, texts = generate(model, tok, prompts, 4, max_new_tokens=12, temperature=temperature, top_p=top_p, batch_size=batch_size)
        assert len(ro) == 12 and ro.group.tolist() == [0] * 4 + [1] * 4 + [2] * 4
        m = ro.completion_mask()
        teacher, _ = grpo.token_logprobs(model, ro.tokens, ro.attention_mask(), temperature)
        if top_p == 1:  # the recorded log-prob is the model's at temperature T (early-dropped rows and copied caches included)
            torch.testing.assert_close(ro.behav_logp[m], teacher[m], atol=2e-5, rtol=0)
        else:  # the nucleus renormalises: log μ ≥ log π_T, equal where the nucleus holds every token
            assert (ro.behav_logp[m] >= teacher[m] - 2e-5).all()
        assert (ro.behav_logp[~m] == 0).all()
        for i in range(len(ro)):
            comp = ro.tokens[i, ro.prompt_len[i] : ro.seq_len[i]]
            assert tok.decode(comp, skip_special_tokens=True) == texts[i]
            assert bool(ro.truncated[i]) == (comp[-1] != tok.eos_token_id) and (comp[:-1] != tok.eos_token_id).all()
            assert not ro.truncated[i] or len(comp) == 12


def test_completion_logprobs_share_prompts_exactly():
    model = tiny_qwen3(60, seed=1).double()
    b = synthetic_batch(60)
    b = b.select(torch.randperm(len(b), generator=torch.Generator().manual_seed(0)))  # groups not adjacent
    m = b.completion_mask()
    full, full_ent = grpo.token_logprobs(model, b.tokens, b.attention_mask(), 0.8, with_entropy=True)
    shared, shared_ent = grpo.completion_logprobs(model, b.tokens, b.prompt_len, b.seq_len, 0.8, with_entropy=True)
    torch.testing.assert_close(shared, torch.where(m, full, 0.0), atol=1e-10, rtol=0)
    torch.testing.assert_close(shared_ent, torch.where(m, full_ent, 0.0), atol=1e-10, rtol=0)
    w = torch.randn(b.tokens.shape, dtype=torch.float64)
    params = list(model.parameters())
    g_full = torch.autograd.grad(((full + full_ent) * m * w).sum(), params)
    g_shared = torch.autograd.grad(((shared + shared_ent) * w).sum(), params)
    for x, y in zip(g_full, g_shared, strict=True):  # Qwen3's RMSNorm computes in float32 even in a float64 model: float32-level agreement
        assert (x - y).norm() <= 1e-5 * x.norm()


def test_skipping_zero_advantage_rows_leaves_the_update_unchanged():
    batch = synthetic_batch(60)
    assert (batch.advantage == 0).sum() >= 4
    for agg in LOSS_AGGS:
        cfg = update_cfg(agg)
        m_all, m_skip = tiny_qwen3(60), tiny_qwen3(60)
        cfg.optim.skip_zero_adv = False
        loss_all, grad_all, _ = one_update(m_all, m_all, batch, cfg)
        cfg.optim.skip_zero_adv = True
        loss_skip, grad_skip, out = one_update(m_skip, m_skip, batch, cfg)
        assert loss_skip == pytest.approx(loss_all, abs=1e-6)
        torch.testing.assert_close(grad_skip, grad_all, atol=1e-6, rtol=1e-5)
        assert out["entropy"][batch.advantage == 0].isnan().all() and not out["entropy"][batch.advantage != 0].isnan().any()


# ---------------------------------------------------------------------------------------------- real-model settings


@pytest.mark.parametrize("setting", ["bf16_weights", "autocast", "gradient_checkpointing", "compile", "small_batches"])
def test_real_model_settings_update(setting):
    """Each GPU setting through the real update code on a tiny random Qwen3, against the float32 default."""
    batch = synthetic_batch(60)
    cfg = update_cfg("dapo")
    ref_model = tiny_qwen3(60)
    loss_ref, grad_ref, _ = one_update(ref_model, ref_model, batch, cfg)
    model, kw, tol = tiny_qwen3(60), {}, 1e-5
    policy = model
    if setting == "bf16_weights":
        model.to(torch.bfloat16)
        tol = 0.05
    elif setting == "autocast":
        kw["autocast"] = torch.autocast("cpu", dtype=torch.bfloat16)
        tol = 0.05
    elif setting == "gradient_checkpointing":
        cfg.model.gradient_checkpointing = True
        model.gradient_checkpointing_enable()
    elif setting == "compile":  # inductor's C++ codegen takes minutes on a loaded CPU; dynamo tracing is what our code meets
        policy = torch.compile(model, backend="eager")
        cfg.optim.micro_batch_size = 64  # one micro-batch: fewer shapes to trace
    elif setting == "small_batches":
        cfg.optim.micro_batch_size, cfg.optim.logprob_batch_size, cfg.optim.minibatches = 1, 2, 1
    loss, grad, out = one_update(policy, model, batch, cfg, **kw)
    assert loss == pytest.approx(loss_ref, abs=tol * 10)
    assert (grad.float() - grad_ref).norm() <= tol * 10 * grad_ref.norm()
    assert torch.isfinite(torch.tensor(out["metrics"]["entropy"]))


def test_real_model_settings_run_train(model_dir, tmp_path, monkeypatch):
    """train.py end to end with every real-model key on (bf16 weights, gradient checkpointing, torch.compile, separate
    generation / log-prob / training batch sizes, two optimizer steps per batch), in-process on the random Qwen3."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    cfg = load_config("configs/tiny.yaml", [
        f"--model.path={model_dir}", f"--out_dir={tmp_path / 'run'}", "--max_steps=2", "--rollout.batch_size=16",
        "--rollout.group_size=4", "--rollout.max_new_tokens=8", "--rollout.gen_batch_size=8", "--optim.micro_batch_size=3",
        "--optim.logprob_batch_size=5", "--optim.minibatches=2", "--model.dtype=bfloat16", "--model.gradient_checkpointing=true",
        "--model.compile=true", "--eval.n=4", "--eval.k=1", "--checkpoint.every=0", "--wandb.mode=disabled",
        "--reward.no_answer=-1", "--reward.last_number_fallback=true",
    ])
    validate(cfg)
    train.train(cfg)
    rows = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("generate", "reward", "advantage", "replay_sample", "prox_logprobs", "forward_backward", "optimizer",
                "replay_push", "other", "step"):
        assert f"time/{key}" in rows[0], key
    assert rows[0]["time/prox_logprobs"] > 0, "minibatches=2 computes π_prox"


# ---------------------------------------------------------------------------------------------- torchrun


def torchrun(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *args]
    p = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=timeout, check=False)
    assert p.returncode == 0, p.stderr[-4000:]
    return p


def ddp_worker(model_dir: str, out: str) -> None:
    """Under torchrun: each rank runs train.update_policy on its shard of the synthetic batch inside DDP, as train.py
    wraps it, and writes the loss and the applied update."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    batch = synthetic_batch(base.config.vocab_size)
    result = {}
    for agg in LOSS_AGGS:
        model = copy.deepcopy(base)
        policy = torch.nn.parallel.DistributedDataParallel(model)
        policy.broadcast_buffers = False  # as train.py
        loss, delta, _ = one_update(policy, model, shard(batch, rank, world), update_cfg(agg))
        result[agg] = {"loss": loss, "grad": delta.tolist()}
    Path(f"{out}.rank{rank}").write_text(json.dumps(result))
    dist.destroy_process_group()


def test_torchrun_first_update_equals_single_process(model_dir, tmp_path):
    out = tmp_path / "ddp.json"
    torchrun(__file__, "--ddp-worker", str(model_dir), str(out))
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    batch = synthetic_batch(base.config.vocab_size)
    ranks = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(2)]
    assert len(shard(batch, 0, 2)) != len(shard(batch, 1, 2)), "ranks hold different numbers of rows (and micro-batches)"
    for agg in LOSS_AGGS:
        model = copy.deepcopy(base)
        loss, grad, _ = one_update(model, model, batch, update_cfg(agg))
        for r in ranks:  # both ranks applied the same update: the global batch's
            assert r[agg]["loss"] == pytest.approx(loss, abs=1e-5), agg
            torch.testing.assert_close(torch.tensor(r[agg]["grad"]), grad, atol=1e-5, rtol=0)
        assert grad.abs().max() > 1e-3


def test_torchrun_train_logs_on_rank0_checkpoints_and_resumes(model_dir, tmp_path):
    out = tmp_path / "run"
    common = ["train.py", "--config", "configs/tiny.yaml", f"--model.path={model_dir}", f"--out_dir={out}", "--rollout.batch_size=16",
              "--rollout.group_size=4", "--rollout.max_new_tokens=8", "--eval.n=4", "--eval.k=1", "--eval.every=1",
              "--checkpoint.every=1", "--replay.strategy=aper", "--reward.no_answer=-1", "--reward.last_number_fallback=true",
              "--threads=1", "--wandb.mode=disabled"]
    torchrun(*common, "--max_steps=2")
    state = torch.load(out / "checkpoints" / "step_000001" / "trainer_state.pt", weights_only=True)
    assert len(state["ranks"]) == 2 and state["ranks"][0]["rng"]["torch"].ne(state["ranks"][1]["rng"]["torch"]).any()
    torchrun(*common, "--max_steps=3", "--resume")
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3], "one line per step: rank 0 alone writes"
    assert all("eval/accuracy" in r for r in rows)
    assert rows[-1]["generated_tokens"] > rows[0]["generated_tokens"] > 0
    assert json.loads((out / "summary.json").read_text())["steps"] == 3


if __name__ == "__main__" and sys.argv[1:2] == ["--ddp-worker"]:
    ddp_worker(*sys.argv[2:4])
