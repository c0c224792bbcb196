"""rollout.engine=vllm (support/vllm.py) on this CPU with vLLM's CPU build: it samples the
distribution the trainer defines, returns the trainer's behaviour log-probs and sampling entropy,
takes new weights, stops at every end token, ignores the checkpoint's generation_config, and runs
dynamic sampling, RLEP phase I and an exact resume.

  pip install -r requirements-vllm.txt && pytest -q tests/test_vllm.py      # ~3 min on 2 idle cores

Skipped when vLLM is not installed, except under CI (CI=true), where a missing vLLM fails the
module. Engines live in this process, shared per model through the module (`engines`); runs of
train.py and eval.py are subprocesses."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import mpmath
import pytest
import torch

import grpo
from config import load_config, update_settings
from data.loaders import load_problems
from rewards import RewardConfig, score_batch
from rollout import RolloutConfig, _SamplingDistribution, sampling_logits
from support import vllm as vllm_engine
from support.logprobs import token_logprobs
from support.models import load_pretrained
from support.prompts import end_ids, prompt_ids

sys.path.insert(0, str(Path(__file__).parent))
import fixtures
from test_checkpoint import ENV, STEPS, TINY, assert_same_run, metrics, run_train, wait_for_step

if not vllm_engine.available():
    if os.environ.get("CI") == "true":
        raise RuntimeError("CI: vLLM is not installed (pip install -r requirements-vllm.txt)")
    pytest.skip(
        "vLLM is not installed (pip install -r requirements-vllm.txt)", allow_module_level=True
    )

from fixtures import REPO  # (tests/fixtures.py: the repository's root)
MODEL = REPO / "data" / "tiny_model"
SMALL_KV = 1 / 16  # GiB of KV cache per engine: plenty for these models, little memory


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """engines(folder) -> (engine, HF model, tokenizer), one engine per model folder for the whole
    module. All are closed at the end (closing one tears down vLLM's process groups, which every
    engine here shares)."""
    made = {}

    def get(folder: Path):
        if folder not in made:
            model, tok = load_pretrained(str(folder))
            cfg = RolloutConfig(vllm_kv_cache_gb=SMALL_KV)
            made[folder] = (
                vllm_engine.Engine(str(folder), cfg, torch.float32, torch.device("cpu"), 512),
                model,
                tok,
            )
        return made[folder]

    yield get
    for engine, _, _ in made.values():
        engine.close()


def cpu_heads(folder: Path) -> Path:
    """The fixture with 2 heads of 32 (1 KV head) instead of 4 of 16: the CPU backend's attention
    has no kernel for head size 16. Every weight keeps its shape (64 query, 32 key/value
    features)."""
    cfg = json.loads((folder / "config.json").read_text())
    if (cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]) == 16:
        cfg |= {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32}
        (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def trainer_sampling(model, ro, cfg: RolloutConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L) log-prob of each completion token and (B,) mean entropy under the trainer's sampling
    distribution: a plain forward's logits turned into it by rollout._SamplingDistribution (÷ T,
    top-k, top-p)."""
    t = torch.arange(ro.tokens.shape[1])[None]
    with torch.no_grad():
        logits = model(input_ids=ro.tokens, attention_mask=(t < ro.seq_len[:, None]).long()).logits
    logp, entropy = torch.zeros(ro.tokens.shape), torch.zeros(len(ro))
    for b in range(len(ro)):
        p, s = int(ro.prompt_len[b]), int(ro.seq_len[b])
        rec = _SamplingDistribution(cfg)
        rec(
            ro.tokens[b : b + 1], logits[b, p - 1 : s - 1]
        )  # (C, V): one position per row of the batch
        logp[b, p:s] = rec.prev.gather(1, ro.tokens[b, p:s, None]).squeeze(1)
        entropy[b] = rec.entropies[0].mean()
    return logp, entropy


def tiny_prompts(tok, n: int) -> list[list[int]]:
    return [
        prompt_ids(tok, p.problem, "{problem}", True) for p in load_problems("tiny_train", limit=n)
    ]


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's goodness-of-fit p-value; bins expecting fewer than 5 draws are pooled into one."""
    n = counts.sum()
    expected = probs * n
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]]).double()
    exp = torch.cat([expected[~small], expected[small].sum()[None]]).double()
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    return float(mpmath.gammainc(df / 2, stat / 2, mpmath.inf, regularized=True))


# ------------------------------------------------------------------------------------------- what
# is sampled


def test_vllm_samples_the_trainers_distribution(engines, tmp_path_factory):
    """Goodness of fit at T 0.7, top-p 0.9, top-k 20 (fixed seeds): 4000 one-token completions of a
    prompt to a random-weight Qwen3-shaped checkpoint (a flat distribution, so top-k and top-p both
    bind), against the trainer's sampling distribution. Tokens outside it never appear, the fit is
    not rejected, and the same draws reject the temperature-only distribution (what a lost
    top-k/top-p would sample)."""
    folder = fixtures.build("qwen3_base", tmp_path_factory.mktemp("gof") / "m")
    engine, model, tok = engines(folder)
    cfg = RolloutConfig(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=1, group_size=4000)
    prompt = prompt_ids(tok, "what is 3*4?", "{problem}", True)
    with torch.no_grad():
        last = model(input_ids=torch.tensor([prompt])).logits[0, -1:]  # (1, V)
    rec = _SamplingDistribution(cfg)
    rec(None, last)
    probs = rec.prev[0].exp()  # (V,) the trainer's sampling distribution
    got, _ = engine.generate(tok, [prompt], cfg, [], key=("gof", 0))
    counts = torch.bincount(got.tokens[:, len(prompt)], minlength=len(probs)).double()
    kept = int((probs > 0).sum())
    raw = torch.softmax(last[0].double() / 0.7, -1)
    p_fit, p_raw = chi_square_p(counts, probs.double()), chi_square_p(counts, raw)
    print(
        f"{kept} tokens kept (top-k 20, then top-p 0.9); p = {p_fit:.3f} against the trainer's "
        f"distribution, p = {p_raw:.2e} against temperature alone"
    )
    assert 3 <= kept < 20 and counts[probs == 0].sum() == 0  # top-k and top-p both bind
    assert p_fit > 1e-3 and p_raw < 1e-3


def replace_cfg(cfg: RolloutConfig, **kw) -> RolloutConfig:
    from dataclasses import replace

    return replace(cfg, **kw)


@pytest.mark.parametrize("sampling", [(1.0, 1.0, 0), (0.7, 0.9, 20)], ids=["T1", "T0.7-p0.9-k20"])
def test_vllm_behaviour_logprobs_equal_the_trainers(engines, sampling):
    """32 prompts x 8 in fp32: every completion token's behaviour log-prob is the trainer's sampling
    log-prob within 1e-4, and each row's sampling entropy (the engine gives none: the sampler
    measures it with the trainer's model, top-k and top-p included) is the trainer's."""
    engine, model, tok = engines(MODEL)
    T, top_p, top_k = sampling
    cfg = RolloutConfig(temperature=T, top_p=top_p, top_k=top_k, group_size=8, max_new_tokens=48)
    stop = end_ids(tok, model, True, [])
    sampler = vllm_engine.VLLMSampler(model, tok, stop, engine, torch.float32,
                                      torch.device("cpu"), False, sampling_logits)
    ro, texts = sampler.generate(tiny_prompts(tok, 32), cfg, key=("lp",))
    logp, entropy = trainer_sampling(model, ro, cfg)
    m = ro.completion_mask()
    gap = (logp[m] - ro.behav_logp[m]).abs()
    print(
        f"{int(m.sum())} tokens: max |behaviour - trainer| = {gap.max():.2e}, mean {gap.mean():.2e}"
    )
    assert gap.max() <= 1e-4 and len(texts) == 256 and not ro.behav_logp[~m].any()
    assert (ro.entropy - entropy).abs().max() <= 1e-4


def test_vllm_seeds_make_samples_reproducible(engines):
    engine, model, tok = engines(MODEL)
    cfg, stop = RolloutConfig(group_size=4, max_new_tokens=24), end_ids(tok, model, True, [])
    a, _ = engine.generate(tok, tiny_prompts(tok, 8), cfg, stop, key=("seed", 1))
    b, _ = engine.generate(
        tok, tiny_prompts(tok, 8)[:4], cfg, stop, key=("seed", 1)
    )  # fewer requests beside
    c, _ = engine.generate(tok, tiny_prompts(tok, 8), cfg, stop, key=("seed", 2))
    assert torch.equal(a.tokens[:16, : b.tokens.shape[1]], b.tokens[:, : a.tokens.shape[1]])
    assert not torch.equal(a.tokens, c.tokens)


# ---------------------------------------------------------------------------------------------
# weight sync


def test_vllm_sync_after_an_update(engines):
    """One real update (grpo.update_policy on engine rollouts): before the sync the engine still
    samples the old policy; after VLLMSampler.sync its log-probs are the updated policy's."""
    engine, model, tok = engines(MODEL)
    policy, _ = load_pretrained(str(MODEL))
    cfg = load_config(str(REPO / "configs" / "tiny.yaml"), ["--optim.lr=1e-2"])
    stop, prompts = end_ids(tok, model, True, []), tiny_prompts(tok, 8)
    ro, texts = engine.generate(tok, prompts, cfg.rollout, stop, key=("update",))
    ro.reward = torch.tensor(
        score_batch(
            texts,
            [p.answer for p in load_problems("tiny_train", limit=8) for _ in range(8)],
            RewardConfig(),
        )[0]
    )
    ro.advantage, _ = grpo.group_advantages(ro.reward, ro.group)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.optim.lr)
    _, _, skipped, _ = grpo.update_policy(update_settings(cfg), policy, policy, optimizer, ro,
                                          torch.device("cpu"))
    assert skipped == [None]
    sampler = vllm_engine.VLLMSampler(policy, tok, stop, engine, torch.float32,
                                      torch.device("cpu"), False, sampling_logits)
    calls, real_sync = [], engine.sync
    engine.sync = lambda weights: calls.append(1) or real_sync(weights)
    probe = RolloutConfig(group_size=4, max_new_tokens=32)
    try:
        stale, _ = engine.generate(tok, prompts, probe, stop, key=("probe",))
        stale_gap = (trainer_sampling(policy, stale, probe)[0] - stale.behav_logp).abs().max()
        t0 = time.perf_counter()
        sampler.sync(policy)
        seconds = time.perf_counter() - t0
        fresh, _ = engine.generate(tok, prompts, probe, stop, key=("probe",))
        gap = (trainer_sampling(policy, fresh, probe)[0] - fresh.behav_logp).abs().max()
        print(f"before the sync {stale_gap:.2e}, after {gap:.2e}; the sync took {seconds:.3f} s")
        assert stale_gap > 1e-2 and gap <= 1e-4 and len(calls) == 1
    finally:
        engine.sync = real_sync
        engine.sync(
            vllm_engine.full_parameters(model, torch.float32)
        )  # the module's engine back as it was


# ------------------------------------------------------------------------------------- checkpoint
# folders


@pytest.mark.parametrize("kind", list(fixtures.KINDS))
def test_vllm_end_of_turn_stops_generation(engines, tmp_path_factory, kind):
    """The chat fixtures made to answer `\\boxed{4}` then their end-of-turn token: the engine stops
    there, keeps the token, and the text is the answer (Qwen3-Base's end of turn is not its eos:
    only end_ids stops it)."""
    folder = cpu_heads(fixtures.build(kind, tmp_path_factory.mktemp(kind) / "m", emit="\\boxed{4}"))
    engine, model, tok = engines(folder)
    stop = end_ids(tok, model, True, [])
    eot = tok.convert_tokens_to_ids(fixtures.KINDS[kind]["end_of_turn"])
    ro, texts = engine.generate(
        tok,
        [prompt_ids(tok, "2+2", "{problem}", True)],
        RolloutConfig(group_size=4, max_new_tokens=40),
        stop,
        key=("eot",),
    )
    assert texts == ["\\boxed{4}"] * 4 and not ro.truncated.any()
    assert (ro.tokens[torch.arange(4), ro.seq_len - 1] == eot).all()
    assert (
        ro.completion_len == len(tok("\\boxed{4}", add_special_tokens=False)["input_ids"]) + 1
    ).all()


def test_vllm_ignores_the_checkpoints_generation_config(engines, tmp_path):
    """A generation_config with repetition penalty 5, top-k 3, min length 20, temperature 0.3: the
    behaviour log-probs are still the trainer's (T 1, nothing cut; each setting would move them),
    and completions end before 20 tokens."""
    folder = cpu_heads(fixtures.build("qwen25_instruct", tmp_path / "m"))
    gen = json.loads((folder / "generation_config.json").read_text())
    gen |= {
        "repetition_penalty": 5.0,
        "top_k": 3,
        "min_new_tokens": 20,
        "min_length": 20,
        "temperature": 0.3,
    }
    (folder / "generation_config.json").write_text(json.dumps(gen))
    engine, model, tok = engines(folder)
    cfg = RolloutConfig(group_size=16, max_new_tokens=24)
    prompts = [prompt_ids(tok, q, "{problem}", True) for q in ("1+1", "what is 3*4?", "7/8 - 1/8")]
    stop = end_ids(tok, model, True, []) + [
        tok.convert_tokens_to_ids("a")
    ]  # an end that comes early
    ro, _ = engine.generate(tok, prompts, cfg, stop, key=("gencfg",))
    m = ro.completion_mask()
    gap = (trainer_sampling(model, ro, cfg)[0][m] - ro.behav_logp[m]).abs().max().item()
    print(
        f"max |behaviour - trainer| = {gap:.2e}; shortest completion {int(ro.completion_len.min())}"
    )
    assert gap <= 1e-4 and int(ro.completion_len.min()) < 20


# ----------------------------------------------------------------------------------- train.py and
# eval.py


def run_py(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    r = subprocess.run(
        [sys.executable, *args],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    return r


def test_vllm_rlep_phase_one_and_dynamic_sampling(tmp_path):
    """eval.py --engine vllm --save-correct writes phase I (the engine's token ids with their
    behaviour log-probs, equal to the trainer's); train.py with the engine replays it (RLEP) under
    dynamic sampling."""
    phase1 = tmp_path / "phase1.jsonl"
    run_py(
        "eval.py",
        "--model",
        str(MODEL),
        "--benchmarks",
        "tiny_train",
        "--limit",
        "48",
        "--k",
        "8",
        "--max-new-tokens",
        "48",
        "--template",
        "{problem}",
        "--temperature",
        "1",
        "--top-p",
        "1",
        "--engine",
        "vllm",
        "--save-correct",
        str(phase1),
        "--out-dir",
        str(tmp_path / "eval"),
    )
    rows = [json.loads(ln) for ln in phase1.read_text().splitlines()]
    model, tok = load_pretrained(str(MODEL))
    problems = {p.problem: p for p in load_problems("tiny_train", limit=48)}
    assert len(rows) >= 64
    for row in rows[:16]:
        p = prompt_ids(tok, problems[row["problem"]].problem, "{problem}", True)
        seq = torch.tensor([p + row["completion_ids"]])
        lp, _ = token_logprobs(model, seq, torch.ones_like(seq), 1.0)
        assert (lp[0, len(p) :] - torch.tensor(row["behav_logp"])).abs().max() <= 1e-4
    out = tmp_path / "run"
    run_py(
        "train.py",
        "--config",
        "configs/tiny.yaml",
        "--rollout.engine=vllm",
        f"--out_dir={out}",
        "--max_steps=2",
        "--rollout.batch_size=32",
        "--rollout.dynamic_sampling=4",
        "--eval.n=8",
        "--eval.k=1",
        "--checkpoint.every=0",
        "--wandb.mode=disabled",
        "--replay.strategy=rlep",
        f"--replay.rlep_source={phase1}",
        "--data.tiny.train_size=48",  # phase I's problems: their stored successes join the groups
        "--rollout.vllm_kv_cache_gb=0.0625",
    )
    steps = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    assert all(s["dynamic/rounds"] >= 1 and s["replay/rows"] > 0 for s in steps)
    assert steps[0]["time/weight_sync"] > 0 and math.isfinite(steps[-1]["eval/entropy"])


def test_vllm_sigkill_mid_run_then_resume_is_bit_identical(tmp_path):
    """tests/test_checkpoint.py's resume test with rollout.engine=vllm: an uninterrupted run, then
    one killed after step 3 and resumed from its step-2 checkpoint; metrics and final weights are
    identical."""
    engine = ("--rollout.engine=vllm", "--rollout.vllm_kv_cache_gb=0.0625")
    reference = tmp_path / "reference"
    r = run_train(reference, *engine, python=[sys.executable, "train.py"])  # (vLLM: its own)
    assert r.returncode == 0, r.stderr[-3000:]
    assert metrics(reference)[-1]["skipped/zero_adv"] < STEPS - 2  # optimizer steps to restore
    out = tmp_path / "run"
    cmd = (
        [sys.executable, "train.py"] + TINY + [f"--out_dir={out}", f"--max_steps={STEPS}", *engine]
    )
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    if wait_for_step(proc, out / "metrics.jsonl", 3):
        proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL, "the run ended before it could be killed"
    r = run_train(out, "--resume", *engine, python=[sys.executable, "train.py"])
    assert r.returncode == 0 and "resuming from" in r.stderr, r.stderr[-3000:]
    assert_same_run(reference, out)
