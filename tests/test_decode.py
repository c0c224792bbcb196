"""rollout.refill: support/decode.py's own decode loop (slots refilled as rows end, the host reading
the device every sync_every steps, Gumbel-max draws keyed by row): its draws, its samples against
HF generate's given the same draws, a row's independence of its slot and batch, stopping, the
config's rules, and a run through train.py that resumes bit for bit after SIGKILL.

  python -m pytest -q tests/test_decode.py        # ~1 min on 2 CPU cores
"""

import functools
import math

import pytest
import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

import rollout
from data.build_tiny_model import build_tokenizer
from rollout import RolloutConfig, generate
from support import decode
from support.logprobs import kv_cache, use_chunked_head
from support.preempt import Interrupted
from support.util import RunError
from test_checkpoint import (assert_same_run, kill_after_step_then_resume, metrics, needs_model,
                             run_train)
from test_logprobs import qwen2

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

STOP = list(range(20, 50))  # a random model's rows: about one in nine ends at each token
SAMPLINGS = [{}, {"top_k": 7}, {"top_p": 0.9, "temperature": 0.7}]


def test_gumbel_draws_are_a_function_of_seed_row_and_index_alone():
    """The noise of (row, t) is the same in any batch and order; another row, index or seed draws
    other noise; the draws are Gumbel(0, 1) (mean γ, variance π²/6, P(g < 0) = e^-1)."""
    rows, t = torch.tensor([0, 5, 9, 2]), torch.tensor([3, 3, 0, 7])
    g = decode.gumbel(11, rows, t, 100)  # (4, 100)
    perm = torch.tensor([2, 0, 3, 1])
    assert torch.equal(decode.gumbel(11, rows[perm], t[perm], 100), g[perm])
    assert torch.equal(decode.gumbel(11, rows[:1], t[:1], 100), g[:1])
    assert not torch.equal(decode.gumbel(12, rows, t, 100), g)
    assert not torch.equal(decode.gumbel(11, rows, t + 1, 100)[0], g[0])
    assert not torch.equal(g[0], g[1])  # rows 0 and 5 at the same index
    many = decode.gumbel(3, torch.arange(400), torch.zeros(400, dtype=torch.long), 500).double()
    assert abs(many.mean().item() - 0.5772157) < 0.01  # 200,000 draws: standard error 0.003
    assert abs(many.var().item() - math.pi**2 / 6) < 0.03
    assert abs((many < 0).double().mean().item() - math.exp(-1)) < 0.005


def test_gumbel_max_samples_the_softmax():
    """argmax(z + g) over 40,000 rows draws each token with probability softmax(z), within four
    standard errors."""
    z = torch.tensor([[1.0, 0.0, -1.0, 2.0, -math.inf, 0.5]])
    n = 40_000
    g = decode.gumbel(7, torch.arange(n), torch.zeros(n, dtype=torch.long), z.shape[1])
    counts = torch.bincount((z + g).argmax(-1), minlength=z.shape[1]).double() / n
    p = z.softmax(-1)[0].double()
    assert counts[4] == 0  # a cut token is never drawn
    assert ((counts - p).abs() <= 4 * (p * (1 - p) / n).sqrt() + 1e-12).all(), (counts, p)


class _SameDraws(LogitsProcessor):
    """HF generate, greedy, on the sampling logits plus the draws the refill loop takes: the token
    index t is the step, the row its place in the batch."""

    def __init__(self, seed: int):
        self.seed, self.t = seed, 0

    def __call__(self, input_ids, scores):
        rows = torch.arange(scores.shape[0])
        t = torch.full_like(rows, self.t)
        self.t += 1
        return scores + decode.gumbel(self.seed, rows, t, scores.shape[1])


def hf_with_draws(model, tok, rows: list[list[int]], cfg: RolloutConfig, seed: int):
    """(tokens, log-probs, entropies) (R, T) of HF generate given the refill loop's draws, 0 (and
    token -1) after a row's end."""
    use_chunked_head(model)
    batch = tok.pad({"input_ids": rows}, padding_side="left", return_tensors="pt")
    P = batch["input_ids"].shape[1]
    recorder = rollout._SamplingDistribution(cfg)
    gen = GenerationConfig(do_sample=False, max_new_tokens=cfg.max_new_tokens, eos_token_id=STOP,
                           pad_token_id=tok.pad_token_id)
    out = model.generate(**batch, generation_config=gen,
                         logits_processor=LogitsProcessorList([recorder, _SameDraws(seed)]),
                         **kv_cache(model, P + cfg.max_new_tokens))
    completion = out[:, P:]
    logp, entropy = recorder.finish(completion[:, -1])
    ended = torch.isin(completion, torch.tensor(STOP)).int().cumsum(1)
    after = (ended - torch.isin(completion, torch.tensor(STOP)).int()) > 0  # past the end token
    return (completion.masked_fill(after, -1), logp.masked_fill(after, 0),
            entropy.masked_fill(after, 0))


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["plain", "top_k", "top_p"])
def test_refill_samples_what_hf_generate_does_given_the_same_draws(sampling):
    """Prompts of several lengths, 3 rows each, 4 slots refilled every 3 steps, rows ending early:
    the same tokens as HF generate's (left-padded, one batch) given the same draws, behaviour
    log-probs and entropies within 5e-5 (float32: a prompt's pass alone, not in a padded batch, and
    4 rows a step, not 15, round otherwise; about 1e-5 apart)."""
    tok = build_tokenizer()
    model = qwen2(len(tok))
    prompts = [tok("1+" * (i + 1) + "=")["input_ids"] for i in range(5)]
    rows = [p for p in prompts for _ in range(3)]
    cfg = RolloutConfig(max_new_tokens=12, **sampling)
    tokens, logp, entropy = hf_with_draws(model, tok, rows, cfg, seed=99)
    own = decode.decode(model, rows, lambda z: rollout.sampling_distribution(z, cfg), STOP,
                        cfg.max_new_tokens, 4, 3, 99, lambda: False)
    T = tokens.shape[1]
    assert 1 < T and (tokens == -1).any()  # some rows ended early
    assert torch.equal(own[0][:, :T], tokens) and (own[0][:, T:] == -1).all()
    assert (own[1][:, :T] - logp).abs().max() <= 5e-5
    assert (own[2][:, :T] - entropy).abs().max() <= 5e-5
    assert (own[1][:, T:] == 0).all()


def test_a_row_does_not_depend_on_its_slot_or_its_companions():
    """Through rollout.generate: with 4 slots, refilled at every step or every 5, each row lands in
    other slots beside other rows, and its tokens, log-probs and entropies are the same bits; with
    as many slots as rows (no refill), or with rollout.pack_gqa, the same tokens, log-probs within
    5e-5."""
    tok = build_tokenizer()
    model = qwen2(len(tok))
    prompts = [tok("1+" * (i + 1) + "=")["input_ids"] for i in range(5)]
    out = {}
    for slots, every, pack in ((4, 1, False), (4, 5, False), (15, 2, False), (4, 3, True)):
        cfg = RolloutConfig(group_size=3, max_new_tokens=12, top_k=9, refill=True,
                            gen_batch_size=slots, sync_every=every, pack_gqa=pack)
        torch.manual_seed(0)
        out[slots, every, pack], _ = generate(model, tok, prompts, cfg, STOP)
    a, b = out[4, 1, False], out[4, 5, False]
    assert 0 < int(a.completion_len.min()) < 12  # some rows ended early
    for field in ("tokens", "behav_logp", "entropy", "completion_len"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    for other in (out[15, 2, False], out[4, 3, True]):  # no refill; with rollout.pack_gqa
        assert torch.equal(a.tokens, other.tokens)
        assert (a.behav_logp - other.behav_logp).abs().max() <= 5e-5


def test_compiled_decode_step_samples_what_the_eager_one_does(monkeypatch):
    """rollout.refill with rollout.static_cache compiles the slots' decode step (on a GPU: CUDA
    graphs); compiled here by inductor on the CPU: the same tokens as the eager step, log-probs
    and entropies within 5e-5 (inductor's kernels round otherwise), and calls with another seed,
    fewer rows and shorter prompts run the compiled graphs again, not a new compile; through
    rollout.generate (a new sampling function each call) the same."""
    tok = build_tokenizer()
    model = qwen2(len(tok))
    prompts = [tok("1+" * (i + 1) + "=")["input_ids"] for i in range(4) for _ in range(2)]
    cfg = RolloutConfig(max_new_tokens=10, top_p=0.9)
    sample = functools.partial(rollout.sampling_distribution, cfg=cfg)
    out, graphs = {}, []
    for compiled, seed in ((False, 5), (True, 5), (True, 6)):
        out[compiled, seed] = decode.decode(model, prompts, sample, STOP, 10, 3, 2, seed,
                                            lambda: False, compiled)
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    decode.decode(model, prompts[:2], sample, STOP, 10, 3, 2, 7, lambda: False, True)  # 2 rows,
    graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])  # shorter prompts
    a, b = out[False, 5], out[True, 5]
    assert torch.equal(a[0], b[0])
    assert (a[1] - b[1]).abs().max() <= 5e-5 and (a[2] - b[2]).abs().max() <= 5e-5
    assert not torch.equal(out[True, 6][0], b[0])
    assert graphs[0] < graphs[1] == graphs[2] == graphs[3]  # compiled at the first call only
    monkeypatch.setattr(decode, "COMPILE_ANYWHERE", True)  # through rollout.generate, as a GPU
    cfg = RolloutConfig(group_size=2, max_new_tokens=10, top_p=0.9, refill=True,
                        static_cache=True, gen_batch_size=3, sync_every=2)
    for seed in (0, 1):  # a new sampling function each call: the graphs serve again
        torch.manual_seed(seed)
        ro, _ = generate(model, tok, [tok("1+1=")["input_ids"], tok("2+2=")["input_ids"]], cfg,
                         STOP)
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert graphs[-1] == graphs[-2] and int(ro.completion_len.min()) >= 1


class _Float32Slots(decode.SlotCache):
    """The slots' cache storing K and V as they come (float32 keys under autocast)."""

    def __init__(self, config, slots: int, length: int, dtype=None):
        super().__init__(config, slots, length)


def test_refill_cache_holds_the_autocast_dtype(monkeypatch):
    """Under bf16 autocast the slots' K and V are stored in bf16 (half the float32 keys RoPE
    leaves), as the default path's cache does, and the tokens are the ones float32 storage gives
    (attention casts K and V to bf16 anyway)."""
    tok = build_tokenizer()
    model = qwen2(len(tok))
    prompts = [tok(f"{i}+{i * 7}=")["input_ids"] for i in range(3)]
    seen = []

    def keep_cache(module, args, kwargs):
        seen.append(kwargs.get("cache", kwargs.get("past_key_values")))

    model.register_forward_pre_hook(keep_cache, with_kwargs=True)
    cfg = RolloutConfig(group_size=2, max_new_tokens=10, refill=True, gen_batch_size=4)
    out = {}
    for name in ("bf16", "float32"):
        if name == "float32":
            monkeypatch.setattr(decode, "SlotCache", _Float32Slots)
        torch.manual_seed(0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out[name], _ = generate(model, tok, prompts, cfg, [])
        keys = seen[-1].storage[0][0]
        assert keys.dtype == {"bf16": torch.bfloat16, "float32": torch.float32}[name]
    assert torch.equal(out["bf16"].tokens, out["float32"].tokens)


def test_refill_stops_at_a_host_read_and_checks_finiteness():
    """A stop request ends generation at the next host read (Interrupted); NaN weights raise the
    sampler's error at the end."""
    tok = build_tokenizer()
    model = qwen2(len(tok))
    prompts = [tok("1+1=")["input_ids"]]
    cfg = RolloutConfig(group_size=4, max_new_tokens=30, refill=True, gen_batch_size=2,
                        sync_every=2)
    reads = []

    def second_read():
        reads.append(1)
        return len(reads) >= 2

    rollout_stop = rollout.should_stop
    try:
        rollout.should_stop = second_read
        with pytest.raises(Interrupted):
            generate(model, tok, prompts, cfg, [])
    finally:
        rollout.should_stop = rollout_stop
    assert len(reads) == 2  # read 1 passes, read 2 (after sync_every steps) stops
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.fill_(float("nan"))
    with pytest.raises(FloatingPointError, match="not finite"):
        generate(model, tok, prompts, cfg, [])


def test_refill_rules():
    """rollout.refill wants the hf engine; sync_every > 0; a model
    with sliding-window layers or another attention than sdpa is refused in one line."""
    ok, rule = RolloutConfig(refill=True, engine="vllm").check()["refill"]
    assert not ok and "vllm" in rule
    assert not RolloutConfig(sync_every=0).check()["sync_every"][0]
    model = qwen2(64)
    model.config.layer_types = ["sliding_attention", "full_attention"]
    with pytest.raises(RunError, match="sliding"):
        rollout.make_sampler("hf", model, None, [], "", RolloutConfig(refill=True),
                             torch.float32, 10)
    model.config.layer_types = ["full_attention"] * 2
    model.config._attn_implementation = "eager"
    with pytest.raises(RunError, match="sdpa"):
        decode.check_model(model)


REFILL = ("--rollout.refill=true", "--rollout.gen_batch_size=6", "--rollout.sync_every=3")


@needs_model
def test_refill_trains_through_train_py_and_resumes_bit_for_bit(tmp_path):
    """train.py with rollout.refill: the run learns from rows whose behaviour log-probs the update
    recomputes within float tolerance (rollout/logp_gap_max), and SIGKILL after step 3 then
    --resume gives the same metrics and final weights bit for bit (the draws' seed comes from the
    checkpointed RNG)."""
    ref = tmp_path / "ref"
    r = run_train(ref, *REFILL)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = metrics(ref)
    assert all(row["rollout/logp_gap_max"] < 1e-4 for row in rows)
    kill_after_step_then_resume(tmp_path / "killed", REFILL)
    assert_same_run(ref, tmp_path / "killed")
