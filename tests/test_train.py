"""Tests of train.py through its real path (issue #40): each one fails under one regression, made
by hand, that the rest of the suite let through. Its docstring names the regression it guards.

  a. train.py computes group advantages before RLEP's stored rows join their groups
  c. behaviour log-probs not renormalised after the top-k / top-p cut
  d. aper and group replay evicting a row at age tau_max, one step early
  e. uniform replay drawing the newest rows instead of a uniform subset
  f. the chunked output layer dropping a last, partial chunk of rows
  g. the update running the loaded model in eval mode, where HF's gradient checkpointing is off

(b, the latency from SIGTERM to the stop during a long generation, is bounded in
tests/test_preempt.py.)
"""

import json
import signal
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

import train
from replay import ReplayConfig, make_replay
from batch import Rollouts
from rollout import RolloutConfig, generate

try:  # the chunked output layer moves from grpo.py to support/logprobs.py
    from support import logprobs as head
except ImportError:
    import grpo as head

from fixtures import REPO  # (tests/fixtures.py: the repository's root)
MODEL = REPO / "data" / "tiny_model"
needs_model = pytest.mark.skipif(not (MODEL / "config.json").is_file(),
                                 reason="data/tiny_model not built")
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
PAD = 0


# ------------------------------------------------ a. RLEP's rows join groups before advantages

GOLD = "987654321"  # an answer the tiny model never gives: every fresh row scores 0
PROBLEMS = ["3+4", "9-2", "2*6", "8/2"]  # one step's 4 prompts (16 rows, 4 per group)
SMALL_RUN = ["--rollout.batch_size=16", "--rollout.group_size=4", "--rollout.max_new_tokens=24",
             "--eval.n=8", "--eval.k=1", "--eval.every=0", "--checkpoint.every=0",
             "--threads=1", "--wandb.mode=disabled"]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_metrics(out: Path, *args: str) -> list[dict]:
    """train.main in this process (its signal handlers put back after); its metrics lines."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        assert train.main([f"--out_dir={out}", *SMALL_RUN, *args]) == 0
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@needs_model
def test_rlep_successes_join_their_groups_before_the_advantages(tmp_path):
    """Regression guarded: train.py computing the group advantages before
    `replay.before_advantages` adds RLEP's stored rows: every group is then flat and RLEP trains
    on nothing. No fresh row can be correct (the gold is GOLD), and phase I holds one success of
    each prompt: a group has a reward spread only once its successes have joined it."""
    data = write_jsonl(tmp_path / "train.jsonl",
                       [{"problem": p, "answer": GOLD} for p in PROBLEMS])
    solution = {"completion": f"\\boxed{{{GOLD}}}"}
    source = write_jsonl(tmp_path / "phase1.jsonl",
                         [{"problem": p} | solution for p in PROBLEMS])
    lines = run_metrics(tmp_path / "run", "--config", "configs/tiny/rlep.yaml", "--max_steps=1",
                        f"--data.train={data}", f"--replay.rlep_source={source}",
                        "--replay.rlep_n=1")
    step1 = lines[0]
    assert step1["replay/sampled"] == len(PROBLEMS)  # one success joined each group
    assert step1["reward_mean"] == pytest.approx(1 / 5)  # of 4 fresh rows (all 0) and 1 success
    assert step1["adv/zero_std_frac"] == 0.0  # every group has its spread
    assert step1["adv/abs_mean"] > 0.5
    assert abs(step1["loss"]) > 1e-3
    assert step1.get("skipped/zero_adv", 0) == 0


# ------------------------------------- c. behaviour log-probs of the truncated distribution

def cut_logprobs(z: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """(..., V) log-probs of softmax(z) cut to the top_k largest, then to the top_p nucleus of
    what is left (a token goes once the more likely ones hold top_p of the mass), renormalised;
    -inf outside the kept set."""
    order = z.argsort(-1, descending=True)
    rank = order.argsort(-1)  # 0 for the most likely token
    kept = rank < top_k
    p_sorted = z.masked_fill(~kept, -torch.inf).softmax(-1).gather(-1, order)
    mass_before = p_sorted.cumsum(-1) - p_sorted  # of the tokens more likely than this one
    kept &= (mass_before < top_p).gather(-1, rank)
    return z.masked_fill(~kept, -torch.inf).log_softmax(-1)


@needs_model
def test_behaviour_logprobs_are_of_the_renormalised_top_k_top_p_distribution():
    """Regression guarded: rollout.py's `_SamplingDistribution` recording log-probs that are not
    renormalised after the top-k / top-p cut (the log-softmax of the uncut logits). Generation
    through `rollout.generate` with both cuts on; the trainer's view (one full forward of the
    generated rows at the same temperature, cut and renormalised here in float64) must give each
    completion token's stored behaviour log-prob to float32 round-off, and every sampled token
    must lie inside the kept set."""
    T, K, P = 2.0, 12, 0.9  # hot enough that the nucleus cuts inside the top-k everywhere
    model = AutoModelForCausalLM.from_pretrained(MODEL)
    tok = AutoTokenizer.from_pretrained(MODEL)
    chats = [[{"role": "user", "content": p}] for p in PROBLEMS]
    prompts = [tok.apply_chat_template(c, add_generation_prompt=True)["input_ids"] for c in chats]
    cfg = RolloutConfig(group_size=4, max_new_tokens=24, temperature=T, top_k=K, top_p=P)
    torch.manual_seed(0)
    ro, _ = generate(model, tok, prompts, cfg, [tok.eos_token_id])

    L = ro.tokens.shape[1]
    attention = (torch.arange(L)[None] < ro.seq_len[:, None]).long()
    with torch.no_grad():
        logits = model(input_ids=ro.tokens, attention_mask=attention).logits.float()
    z = (logits[:, :-1] / T).double()  # (B, L−1, V): position t−1 predicts token t
    cut = cut_logprobs(z, K, P)
    sampled = ro.tokens[:, 1:, None]
    expected = cut.gather(-1, sampled).squeeze(-1)  # (B, L−1)
    mask = ro.completion_mask()[:, 1:]

    kept_mass = (z.softmax(-1) * cut.isfinite()).sum(-1)[mask]
    assert kept_mass.max() < 0.99  # the test means it: the cut drops mass at every token
    assert expected[mask].isfinite().all()  # every sampled token is inside the kept set
    torch.testing.assert_close(ro.behav_logp[:, 1:][mask].double(), expected[mask],
                               atol=3e-5, rtol=0)


# ------------------------------------------------------- replay: rows written step by step

def rows(n_groups: int, G: int, step: int, reward: torch.Tensor) -> Rollouts:
    """n_groups groups of G rows born at `step` (group ids unique per step), 8 tokens each
    (2 of prompt); advantage = reward − its group's mean."""
    n = n_groups * G
    ro = Rollouts.empty(n, 8, PAD)
    ro.tokens[:] = torch.arange(1, 9)
    ro.prompt_len[:], ro.seq_len[:] = 2, 8
    ro.behav_logp[:, 2:] = -1.0
    local = torch.arange(n_groups).repeat_interleave(G)
    ro.group = 100 * step + local
    ro.prompt_idx = 100 * step + local
    ro.born[:] = step
    ro.reward = reward.float()
    ro.correct = reward > 0
    ro.advantage = ro.reward - ro.reward.view(n_groups, G).mean(1).repeat_interleave(G)
    ro.onpolicy[:] = True
    return ro


def spread(n_groups: int, G: int, step: int) -> Rollouts:
    """Groups whose rewards alternate 1, 0: every row has |A| = 0.5."""
    return rows(n_groups, G, step, (torch.arange(n_groups * G) % 2).float())


def flat(n_groups: int, G: int, step: int) -> Rollouts:
    """Groups whose rows all score 0: nothing to learn, the group strategy replaces them."""
    return rows(n_groups, G, step, torch.zeros(n_groups * G))


def born_at(batch: Rollouts, step: int) -> int:
    """The replayed rows of `batch` born at `step`."""
    return int((batch.replayed & (batch.born == step)).sum())


# ---------------------------------------------------- d. tau_max: drawable at age tau_max

@pytest.mark.parametrize("strategy", ["aper", "group"])
def test_a_row_is_drawable_at_age_tau_max_and_gone_one_step_later(strategy):
    """Regression guarded: aper and group replay evicting at age ≥ tau_max instead of > tau_max
    (replay.py `step - born > tau_max` made `>=`), one step early. A row born at step s is drawn
    at every step up to s + tau_max and is gone at s + tau_max + 1. The hooks run in train.py's
    order (sample, then push); only step s pushes rows."""
    tau, s, G = 3, 5, 4
    cfg = ReplayConfig(strategy=strategy, tau_max=tau, ratio=1.0, capacity=64)
    buf = make_replay(cfg, max_len=8, pad_id=PAD, seed=0)
    stored = buf.sample(spread(2, G, s), s)  # step s: nothing stored yet, fresh rows alone
    buf.push(stored, s, torch.zeros(len(stored)))  # all 8 kept (|A| = 0.5, groups with a spread)
    for step in range(s + 1, s + tau + 1):  # ages 1 .. tau_max
        batch = buf.sample(flat(2, G, step), step)
        drawn = born_at(batch, s)
        assert drawn > 0, f"age {step - s} (tau_max {tau}): no row born at step {s} drawn"
        buf.push(batch, step, torch.zeros(len(batch)))  # flat fresh rows: none stored
    batch = buf.sample(flat(2, G, s + tau + 1), s + tau + 1)  # age tau_max + 1
    drawn = born_at(batch, s)
    assert drawn == 0 and len(buf) == 0, f"age {tau + 1}: {drawn} drawn, {len(buf)} stored"
    assert buf.metrics()["replay/evicted_age"] == len(stored)


# -------------------------------------------------------- e. uniform replay: uniform slots

CAPACITY = 16
CHI2_15DF_P1E6 = 56.493  # the chi-square law's upper 1e-6 quantile, 15 degrees of freedom


def test_uniform_replay_draws_every_stored_slot_equally_often():
    """Regression guarded: uniform replay drawing the newest rows first (e.g. the last-written
    slots instead of `key.topk(k)` of uniform keys). A full buffer of 16 rows, written over 4
    steps; 2,000 draws of k = 4 distinct rows. Each slot's count is compared with its expected
    500 by Pearson's chi-square on 15 degrees of freedom, against the 1e-6 critical value (the
    seed fixes the outcome; drawing without replacement within a draw only makes the statistic
    smaller than the chi-square law, so a uniform sampler passes with room to spare)."""
    cfg = ReplayConfig(strategy="uniform", ratio=0.5, capacity=CAPACITY)
    buf = make_replay(cfg, max_len=8, pad_id=PAD, seed=1234)
    for step in range(4):
        batch = spread(1, 4, step)
        buf.push(batch, step, torch.zeros(len(batch)))
    assert len(buf) == CAPACITY
    counts = torch.zeros(CAPACITY)
    draws = 2000
    for _ in range(draws):
        batch = buf.sample(spread(1, 4, 4), 4)  # k = ratio / (1 − ratio) · 4 fresh rows = 4
        slots = batch.slot[batch.replayed]
        assert len(slots) == 4 and len(slots.unique()) == 4
        counts += torch.bincount(slots, minlength=CAPACITY)
    expected = draws * 4 / CAPACITY
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < CHI2_15DF_P1E6, f"chi-square {chi2:.1f}, counts {counts.tolist()}"


# --------------------------------------------- f. the chunked output layer: a partial chunk

VOCAB = 1000


def tiny_qwen2(seed: int = 0):
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=True)
    return AutoModelForCausalLM.from_config(cfg)


def whole_logprobs(model, tokens, prompt_len, seq_len, temperature):
    """(B, L) log-probs and entropies of the completion tokens from the whole (B, L, V) logits."""
    ar = torch.arange(tokens.shape[1])
    attention = (ar[None] < seq_len[:, None]).long()
    hidden = model.model(input_ids=tokens, attention_mask=attention).last_hidden_state
    z = F.linear(hidden, model.get_output_embeddings().weight)[:, :-1] / temperature
    lsm = z.log_softmax(-1)  # (B, L−1, V)
    logp = F.pad(lsm.gather(-1, tokens[:, 1:, None]).squeeze(-1), (1, 0))
    ent = F.pad(-(lsm.exp() * lsm).sum(-1), (1, 0))
    completion = (ar[None] >= prompt_len[:, None]) & (ar[None] < seq_len[:, None])
    return torch.where(completion, logp, 0.0), torch.where(completion, ent, 0.0).detach()


@pytest.mark.parametrize("share_prompt", [False, True])
def test_chunked_head_keeps_a_last_partial_chunk_in_float32(monkeypatch, share_prompt):
    """Regression guarded: the chunked output layer (`_ChunkedHead`, HEAD_CHUNK) dropping a last
    partial chunk of rows (e.g. `range(0, len(hidden) - n + 1, n)`), in forward or backward. In
    float32, as a run computes: 23 completion tokens in chunks of 4 rows, so the last chunk holds
    3; log-probs, entropies and gradients equal those of the whole logits."""
    monkeypatch.setattr(head, "HEAD_CHUNK", 4 * VOCAB)  # 4 rows per chunk
    model = tiny_qwen2()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (3, 14), generator=g)
    prompt_len, seq_len = torch.tensor([3, 5, 4]), torch.tensor([14, 12, 9])
    assert int((seq_len - prompt_len).sum()) % 4 == 3
    logp, ent = head.completion_logprobs(model, tokens, prompt_len, seq_len, 0.8, True,
                                         share_prompt=share_prompt)
    grads = torch.autograd.grad(logp.sum(), list(model.parameters()))
    ref, ref_ent = whole_logprobs(model, tokens, prompt_len, seq_len, 0.8)
    ref_grads = torch.autograd.grad(ref.sum(), list(model.parameters()))
    torch.testing.assert_close(logp, ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)
    for a, b in zip(grads, ref_grads, strict=True):
        error = ((a - b).norm() / b.norm()).item()
        assert error <= 1e-4, f"a gradient {error:.1e} off (relative)"


# ------------------------------------ g. gradient checkpointing acts in the training backward


@needs_model
@pytest.mark.parametrize("checkpointing", [True, False])
def test_gradient_checkpointing_recomputes_layers_in_the_training_backward(tmp_path, monkeypatch,
                                                                            checkpointing):
    """Regression guarded (found on the H200, docs/gpu/): the loaded model stays in eval mode
    through the update, and HF recomputes activations only in train mode, so
    model.gradient_checkpointing silently kept every layer's activations (+96 % training memory
    at Qwen2.5-1.5B's shape). Through train.py: with it on, each decoder layer runs again inside
    the backward; with it off, never."""
    replayed = []
    load = train.load_run_model

    def counting(*args, **kwargs):
        device, (model, *rest) = load(*args, **kwargs)
        mlp = next(m for name, m in model.named_modules() if name.endswith("layers.0.mlp"))
        in_backward = torch._C._current_graph_task_id  # -1 outside an autograd backward
        mlp.register_forward_pre_hook(lambda *_: replayed.append(in_backward() != -1))
        return device, (model, *rest)

    monkeypatch.setattr(train, "load_run_model", counting)
    run_metrics(tmp_path / "run", "--max_steps=1",
                f"--model.gradient_checkpointing={checkpointing}")
    assert len(replayed) > 0
    assert any(replayed) == checkpointing, f"{sum(replayed)} of {len(replayed)} calls in backward"


@needs_model
@pytest.mark.parametrize("tf32", [False, True])
def test_head_tf32_reaches_every_output_layer_gemm_and_nothing_else(tmp_path, monkeypatch, tf32):
    """model.head_tf32 (#50: the float32 output layer, the suspect for the update's 13 % MFU on an
    H100): through train.py, every GEMM of the output layer (the sampler's logits, the chunked
    log-prob pass and its backward, eval's generation) runs with CUDA's TF32 flag on, and only
    those: the flag is off again at every decoder layer and after the run. The CPU ignores the
    flag, so the run's metrics equal those of the run without it."""
    from support import logprobs

    seen = {"head": [], "layer": []}
    upcast = logprobs._upcast

    def recording(*args):
        seen["head"].append(torch.backends.cuda.matmul.allow_tf32)
        return upcast(*args)

    load = train.load_run_model

    def watching(*args, **kwargs):
        device, (model, *rest) = load(*args, **kwargs)
        mlp = next(m for name, m in model.named_modules() if name.endswith("layers.0.mlp"))
        mlp.register_forward_pre_hook(
            lambda *_: seen["layer"].append(torch.backends.cuda.matmul.allow_tf32))
        return device, (model, *rest)

    monkeypatch.setattr(logprobs, "_upcast", recording)
    monkeypatch.setattr(train, "load_run_model", watching)
    run_metrics(tmp_path / "on", "--max_steps=2", f"--model.head_tf32={tf32}")
    assert len(seen["head"]) > 0 and set(seen["head"]) == {tf32}
    assert set(seen["layer"]) == {False} and not torch.backends.cuda.matmul.allow_tf32
    if tf32:  # the same metrics (less the clocks) and final weights as without it, on a CPU
        run_metrics(tmp_path / "off", "--max_steps=2")
        sys.path.insert(0, str(REPO / "bench"))
        from fingerprint import digest

        assert digest(tmp_path / "on") == digest(tmp_path / "off")
