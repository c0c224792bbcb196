"""Performance and scale: the speed-ups change nothing the loss sees, the real-model settings run on
CPU, and torchrun data parallelism computes exactly the single-process update.

  python -m pytest tests/test_scale.py -q
  # ~1-2 min on 2 CPU cores; a tiny random Qwen3, no model files needed

The torchrun tests start 2 processes with `python -m torch.distributed.run` (gloo backend, one
thread each).
"""

import contextlib
import copy
import functools
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from fixtures import ENV, torchrun, worker_results, write_result
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, Qwen3Config

import grpo
import train
from config import Config, load_config, update_settings, validate
from data.build_tiny_model import build_tokenizer
from batch import Rollouts
from rollout import RolloutConfig, generate
from support.logprobs import completion_logprobs, token_logprobs
from support.models import load_policy
from support.prompts import end_ids, prompt_ids
from support.util import kill_tree, run_capped

from fixtures import REPO  # (tests/fixtures.py: the repository's root)
LOSS_AGGS = ("dapo", "grpo", "dr_grpo")


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def tiny_qwen3(vocab_size: int, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, max_position_embeddings=256, tie_word_embeddings=True)
    return AutoModelForCausalLM.from_config(cfg)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A randomly initialised 2-layer Qwen3 with the tiny character tokenizer, saved like any HF
    model."""
    out = tmp_path_factory.mktemp("qwen3")
    tok = build_tokenizer()
    model = tiny_qwen3(len(tok))
    model.config.pad_token_id, model.config.eos_token_id = tok.pad_token_id, tok.eos_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def synthetic_batch(vocab_size: int, n_prompts: int = 6, G: int = 4, n_replayed: int = 5,
                    seed: int = 0) -> Rollouts:
    """Groups of G rows sharing a prompt (one group with equal rewards, so A = 0), plus stale
    replayed rows whose behaviour log-probs differ from the policy's (ratios away from 1, some
    clipped). Deterministic in `seed`."""
    g = torch.Generator().manual_seed(seed)
    rows = []  # (tokens, prompt_len, group, onpolicy)
    for i in range(n_prompts):
        prompt = torch.randint(4, vocab_size, (int(torch.randint(3, 9, (1,), generator=g)),),
                               generator=g)
        for _ in range(G):
            comp = torch.randint(4, vocab_size, (int(torch.randint(1, 11, (1,), generator=g)),),
                                 generator=g)
            rows.append((torch.cat([prompt, comp]), len(prompt), i, True))
    for k in range(n_replayed):
        seq, plen, _, _ = rows[int(torch.randint(len(rows), (1,), generator=g))]
        rows.append((seq, plen, 100 + k, False))
    B, L = len(rows), max(len(r[0]) for r in rows)
    tokens = torch.zeros(B, L, dtype=torch.long)
    for b, r in enumerate(rows):
        tokens[b, : len(r[0])] = r[0]
    prompt_len, seq_len = (torch.tensor([r[1] for r in rows]),
                           torch.tensor([len(r[0]) for r in rows]))
    group, onpolicy = torch.tensor([r[2] for r in rows]), torch.tensor([r[3] for r in rows])
    t = torch.arange(L)[None]
    completion = (t >= prompt_len[:, None]) & (t < seq_len[:, None])
    behav = torch.where(completion, -torch.rand(B, L, generator=g) * 5, 0.0)
    reward = (torch.rand(B, generator=g) < 0.5).float()
    reward[:G] = 1.0  # group 0: every row right, advantage 0
    advantage, _ = grpo.group_advantages(reward, group)
    # replayed rows keep their stored advantage
    advantage[~onpolicy] = torch.randn(int((~onpolicy).sum()), generator=g)
    zeros = torch.zeros(B)
    return Rollouts(tokens=tokens, prompt_len=prompt_len, seq_len=seq_len, behav_logp=behav,
                    truncated=zeros.bool(), prompt_idx=group.clone(), group=group,
                    born=zeros.long(), reward=reward, correct=reward > 0,
                    advantage=advantage, entropy=zeros.clone(), replayed=~onpolicy,
                    onpolicy=onpolicy,
                    slot=torch.where(onpolicy, -1, torch.arange(B)))


def shard(batch: Rollouts, rank: int, world: int) -> Rollouts:
    """Rank `rank`'s rows, whole groups per rank as train.py's prompt sharding gives."""
    return batch.select(torch.nonzero(batch.group % world == rank).squeeze(1))


def update_cfg(loss_agg: str) -> Config:
    cfg = Config()
    cfg.grpo.loss_agg, cfg.rollout.max_new_tokens, cfg.rollout.temperature = loss_agg, 10, 0.9
    # several micro-batches; no clipping, so the step is the gradient
    cfg.optim.micro_batch_size, cfg.optim.grad_clip = 3, 0.0
    return cfg


def one_update(policy, model, batch: Rollouts, cfg: Config,
               compute=None) -> tuple[float, torch.Tensor, dict]:
    """grpo.update_policy with SGD at lr 1: the parameter change is minus the gradient it
    applied."""
    def flat():  # full weights, gathered from FSDP's shards
        return torch.cat([
            (p.full_tensor() if isinstance(p, DTensor) else p).detach().flatten().clone()
            for p in model.parameters()])

    before = flat()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    metrics, entropy, reasons, _ = grpo.update_policy(update_settings(cfg), model, policy, opt,
                                                      batch, torch.device("cpu"),
                                                      compute or contextlib.nullcontext())
    after = flat()
    assert reasons == [None]
    return metrics["loss"], before - after, {"metrics": metrics, "entropy": entropy}


# ----------------------------------------------------------------------- exactness of the speed-ups


def test_sampler_behaviour_logprobs_are_the_sampling_distribution(model_dir):
    tok = build_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    prompts = [prompt_ids(tok, p, "{problem}", True) for p in ("1+1", "12*3", "what is 7/8 + 1/8?")]
    stop = end_ids(tok, model, True, [])
    for temperature, top_p, top_k, batch_size in [(1.0, 1.0, 0, 64), (0.7, 1.0, 0, 5),
                                                  (0.7, 0.8, 0, 64), (1.0, 1.0, 5, 7)]:
        torch.manual_seed(0)
        cfg = RolloutConfig(group_size=4, max_new_tokens=12, temperature=temperature, top_p=top_p,
                            top_k=top_k, gen_batch_size=batch_size)
        ro, texts = generate(model, tok, prompts, cfg, stop)
        assert len(ro) == 12 and ro.group.tolist() == [0] * 4 + [1] * 4 + [2] * 4
        m = ro.completion_mask()
        t = torch.arange(ro.tokens.shape[1])[None]
        teacher, ent = token_logprobs(model, ro.tokens, (t < ro.seq_len[:, None]).long(),
                                      temperature, True)
        if top_p == 1 and top_k == 0:
            # the recorded log-prob is the model's at temperature T (early-dropped rows too)
            torch.testing.assert_close(ro.behav_logp[m], teacher[m], atol=2e-5, rtol=0)
            # the sampling entropy recorded per row is the model's, at T
            row_ent = (ent * m).sum(1) / m.sum(1)
            torch.testing.assert_close(ro.entropy, row_ent.float(), atol=2e-5, rtol=0)
        else:
            # the nucleus / top-k renormalises: log μ ≥ log π_T, equal where it holds every token
            assert (ro.behav_logp[m] >= teacher[m] - 2e-5).all()
        assert (ro.behav_logp[~m] == 0).all()
        for i in range(len(ro)):
            comp = ro.tokens[i, ro.prompt_len[i] : ro.seq_len[i]]
            ended = comp[-1].item() in stop
            assert tok.decode(comp[: len(comp) - ended], skip_special_tokens=True) == texts[i]
            assert (bool(ro.truncated[i]) == (not ended)
                    and not any(x in stop for x in comp[:-1].tolist()))
            assert not ro.truncated[i] or len(comp) == 12


def test_completion_logprobs_share_prompts_exactly():
    model = tiny_qwen3(60, seed=1).double()
    b = synthetic_batch(60)
    # groups not adjacent
    b = b.select(torch.randperm(len(b), generator=torch.Generator().manual_seed(0)))
    m = b.completion_mask()
    am = (torch.arange(b.tokens.shape[1])[None] < b.seq_len[:, None]).long()
    full, full_ent = token_logprobs(model, b.tokens, am, 0.8, with_entropy=True)
    shared, shared_ent = completion_logprobs(model, b.tokens, b.prompt_len, b.seq_len, 0.8,
                                             with_entropy=True)
    torch.testing.assert_close(shared, torch.where(m, full, 0.0), atol=1e-10, rtol=0)
    torch.testing.assert_close(shared_ent, torch.where(m, full_ent, 0.0), atol=1e-10, rtol=0)
    w = torch.randn(b.tokens.shape, dtype=torch.float64)
    params = list(model.parameters())
    # entropy is measured only: no gradient to compare
    g_full = torch.autograd.grad((full * m * w).sum(), params)
    g_shared = torch.autograd.grad((shared * w).sum(), params)
    # Qwen3's RMSNorm computes in float32 even in a float64 model: float32-level agreement
    for x, y in zip(g_full, g_shared, strict=True):
        assert (x - y).norm() <= 1e-5 * x.norm()


def test_skipping_zero_advantage_rows_leaves_the_update_unchanged():
    """update_policy never runs rows with A = 0 (beta = 0): its step equals the gradient of the loss
    over all rows, computed here directly in one pass."""
    batch = synthetic_batch(60)
    assert (batch.advantage == 0).sum() >= 4
    for agg in LOSS_AGGS:
        cfg = update_cfg(agg)
        model, direct = tiny_qwen3(60), tiny_qwen3(60)
        loss, grad, out = one_update(model, model, batch, cfg)
        logp, _ = completion_logprobs(direct, batch.tokens, batch.prompt_len, batch.seq_len,
                                      cfg.rollout.temperature)
        full, _ = grpo.policy_loss(logp, batch.behav_logp, batch.advantage, batch.completion_mask(),
                                   batch.onpolicy, cfg.grpo, n_seqs=len(batch),
                                   n_tokens=int(batch.completion_len.sum()),
                                   max_new_tokens=cfg.rollout.max_new_tokens)
        full.backward()
        expected = torch.cat([p.grad.flatten() for p in direct.parameters()])
        assert loss == pytest.approx(full.item(), abs=1e-6)
        torch.testing.assert_close(grad, expected, atol=1e-6, rtol=1e-5)
        assert (out["entropy"][batch.advantage == 0].isnan().all()
                and not out["entropy"][batch.advantage != 0].isnan().any())


def test_truncated_rows_are_left_out_of_the_loss():
    """rollout.mask_truncated: the update equals the one on the batch without its truncated rows."""
    batch = synthetic_batch(60)
    batch.truncated = torch.arange(len(batch)) % 3 == 0
    cfg = update_cfg("dapo")
    cfg.rollout.mask_truncated = True
    m1, m2 = tiny_qwen3(60), tiny_qwen3(60)
    loss, grad, out = one_update(m1, m1, batch, cfg)
    cfg.rollout.mask_truncated = False
    loss_kept, grad_kept, _ = one_update(m2, m2, batch.select(~batch.truncated), cfg)
    assert loss == pytest.approx(loss_kept, abs=1e-6)
    torch.testing.assert_close(grad, grad_kept, atol=1e-6, rtol=1e-5)
    assert out["entropy"][batch.truncated].isnan().all()


# ------------------------------------------------------------------------------ real-model settings


@pytest.mark.parametrize("setting",
                         ["bf16_compute", "gradient_checkpointing", "compile", "small_batches"])
def test_real_model_settings_update(setting):
    """Each GPU setting through the real update code on a tiny random Qwen3, against the float32
    default."""
    batch = synthetic_batch(60)
    cfg = update_cfg("dapo")
    ref_model = tiny_qwen3(60)
    loss_ref, grad_ref, _ = one_update(ref_model, ref_model, batch, cfg)
    model, compute, tol = tiny_qwen3(60), None, 1e-5
    policy = model
    if setting == "bf16_compute":
        # float32 weights, bf16 matmuls: what model.compute_dtype=bfloat16 runs
        compute, tol = torch.autocast("cpu", dtype=torch.bfloat16), 0.05
    elif setting == "gradient_checkpointing":
        cfg.model.gradient_checkpointing = True
        # v5.2x name
        (getattr(model, "activation_checkpointing_enable", None)
         or model.gradient_checkpointing_enable)()
    elif setting == "compile":
        # inductor's C++ codegen takes minutes on a loaded CPU; dynamo tracing is what our code
        # meets
        policy = torch.compile(model, backend="eager")
        cfg.optim.micro_batch_size = 64  # one micro-batch: fewer shapes to trace
    elif setting == "small_batches":
        cfg.optim.micro_batch_size, cfg.optim.logprob_batch_size, cfg.optim.minibatches = 1, 2, 1
    loss, grad, out = one_update(policy, model, batch, cfg, compute)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert loss == pytest.approx(loss_ref, abs=tol * 10)
    assert (grad.float() - grad_ref).norm() <= tol * 10 * grad_ref.norm()
    assert torch.isfinite(torch.tensor(out["metrics"]["entropy"]))


def test_a_small_lr_moves_every_weight_with_bf16_compute():
    """The papers' lr 1e-6, one AdamW step, bf16 compute (autocast on CPU): float32 master weights
    move wherever the gradient is non-zero. bf16 master weights (the old model.dtype=bfloat16) moved
    about 2 % of them."""
    batch = synthetic_batch(60)
    cfg = update_cfg("dapo")
    model = tiny_qwen3(60)
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
    grads = {}
    real_step = opt.step

    def step_keeping_grads(*a, **k):
        grads.update({i: p.grad.clone()
                      for i, p in enumerate(model.parameters())
                      if p.grad is not None})
        return real_step(*a, **k)

    opt.step = step_keeping_grads
    _, _, reasons, _ = grpo.update_policy(update_settings(cfg), model, model, opt, batch,
                                          torch.device("cpu"),
                                          torch.autocast("cpu", dtype=torch.bfloat16))
    assert reasons == [None]
    moved = total = 0
    for i, (p, p0) in enumerate(zip(model.parameters(), before)):
        live = grads[i] != 0
        moved += int((p.detach() != p0)[live].sum())
        total += int(live.sum())
    print(f"weights with a non-zero gradient that moved at lr 1e-6: {moved / total:.4%} of {total}")
    assert total > 1000 and moved / total >= 0.99


@pytest.mark.long
def test_real_model_settings_run_train(model_dir, tmp_path, monkeypatch):
    """train.py end to end with every real-model key on (bf16 compute, gradient checkpointing,
    torch.compile, separate generation / log-prob / training batch sizes, two optimizer steps per
    batch), in-process on the random Qwen3."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    cfg = load_config("configs/tiny.yaml", [
        f"--model.path={model_dir}", f"--out_dir={tmp_path / 'run'}", "--max_steps=2",
        "--rollout.batch_size=16", "--rollout.group_size=4", "--rollout.max_new_tokens=8",
        "--rollout.gen_batch_size=8", "--optim.micro_batch_size=3",
        "--optim.logprob_batch_size=5", "--optim.minibatches=2", "--model.compute_dtype=bfloat16",
        "--model.gradient_checkpointing=true",
        "--model.compile=true", "--eval.n=4", "--eval.k=1", "--checkpoint.every=0",
        "--wandb.mode=disabled", "--reward.no_answer=-1", "--reward.last_number_fallback=true",
    ])
    validate(cfg)
    train.train(cfg)
    rows = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("generate", "reward", "advantage", "replay_sample", "prox_logprobs",
                "forward_backward", "optimizer", "replay_push", "step"):
        assert f"time/{key}" in rows[0], key
    assert rows[0]["time/prox_logprobs"] > 0, "minibatches=2 computes π_prox"


# ----------------------------------------------------------------------------------------- torchrun


def worker(mode: str, model_dir: str, out: str) -> None:
    """Under torchrun: each rank runs grpo.update_policy on its shard of the synthetic batch, the
    model wrapped as train.py wraps it for model.parallel=`mode` (DDP, or FSDP2 sharding of every
    decoder layer and the root), and writes the loss and the applied update (full weights
    gathered)."""
    import torch.distributed as dist

    from support import parallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    result = {}
    for agg in LOSS_AGGS:
        cfg = update_cfg(agg)
        cfg.model.path, cfg.model.parallel = model_dir, mode
        model, policy, _, _, compute = load_policy(cfg, model_dir, torch.device("cpu"), world)
        assert (mode == "fsdp") == any(isinstance(p, DTensor) for p in model.parameters())
        batch = synthetic_batch(model.config.vocab_size)
        loss, delta, _ = one_update(policy, model, shard(batch, rank, world), cfg, compute)
        result[agg] = {"loss": loss, "grad": delta.tolist()}
    write_result(out, result)
    del model, policy  # DDP's wrapper goes before its process group
    parallel.close()


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_torchrun_first_update_equals_single_process(model_dir, tmp_path, mode):
    out = tmp_path / f"{mode}.json"
    ranks = worker_results(__file__, mode, str(model_dir), out=out)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    batch = synthetic_batch(base.config.vocab_size)
    assert len(shard(batch, 0, 2)) != len(shard(batch, 1, 2)), (
        "ranks hold different numbers of rows (and micro-batches)")
    for agg in LOSS_AGGS:
        model = copy.deepcopy(base)
        loss, grad, _ = one_update(model, model, batch, update_cfg(agg))
        for r in ranks:  # both ranks applied the same update: the global batch's
            assert r[agg]["loss"] == pytest.approx(loss, abs=1e-5), agg
            torch.testing.assert_close(torch.tensor(r[agg]["grad"]), grad, atol=1e-5, rtol=0)
        assert grad.abs().max() > 1e-3


def test_torchrun_train_logs_on_rank0_checkpoints_and_resumes(model_dir, tmp_path):
    out = tmp_path / "run"
    common = ["train.py", "--config", "configs/tiny.yaml", f"--model.path={model_dir}",
              f"--out_dir={out}", "--rollout.batch_size=16", "--rollout.group_size=4",
              "--rollout.max_new_tokens=8", "--eval.n=4", "--eval.k=1", "--eval.every=1",
              "--checkpoint.every=1", "--replay.strategy=aper", "--reward.no_answer=-1",
              "--reward.last_number_fallback=true", "--threads=1", "--wandb.mode=disabled"]
    torchrun(*common, "--max_steps=2")
    s0, s1 = (torch.load(out / "checkpoints" / "step_000001" / f"state_rank{r}.pt",
                         weights_only=True)
              for r in (0, 1))
    # each rank its own
    assert (s0["world"] == s1["world"] == 2
            and s0["rng"]["torch"].ne(s1["rng"]["torch"]).any())
    assert (out / "checkpoints" / "step_000001" / "optimizer.pt").is_file()  # whole, once
    assert "optimizer" not in s0 and "optimizer" not in s1
    torchrun(*common, "--max_steps=3", "--resume")
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3], "one line per step: rank 0 alone writes"
    assert all("eval/accuracy" in r for r in rows)
    assert rows[-1]["generated_tokens"] > rows[0]["generated_tokens"] > 0
    assert json.loads((out / "summary.json").read_text())["steps"] == 3


def test_torchrun_refuses_prompts_that_do_not_split_over_the_ranks(model_dir, tmp_path):
    """A step's prompts must split evenly over the processes (each rank generates its share): 3
    prompts on 2 ranks is one line naming both numbers and a non-zero exit, before out_dir is
    made."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "train.py", "--config", "configs/tiny.yaml", f"--model.path={model_dir}",
           f"--out_dir={out}", "--rollout.batch_size=24", "--rollout.group_size=8", "--threads=1",
           "--wandb.mode=disabled"]
    code, _, err = run_capped(cmd, 300, cwd=REPO, env=ENV)
    assert code not in (0, None), err[-4000:]
    said = "error: prompts per step (3) must be divisible by the number of processes (2)\n"
    assert err.count(said) == 2, err[-4000:]  # each rank's one line
    assert not out.exists()



def test_a_bad_input_line_is_one_write_so_ranks_cannot_split_it(monkeypatch):
    """The test above once read "error: ...(2)error: ...(2)\n": each rank's print wrote its text
    and its newline in two writes (stderr writes through), and the other rank's line came between.
    Through train.main, and through a command's argument parser: each line is one write."""
    from support.util import OneLineParser

    class Pipe:  # stderr as the ranks' shared pipe: every write kept apart
        def __init__(self):
            self.writes = []

        def write(self, text):
            self.writes.append(text)
            return len(text)

        def flush(self):
            pass

    pipe = Pipe()
    monkeypatch.setattr(sys, "stderr", pipe)
    code = train.main(["--config", "configs/tiny.yaml", "--rollout.group_size=0"])
    with pytest.raises(SystemExit):
        OneLineParser(prog="eval.py").error("argument --k: must be ≥ 1")
    assert code == 2 and len(pipe.writes) == 2, pipe.writes
    assert all(w.endswith("\n") and w.count("\n") == 1 for w in pipe.writes), pipe.writes

FSDP_RUN = ["train.py", "--config", "configs/tiny.yaml", "--model.parallel=fsdp",
            "--rollout.batch_size=16", "--rollout.group_size=4", "--rollout.max_new_tokens=16",
            "--eval.n=8", "--eval.k=1", "--eval.every=0", "--checkpoint.every=2",
            "--replay.strategy=uniform", "--replay.ratio=0.25", "--reward.no_answer=-1",
            "--threads=1", "--wandb.mode=disabled", "--max_steps=5"]


SLEEPER = """import os, pathlib, sys, time
pathlib.Path(sys.argv[1], os.environ["RANK"]).write_text(str(os.getpid()))
time.sleep(600)
"""


def running(pid: int) -> bool:
    """Whether `pid` is a live process (an unreaped zombie is not)."""
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_kill_tree_stops_torchruns_workers_and_frees_its_pipes(tmp_path):
    """torchrun starts each worker in a session of its own: a SIGKILL to the launcher's process
    group leaves both running (writing to the run's folder, holding the pipes a timed-out test
    then reads to their end: a hang). support.util.kill_tree, which the tests' and gpu_run's
    timeouts use, stops both and the pipes close."""
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(script), str(tmp_path)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.time() + 120
    while not all((tmp_path / r).exists() for r in "01") and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)  # each pid file written in full
    workers = [int((tmp_path / r).read_text()) for r in "01"]
    assert all(map(running, workers))
    kill_tree(proc.pid)
    proc.communicate(timeout=30)  # EOF on both pipes: no worker holds them
    deadline = time.time() + 10
    while any(map(running, workers)) and time.time() < deadline:
        time.sleep(0.05)
    assert not any(map(running, workers)), "a torchrun worker outlived kill_tree"



def test_run_capped_returns_the_output_or_stops_at_its_cap():
    """support.util.run_capped (tests' torchrun and gpu_run's steps): the exit code and both
    streams of a command that ends; None once the cap passes, the command and what it started
    killed; stderr merged into stdout on request."""
    code = ("import sys, time; print('out'); print('err', file=sys.stderr); "
            "time.sleep(float(sys.argv[1]))")
    assert run_capped([sys.executable, "-c", code, "0"], 60) == (0, "out\n", "err\n")
    merged = run_capped([sys.executable, "-c", code, "0"], 60, stderr=subprocess.STDOUT)
    assert merged[0] == 0 and sorted(merged[1].split()) == ["err", "out"] and merged[2] is None
    t0 = time.time()
    assert run_capped([sys.executable, "-c", code, "600"], 2)[0] is None
    assert time.time() - t0 < 30

@pytest.mark.long
def test_fsdp_sigkill_then_resume_is_bit_identical(tmp_path):
    """model.parallel=fsdp on 2 processes: a run killed (SIGKILL, every process) after step 3 and
    resumed from its step-2 checkpoint ends with the same metrics and bit-identical weights as an
    uninterrupted run; final/ is an ordinary HF folder."""
    ref, run = tmp_path / "ref", tmp_path / "run"
    torchrun(*FSDP_RUN, f"--out_dir={ref}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           *FSDP_RUN, f"--out_dir={run}"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 300
    while proc.poll() is None and time.time() < deadline:
        if (run / "metrics.jsonl").exists() and '"step": 3,' in (run / "metrics.jsonl").read_text():
            kill_tree(proc.pid)  # the launcher and both workers at once
            break
        time.sleep(0.05)
    proc.wait(timeout=60)
    assert not (run / "final").exists() and (run / "checkpoints" / "step_000002").is_dir()
    torchrun(*FSDP_RUN, f"--out_dir={run}", "--resume")

    def rows(d):
        return [{k: v
                 for k, v in json.loads(ln).items()
                 if not k.startswith(("time/", "wall", "reward/verify"))}
                for ln in (d / "metrics.jsonl").read_text().splitlines()]

    assert ([r["step"] for r in rows(run)] == [1, 2, 3, 4, 5]
            and json.dumps(rows(run)) == json.dumps(rows(ref)))
    a, b = (load_file(ref / "final" / "model.safetensors"),
            load_file(run / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    model = AutoModelForCausalLM.from_pretrained(run / "final")
    assert all(p.dtype == torch.float32 for p in model.parameters())
    original = load_file(REPO / "data" / "tiny_model" / "model.safetensors")
    assert any(not torch.equal(a[k], original[k]) for k in original), "the run trained"


def generation_worker(dtype: str, model_dir: str, out: str) -> None:
    """Under torchrun, the model sharded as train.py shards it with model.parallel=fsdp and
    compute `dtype`: one sample of 4 prompts x 3 inside `parallel.generation`, twice from one RNG
    state, once with FSDP's forward hooks left on (as before) and once as the context runs it;
    writes both samples and the FSDP forward-hook events each ran (torch's profiler; the gather
    before and the free after are the context's own)."""
    import torch.distributed as dist

    from support import parallel

    from bench.generation import nothing  # generation as it ran before: the hooks stay on

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cfg = update_cfg("grpo")
    cfg.model.path, cfg.model.parallel, cfg.model.compute_dtype = model_dir, "fsdp", dtype
    model, _, tok, _, compute = load_policy(cfg, model_dir, torch.device("cpu"), 2)
    prompts = [prompt_ids(tok, f"{i}+{i}=", "{problem}", False) for i in range(4 + dist.get_rank())]
    cfg.rollout.group_size = 3
    stop = end_ids(tok, model, True, [])
    result = {}
    for name in ("hooked", "plain"):
        torch.manual_seed(7)
        real = parallel._forward_hooks_off
        if name == "hooked":  # the hooks stay on: what generation ran before
            parallel._forward_hooks_off = nothing
        try:
            activities = [torch.profiler.ProfilerActivity.CPU]
            with torch.profiler.profile(activities=activities) as prof, parallel.generation(
                    model, compute):
                ro, _ = generate(model, tok, prompts, cfg.rollout, stop)
        finally:
            parallel._forward_hooks_off = real
        fsdp = [e for e in prof.events() if e.name.startswith("FSDP::") and "forward" in e.name]
        result[name] = {"tokens": ro.tokens.tolist(), "logp": ro.behav_logp.tolist(),
                        "entropy": ro.entropy.tolist(), "fsdp_events": len(fsdp)}
    write_result(out, result)
    parallel.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fsdp_generation_runs_without_fsdp_hooks_and_samples_the_same(model_dir, tmp_path, dtype):
    """Under FSDP the generation phase gathers the weights once and then runs no FSDP hook: the
    profiler sees FSDP's pre/post-forward events with the hooks on and none without, and the
    tokens, behaviour log-probs and entropies are bit-identical (each rank: its own prompts)."""
    ranks = worker_results(__file__, dtype, str(model_dir), out=tmp_path / "gen.json",
                           worker="--gen-worker")
    for r in ranks:
        assert r["hooked"]["fsdp_events"] > 0 and r["plain"]["fsdp_events"] == 0
        for key in ("tokens", "logp", "entropy"):
            assert r["plain"][key] == r["hooked"][key], key
        assert any(any(row) for row in r["plain"]["logp"])


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    worker(*sys.argv[2:5])
if __name__ == "__main__" and sys.argv[1:2] == ["--gen-worker"]:
    generation_worker(*sys.argv[2:5])


# ------------------------------------------------------------------------------- bench/gpu_check.py


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")
def test_gpu_check_without_a_gpu_prints_one_line_and_exits_2():
    r = subprocess.run([sys.executable, "bench/gpu_check.py"], cwd=REPO, env=ENV,
                       capture_output=True, text=True, timeout=120, check=False)
    assert (r.returncode == 2
            and r.stdout.count("\n") == 1
            and "no GPU is visible" in r.stdout
            and not r.stderr.strip())


@pytest.mark.long
def test_gpu_check_logic_on_the_cpu():
    """The same checks on this CPU through a hidden flag (gloo instead of NCCL, no memory check):
    train.py under torchrun with FSDP at world size 1, resumed, final/ loaded; no all-gather inside
    generation and a bf16 KV cache; the lr 1e-6 step moves the weights; a gap bound it exceeds makes
    it exit 1. (bf16 rounding moves this tiny model's gradient norm by 0.6-12.5 % over unseeded
    samples; gpu_check seeds them, 4.85 % here: a looser bound here.)"""
    cmd = [sys.executable, "bench/gpu_check.py", "--allow-cpu",
           "--model.path", str(REPO / "data" / "tiny_model"),
           "--max-new-tokens", "12", "--prompts", "2", "--group-size", "2", "--prompt-tokens", "16",
           "--max-grad-norm-diff", "0.1"]
    r = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=900,
                       check=False)
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    assert "resumed to 3 (3 metric lines)" in r.stdout and "final/ loads" in r.stdout
    assert "all-gathers inside generate: 0; KV cache torch.bfloat16" in r.stdout
    assert "moved 100.00 % of the weights" in r.stdout and "gpu_check: OK" in r.stdout
    r = subprocess.run(cmd + ["--skip-torchrun", "--max-gap-mean", "-1"], cwd=REPO, env=ENV,
                       capture_output=True, text=True, timeout=900, check=False)
    assert r.returncode == 1 and "gpu_check: FAILED ((c) mean gap" in r.stdout


@pytest.mark.long
def test_gpu_run_dry_run_passes_every_step_on_the_cpu(tmp_path):
    """bench/gpu_run.py --dry-run --extras (#41, #56): every step of the GPU script at toy sizes on
    this CPU, proven before a GPU's minutes are spent: its JSON has each step passed, with the
    figures the GPU run reports (the generation arms on one workload, each with what compiled,
    the compiled ones compiled as on a GPU; the update's tokens/s cold and warm with its MFU; the
    extras; the chunked head's difference; the versions), and its log every child's lines."""
    cmd = [sys.executable, "bench/gpu_run.py", "--dry-run", "--extras", "--out",
           str(tmp_path / "out"), "--work", str(tmp_path / "work")]
    r = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=900,
                       check=False)
    report = json.loads((tmp_path / "out" / "gpu_run.json").read_text())
    steps = report["steps"]
    assert r.returncode == 0, r.stdout[-3000:]
    assert {n: steps[n]["status"] for n in steps} == dict.fromkeys(
        ("env", "check", "generation", "full", "lora"), "passed")
    assert steps["env"]["torch"] and "peft" in steps["env"] and "driver" in steps["env"]
    arms = steps["generation"]["arms"]  # the compiled refill loop, today's path, HF's compiled
    assert list(arms) == ["refill_static", "default", "static_packed"]
    assert all(arm["tokens"] > 0 for arm in arms.values())
    assert arms["refill_static"]["compiled"]["stats.unique_graphs"] >= 1
    assert arms["static_packed"]["compiled"]["stats.unique_graphs"] >= 1
    assert "stats.unique_graphs" not in arms["default"]["compiled"]
    assert steps["full"]["generation"]["cache"] != "StaticCache"  # the default path
    update = steps["full"]["update"]
    assert update["tokens_per_s"] > 0 and update["warm_tokens_per_s"] > 0
    assert update["warm"]["mfu_measured"] > 0  # against the env step's matmul
    head = steps["full"]["profile"]["chunked_head_ms"]  # where a warm update's time goes
    tf32 = steps["full"]["head_tf32"]  # the TF32 head against float32's, same weights (lr 0)
    assert tf32["tf32"]["warm_tokens_per_s"] > 0 and tf32["logprob_max_abs_diff"] == 0  # (CPU)
    # repeated updates at lr 0 give the same gradient: the optimizer holds the float32 shards, not
    # the root's gathered copies, whose masters kept and summed every update's gradient
    assert tf32["float32_repeat_grad_norm_rel_diff"] == 0 == tf32["grad_norm_rel_diff"]
    assert steps["full"]["larger_micro_batch"]["warm_tokens_per_s"] > 0
    assert head["chunked_head_forward"] > 0 and head["chunked_head_backward"] > 0
    assert steps["lora"]["update"]["trained_params"] < steps["lora"]["update"]["params"]
    assert steps["full"]["chunked_head"]["max_abs_diff"] < 1e-4
    assert "cpu:gloo" in steps["check"]["rank_check"]["backend_map"]
    log = (tmp_path / "out" / "gpu_run.log").read_text()
    assert "refill_static: " in log and "(e) training, a warm step" in log


def test_gpu_check_gap_stats_hand_values():
    """(c)'s statistics: |d| mean, p99 and max, and the fraction of ratios e^d outside
    [0.8, 1.28]."""
    sys.path.insert(0, str(REPO / "bench"))
    import gpu_check

    d = torch.tensor([[0.0, 0.1, -0.3, 0.3], [0.0, 0.0, 0.2, 9.0]])  # 9.0 sits off the mask
    mask = torch.tensor([[False, True, True, True], [False, True, True, False]])
    stats = gpu_check.gap_stats(d, torch.zeros(2, 4), mask, Config())
    assert stats["mean"] == pytest.approx(0.18) and stats["max"] == pytest.approx(0.3)
    # e^-0.3 = 0.741 < 0.8 and e^0.3 = 1.35 > 1.28 are outside; e^0.1, e^0, e^0.2 = 1.22 inside
    assert stats["outside_clip"] == pytest.approx(2 / 5)
    assert stats["p99"] == pytest.approx(
        torch.tensor([0.1, 0.3, 0.3, 0.0, 0.2]).quantile(0.99).item())


def test_memory_plan_holds_gradients_only_while_training():
    """bench/memory_plan.py's phases, as the H200 measured them (docs/results.md, "On one GPU"):
    gradients exist from an update's first backward to its end, so generation's peak holds
    weights, AdamW state, the KV cache and (bf16 compute) the float32 copy of the output layer;
    before the first optimizer step AdamW has no state (`first_step_peak`)."""
    sys.path.insert(0, str(REPO / "bench"))
    from memory_plan import Shape, estimate

    s = Shape(64, 2, 4, 2, 16, 128, 1000, True, True)
    e = estimate(s, gpus=1, fsdp=False, micro_batch=1, gen_batch=65536, prompt=16, response=48)
    kv = 65536 * 64 * s.layers * 2 * s.kv_heads * s.head_dim * 2
    # decoding: bf16's float32 output layer and the sampler's five (rows, V) float32 tensors
    assert e["generation"] == kv + 4 * s.vocab * s.hidden + 5 * 65536 * s.vocab * 4
    # a long prompt: the prompt's pass sets the phase, its cache beside one layer's activations
    per_token = s.layers * 2 * s.kv_heads * s.head_dim * 2  # a token's K and V, bf16
    activations = (3 * s.intermediate + 4 * s.hidden + 2 * s.head_dim) * 2  # one layer, bf16
    long = estimate(s, gpus=1, fsdp=False, micro_batch=1, gen_batch=8, prompt=4096, response=1)
    assert long["generation"] == 8 * 4096 * (per_token + activations)
    assert e["peak"] == e["weights"] + e["optimizer"] + e["generation"]
    assert e["first_step_peak"] == e["weights"] + e["generation"]
    f32 = estimate(s, gpus=1, fsdp=False, micro_batch=64, gen_batch=0, prompt=16, response=48,
                   act_bytes=4)
    training = f32["gradients"] + f32["activations"] + f32["logits"]
    assert f32["generation"] == 0 and training > f32["gradients"] + f32["optimizer_step"]
    assert f32["peak"] == f32["weights"] + f32["optimizer"] + training
