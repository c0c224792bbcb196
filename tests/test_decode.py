"""rollout.refill: support/decode.py's own decode loop (slots refilled as rows end, the host reading
the device every sync_every steps, Gumbel-max draws keyed by row): its draws, its samples against
HF generate's given the same draws, a row's independence of its slot and batch, stopping, the
config's rules, and a run through train.py that resumes bit for bit after SIGKILL.

  python -m pytest -q tests/test_decode.py        # ~1 min on 2 CPU cores
"""

import contextlib
import functools
import math
import re

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

import rollout
from data.build_tiny_model import build_tokenizer
from rollout import RolloutConfig, generate
from support import decode, logprobs
from support.kvcache import kv_cache
from support.logprobs import use_chunked_head
from support.preempt import Interrupted
from support.util import RunError
from safetensors.torch import load_file
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


QWEN_VOCAB = 151_936  # Qwen2.5's output layer


def test_gumbel_noise_is_finite_at_a_real_vocabulary():
    """10^8 noise entries at Qwen's vocabulary (660 rows of 151,936) are all finite and below
    −log(−log(1 − 2^-24)) ≈ 16.64: no u rounds to 1 (with 24 bits one entry in 2^24 did: +inf
    noise about once per row-step at this vocabulary)."""
    top = 0.0
    for chunk in range(6):
        rows = torch.arange(chunk * 110, (chunk + 1) * 110)
        g = decode.gumbel(2024 + chunk, rows, rows % 7, QWEN_VOCAB)  # (110, V)
        assert torch.isfinite(g).all(), f"chunk {chunk}: {(~torch.isfinite(g)).sum()} not finite"
        top = max(top, float(g.max()))
    assert 16 < top <= -math.log(-math.log1p(-(2.0**-24))) + 1e-4


def test_refill_draws_stay_in_the_top_k_and_top_p_support_at_a_real_vocabulary():
    """2,000 draws at Qwen's vocabulary from logits cut to the top 20 (and to a 0.9 nucleus of the
    top 50): every token lies in the support, i.e. has a finite behaviour log-prob (noise +inf on
    a cut entry gave −inf + inf = NaN, and a token outside it about once in a hundred draws)."""
    gen = torch.Generator().manual_seed(0)
    for sampling in ({"top_k": 20}, {"top_p": 0.9, "top_k": 50}):
        sample = functools.partial(rollout.sampling_distribution, cfg=RolloutConfig(**sampling))
        for chunk in range(2):
            scores = 3 * torch.randn(500, QWEN_VOCAB, generator=gen)
            rows = torch.arange(chunk * 500, (chunk + 1) * 500)
            nxt, lp, _, finite = decode._sampled(scores, sample, 5, rows, torch.zeros_like(rows))
            assert bool(finite) and torch.isfinite(lp).all(), (sampling, (~lp.isfinite()).sum())


def test_gumbel_max_frequencies_match_the_distribution_at_a_real_vocabulary():
    """Chi-square over 2,400 draws at Qwen's vocabulary: 8 likely entries and the other 151,928
    as one bin of mass 2.5 × 10^-3, each draw a row of its own. The statistic (8 degrees of
    freedom) stays below 26.1 (p = 0.001); a uniformly random draw once per row-step in a hundred
    (u rounded to 1) puts about 28 draws in the last bin where 6 are expected."""
    z = torch.full((QWEN_VOCAB,), -math.inf)
    likely = torch.tensor([3, 900, 151_935, 77_000, 5, 12_345, 100_000, 42])
    z[likely] = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, 0.3])
    rest = torch.ones(QWEN_VOCAB, dtype=torch.bool)
    rest[likely] = False
    z[rest] = math.log(2.5e-3 / QWEN_VOCAB)  # the rest, spread evenly: about 2.5e-3 in all
    p = z.softmax(-1).double()
    expected = torch.cat([p[likely], p[rest].sum()[None]])  # (9,)
    n, counts = 2400, torch.zeros(9, dtype=torch.float64)
    bin_of = torch.full((QWEN_VOCAB,), 8)
    bin_of[likely] = torch.arange(8)
    for start in range(0, n, 400):
        rows = torch.arange(start, start + 400)
        drawn = (z + decode.gumbel(31, rows, torch.zeros_like(rows), QWEN_VOCAB)).argmax(-1)
        counts += torch.bincount(bin_of[drawn], minlength=9).double()
    chi2 = float(((counts - n * expected) ** 2 / (n * expected)).sum())
    assert chi2 < 26.1, (chi2, counts.tolist(), (n * expected).tolist())


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


def test_refill_stops_within_a_step_and_checks_finiteness():
    """A stop request ends generation before the next decode step (Interrupted), not at the next
    host read; NaN weights raise the sampler's error at the end."""
    tok = build_tokenizer()
    model = qwen2(len(tok))
    prompts = [tok("1+1=")["input_ids"]]
    cfg = RolloutConfig(group_size=4, max_new_tokens=30, refill=True, gen_batch_size=2,
                        sync_every=25)
    reads, passes = [], []
    hook = model.register_forward_pre_hook(lambda module, args: passes.append(1))

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
    assert len(reads) == 2  # asked before every step: the first passes, the second stops
    assert len(passes) == 1  # the prompt's pass, no decode step (before: 25 steps to the read)
    hook.remove()
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


def test_refill_steps_between_host_reads_stop_where_the_rows_can_end():
    """sync_every = 10^6 with 12 new tokens at most: the rollout takes at most 12 decode steps
    after its host read (not 10^6: the model's forward is counted, and refused past 100)."""
    tok = build_tokenizer()
    model = qwen2(len(tok))
    calls = []

    def count(module, args):
        calls.append(1)
        assert len(calls) <= 100, "decode steps past what any row can need"

    model.register_forward_pre_hook(count)
    prompts = [tok("1+1=")["input_ids"]] * 4
    cfg = RolloutConfig(group_size=1, max_new_tokens=12, refill=True, gen_batch_size=4,
                        sync_every=10**6)
    torch.manual_seed(0)
    ro, _ = generate(model, tok, prompts, cfg, STOP)
    assert len(calls) <= 1 + 11  # one prompt pass, then at most max_new − 1 decode steps
    assert int(ro.completion_len.max()) <= 12


class _HostReads(TorchDispatchMode):
    """Appends "R" to `events` at each read of a tensor's value on the host (item, int, bool:
    aten's _local_scalar_dense; on a GPU, a sync)."""

    def __init__(self, events: list[str]):
        super().__init__()
        self.events = events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.events.append("R")
        return func(*args, **(kwargs or {}))


def test_refill_reads_the_host_every_sync_every_steps(monkeypatch):
    """Through rollout.generate with no end token (every row runs 12 tokens: 11 decode steps after
    its first), 4 rows in 2 slots (a refill): the decode steps between two host reads (item, int,
    bool, tolist) come in runs of sync_every, the last of a row's runs shorter; a larger
    sync_every reads the host less often. Before, no test counted the reads: reading at every
    step, or a fixed number of steps whatever sync_every, passed."""
    tok = build_tokenizer()
    model = qwen2(len(tok))
    prompts = [tok("1+1=")["input_ids"], tok("2+3=")["input_ids"]]
    events = []

    def step_or_prefill(module, args, kwargs):
        events.append("S" if "position_ids" in kwargs else "P")  # a decode step passes positions

    model.register_forward_pre_hook(step_or_prefill, with_kwargs=True)
    tolist = torch.Tensor.tolist

    def read_list(x):
        events.append("R")
        return tolist(x)

    monkeypatch.setattr(torch.Tensor, "tolist", read_list)
    reads = {}
    for every, runs in ((1, [1] * 11), (3, [3, 3, 3, 2]), (5, [5, 5, 1]), (100, [11])):
        cfg = RolloutConfig(group_size=2, max_new_tokens=12, refill=True, gen_batch_size=2,
                            sync_every=every)
        events.clear()
        torch.manual_seed(0)
        with _HostReads(events):
            ro, _ = generate(model, tok, prompts, cfg, [])
        assert ro.completion_len.tolist() == [12] * 4
        decoding = "".join(events).replace("P", "").strip("R")  # first step to last
        assert [len(run) for run in re.findall("S+", decoding)] == runs * 2, (every, decoding)
        reads[every] = decoding.count("R")
    assert reads[1] > reads[3] > reads[5] > reads[100] > 0


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


@needs_model
def test_refill_with_a_huge_sync_every_ends_and_trains_as_with_a_small_one(tmp_path):
    """rollout.sync_every = 10^6 (allowed) with short completions: a rollout ends once its rows
    have (the steps between host reads stop at what the live rows can still need), and the run
    logs the same metrics and weights as sync_every = 3 (draws keyed by row, not by when the host
    reads). Before, the loop ran 10^6 steps after its rows had ended."""
    a, b = tmp_path / "every3", tmp_path / "every1e6"
    for out, every in ((a, 3), (b, 10**6)):
        args = [*REFILL[:-1], f"--rollout.sync_every={every}"]
        r = run_train(out, *args, "--eval.every=0", steps=2)
        assert r.returncode == 0, r.stderr[-3000:]
    assert metrics(a) == metrics(b)
    wa, wb = (load_file(d / "final" / "model.safetensors") for d in (a, b))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_bf16_head_is_made_float32_once_per_rollout_with_the_same_numbers(monkeypatch):
    """A bf16 model's output layer: one float32 copy for the whole rollout (support.logprobs
    float32_head; before: a conversion per decode step), and the same tokens, log-probs and
    entropies, bit for bit, as converting at every step; on the default path and refill's."""
    tok = build_tokenizer()
    model = qwen2(len(tok), dtype=torch.bfloat16)
    prompts = [tok("1+2=")["input_ids"], tok("3+4=")["input_ids"]]
    real, calls = logprobs._upcast, []

    def counted(*a):
        calls.append(1)
        return real(*a)

    monkeypatch.setattr(logprobs, "_upcast", counted)
    for refill in (False, True):
        cfg = RolloutConfig(group_size=2, max_new_tokens=10, refill=refill, gen_batch_size=4)
        out = {}
        for once in (True, False):
            if not once:  # the per-step conversion, as before
                monkeypatch.setattr(rollout, "float32_head", lambda model: contextlib.nullcontext())
            calls.clear()
            torch.manual_seed(0)
            out[once], _ = generate(model, tok, prompts, cfg, [])
            forwards = int(out[once].completion_len.max())  # at least: one per token index
            if once:
                assert len(calls) == 1, (refill, len(calls))
            else:
                assert len(calls) >= forwards, (refill, len(calls))
        monkeypatch.undo()
        monkeypatch.setattr(logprobs, "_upcast", counted)
        for field in ("tokens", "behav_logp", "entropy"):
            assert torch.equal(getattr(out[True], field), getattr(out[False], field)), field
