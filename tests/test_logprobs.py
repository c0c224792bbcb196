"""The output layer in chunks (support.logprobs._ChunkedHead): the same log-probs, entropies and
gradients as the whole (tokens, vocab) logits, in float32 even under bf16 autocast; the
behaviour-vs-trainer gap metric; token-budget micro-batches; the generation KV cache's dtype; the
sampler's finiteness check.

  python -m pytest -q tests/test_logprobs.py        # ~1 min on 2 CPU cores
"""

import sys

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from transformers import AutoModelForCausalLM, Qwen2Config
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import grpo
import rollout
from bench.generation import CountOps
from bench.gpu_check import counting_all_gathers
from config import update_settings
from data.build_tiny_model import build_tokenizer
from metrics import gap_metrics, logp_gap
from rollout import RolloutConfig, generate
from support import logprobs, parallel
from support.parallel import hf_module
from tests.fixtures import f32_tol, worker_results, write_result
from tests.test_scale import one_update, synthetic_batch, tiny_qwen3, update_cfg

QWEN_VOCAB = 151936  # Qwen2.5's real vocabulary


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def qwen2(vocab: int, dtype=torch.float32, seed: int = 0):
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True)
    return AutoModelForCausalLM.from_config(cfg).to(dtype)


def reference_logprobs(model, tokens, prompt_len, seq_len, temperature):
    """(B, L) log-probs and entropies from the whole logits (B, L, V): the decoder, then the output
    layer and log_softmax in one piece, in the model's dtype (at least float32, autocast off)."""
    ar = torch.arange(tokens.shape[1])
    am = (ar[None] < seq_len[:, None]).long()
    hidden = model.model(input_ids=tokens, attention_mask=am).last_hidden_state  # (B, L, H)
    w = model.get_output_embeddings().weight
    dtype = torch.promote_types(hidden.dtype, torch.float32)
    with torch.autocast("cpu", enabled=False):  # the decoder ran under the caller's autocast
        z = F.linear(hidden.to(dtype), w.to(dtype))[:, :-1] / temperature  # (B, L−1, V)
        lsm = torch.log_softmax(z, dim=-1)
    logp = F.pad(lsm.gather(-1, tokens[:, 1:, None]).squeeze(-1), (1, 0))
    ent = F.pad(-(lsm.exp() * lsm).sum(-1), (1, 0))
    comp = (ar[None] >= prompt_len[:, None]) & (ar[None] < seq_len[:, None])
    return torch.where(comp, logp, 0.0), torch.where(comp, ent, 0.0).detach()


def rows(vocab: int, B: int = 4, L: int = 23, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (B, L), generator=g)
    prompt_len = torch.tensor([3, 5, 3, 7])[:B]
    seq_len = torch.tensor([L, L - 6, L - 2, 12])[:B]
    return tokens, prompt_len, seq_len


@pytest.mark.parametrize("share_prompt", [False, True])
def test_chunked_head_equals_whole_logits_float64(monkeypatch, share_prompt):
    """Chunks of 3 rows (HEAD_CHUNK / V) against the whole (B, L, V) float64 logits: values,
    entropies and every parameter's gradient to float64 round-off, at the real vocabulary."""
    monkeypatch.setattr(logprobs, "HEAD_CHUNK", 3 * QWEN_VOCAB)
    model = qwen2(QWEN_VOCAB, torch.float64)
    tokens, prompt_len, seq_len = rows(QWEN_VOCAB)
    w = torch.randn(tokens.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    logp, ent = logprobs.completion_logprobs(model, tokens, prompt_len, seq_len, 0.7, True,
                                             share_prompt)
    grads = torch.autograd.grad((logp * w).sum(), list(model.parameters()))
    ref, ref_ent = reference_logprobs(model, tokens, prompt_len, seq_len, 0.7)
    ref_grads = torch.autograd.grad((ref * w).sum(), list(model.parameters()))
    assert logp.dtype == torch.float64 and not ent.requires_grad
    torch.testing.assert_close(logp, ref, atol=1e-10, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-10, rtol=0)
    for a, b in zip(grads, ref_grads, strict=True):  # Qwen2's RMSNorm runs in float32 even here
        assert (a - b).norm() <= 1e-6 * b.norm()


def logp_tol(logp: torch.Tensor, logits: float, hidden: int, vocab: int) -> float:
    """float32 z_t − logsumexp(z) computed in two orders: each logit sums `hidden` products (at
    |z| ≤ `logits`), the sum of `vocab` exponentials has a relative error that its log turns into
    an absolute one, and the subtraction rounds at |log-prob|."""
    return f32_tol(logits, hidden) + f32_tol(1.0, vocab) + f32_tol(logp.abs().max().item())


@pytest.mark.fast
def test_f32_tol_holds_reordered_float32_sums_and_not_a_dropped_term():
    """tests/fixtures.py's f32_tol pinned from both sides, on sums of n float32 numbers within 25 %
    of their mean at three scales: torch's sum, a running sum (4 columns at a time) and a sum of
    16-term chunks differ by less than f32_tol(sum, n) (16 to 16,384 terms); leaving one term out
    of 16,384 (1.5 to 2.5 tolerances) is outside it. Before, nothing pinned it: 200 rounding steps
    instead of 2, or a tolerance growing as n instead of √n, passed every test."""
    g = torch.Generator().manual_seed(0)
    for scale in (1e-3, 1.0, 1e3):
        for n in (16, 256, 4096, 16384):
            x = (torch.rand(2**18 // n, n, generator=g) * 0.5 + 0.75) * scale  # (draws, n)
            whole = x.sum(1)  # (draws,)
            tol = torch.tensor([f32_tol(s, n) for s in whole.tolist()], dtype=torch.float64)
            running = torch.zeros_like(x[:, :4])
            for four in x.view(len(x), -1, 4).unbind(1):  # in order, a float32 sum each time
                running += four
            chunks = x.view(len(x), -1, 16).sum(2).sum(1)
            for other in (running.sum(1), chunks):
                assert ((other.double() - whole.double()).abs() < tol).all(), (scale, n)
            if n == 16384:  # one term left out: off by 0.75 to 1.25 of sum / n
                dropped = x[:, 1:].sum(1)
                assert ((dropped.double() - whole.double()).abs() > tol).all(), scale


def test_chunked_head_equals_whole_logits_float32(monkeypatch):
    """The float32 path (what a float32 run computes): the same values, entropies and gradients as
    the whole logits, to float32 round-off derived from the magnitudes and the terms summed (a
    temperature of 1.001, or a chunk left out, is outside it)."""
    monkeypatch.setattr(logprobs, "HEAD_CHUNK", 5 * QWEN_VOCAB)
    model = qwen2(QWEN_VOCAB)
    tokens, prompt_len, seq_len = rows(QWEN_VOCAB)
    logp, ent = logprobs.completion_logprobs(model, tokens, prompt_len, seq_len, 1.0, True,
                                             share_prompt=False)
    grads = torch.autograd.grad(logp.sum(), list(model.parameters()))
    ref, ref_ent = reference_logprobs(model, tokens, prompt_len, seq_len, 1.0)
    ref_grads = torch.autograd.grad(ref.sum(), list(model.parameters()))
    with torch.no_grad():
        hidden = model.model(input_ids=tokens).last_hidden_state
        logits = (hidden @ model.lm_head.weight.T).abs().max().item()
    tol = logp_tol(ref, logits, hidden.shape[-1], QWEN_VOCAB)
    torch.testing.assert_close(logp, ref, atol=tol, rtol=0)
    # the entropy sums `vocab` terms −p·log p, at ~12 nats
    torch.testing.assert_close(ent, ref_ent, atol=f32_tol(ref_ent.abs().max(), QWEN_VOCAB), rtol=0)
    for a, b in zip(grads, ref_grads, strict=True):  # each sums over the vocabulary (and rows)
        assert (a - b).norm() <= f32_tol(b.norm().item(), QWEN_VOCAB)


def test_chunked_head_with_bias_hand_values():
    """An output layer with a bias (a one-token model: the hidden state is fixed), against
    log_softmax by hand."""
    head = torch.nn.Linear(2, 3, dtype=torch.float64)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]]))
        head.bias.copy_(torch.tensor([0.5, -1.0, 0.0]))
    h = torch.tensor([[1.0, 1.0], [0.0, -1.0]], dtype=torch.float64, requires_grad=True)  # (2, 2)
    targets = torch.tensor([1, 2])
    logp, ent = logprobs._ChunkedHead.apply(h, head.weight, head.bias, targets, 2.0, True)
    z = (h @ head.weight.T + head.bias) / 2.0  # [[0.75, 0.5, 1.0], [0.25, -1.5, -0.5]]
    lsm = torch.log_softmax(z, -1)
    torch.testing.assert_close(logp, lsm[[0, 1], [1, 2]], atol=1e-12, rtol=0)
    torch.testing.assert_close(ent, -(lsm.exp() * lsm).sum(-1).detach(), atol=1e-12, rtol=0)
    got = torch.autograd.grad(logp.sum(), [h, head.weight, head.bias])
    want = torch.autograd.grad(lsm[[0, 1], [1, 2]].sum(), [h, head.weight, head.bias])
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def test_chunked_head_runs_in_float32_under_bf16_autocast():
    """Under autocast the output layer used to return bf16 logits (rounded by up to 1/16 at |z| ~
    10): now the log-probs equal float32 logits of the same (autocast) hidden states."""
    model = qwen2(QWEN_VOCAB)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8)  # logits of a trained model's size
    tokens, prompt_len, seq_len = rows(QWEN_VOCAB)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logp, _ = logprobs.completion_logprobs(model, tokens, prompt_len, seq_len, 1.0,
                                               share_prompt=False)
        ref, _ = reference_logprobs(model, tokens, prompt_len, seq_len, 1.0)
        bf16_logits = model.model(input_ids=tokens).last_hidden_state @ model.lm_head.weight.T
    assert bf16_logits.dtype == torch.bfloat16  # what the output layer computed before
    assert logp.dtype == torch.float32
    logits = bf16_logits.float().abs().max().item()
    tol = logp_tol(ref, logits, model.config.hidden_size, QWEN_VOCAB)
    torch.testing.assert_close(logp, ref, atol=tol, rtol=0)


def test_compiled_model_is_unwrapped():
    """torch.compile and DDP wrappers are looked through: the FSDP check of the shared-prompt path
    and the output layer both see the HF model."""
    model = tiny_qwen3(60)
    compiled = torch.compile(model, backend="eager")
    assert hf_module(compiled) is model
    assert logprobs.output_layer(compiled) is model.get_output_embeddings()


# ------------------------------------------------------------------------------ the gap metric


@pytest.mark.parametrize("minibatches", [1, 2])
def test_logp_gap_metric_counts_fresh_tokens_at_the_sampling_weights(minibatches):
    """behav_logp = the trainer's own log-probs + 0.25 on fresh rows with A ≠ 0, + 0.5 on fresh rows
    with A = 0 and + 3 on replayed rows: the gap is 0.25 with one optimizer step (rows with A = 0
    are not run), and over every fresh row (mean between 0.25 and 0.5, max 0.5) when the π_prox pass
    covers them; replayed rows never count."""
    batch = synthetic_batch(60)
    cfg = update_cfg("dapo")
    cfg.optim.minibatches = minibatches
    model = tiny_qwen3(60)
    with torch.no_grad():
        lp, _ = logprobs.completion_logprobs(model, batch.tokens, batch.prompt_len, batch.seq_len,
                                             cfg.rollout.temperature)
    offset = torch.where(batch.replayed, 3.0, torch.where(batch.advantage == 0, 0.5, 0.25))  # (B,)
    batch.behav_logp = torch.where(batch.completion_mask(), lp + offset[:, None], 0.0)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    metrics, _, _, _ = grpo.update_policy(update_settings(cfg), model, model, opt, batch,
                                          torch.device("cpu"))
    if minibatches == 1:
        assert metrics["rollout/logp_gap_mean"] == pytest.approx(0.25, abs=1e-5)
        assert metrics["rollout/logp_gap_max"] == pytest.approx(0.25, abs=1e-5)
    else:
        fresh = ~batch.replayed
        n = batch.completion_len.double()
        want = (n * offset)[fresh].sum() / n[fresh].sum()
        assert metrics["rollout/logp_gap_mean"] == pytest.approx(want.item(), abs=1e-5)
        assert metrics["rollout/logp_gap_max"] == pytest.approx(0.5, abs=1e-5)


def test_logp_gap_hand_values():
    logp = torch.tensor([[0.0, -1.0, -2.0], [0.0, -0.5, 0.0]])
    behav = torch.tensor([[0.0, -1.5, -1.0], [9.0, -0.25, 0.0]])
    mask = torch.tensor([[False, True, True], [False, True, False]])
    assert logp_gap(logp, behav, mask).tolist() == [1.75, 3.0, 1.0]
    metrics = gap_metrics([logp_gap(logp, behav, mask)])
    assert metrics["rollout/logp_gap_mean"] == pytest.approx(1.75 / 3)
    assert metrics["rollout/logp_gap_max"] == 1.0


# ------------------------------------------------------------------------------ micro-batches


def test_micro_batch_tokens_packs_rows_by_length():
    """Sorted by completion length, each micro-batch holds as many rows as fit in the token budget
    (rows × the longest row's prompt + completion); a row longer than the budget goes alone."""
    o = update_cfg("dapo").optim
    o.micro_batch_tokens = 30
    completion = torch.tensor([5, 1, 9, 2, 3, 20])
    seq = completion + 4  # 9, 5, 13, 6, 7, 24
    out = grpo.micro_batches(torch.arange(6), completion, seq, o)  # rows 1, 3, 4, 0, 2, 5
    assert [m.tolist() for m in out] == [[1, 3, 4], [0, 2], [5]]  # 3·7 ≤ 30 < 4·9; 3·24 > 30
    o.micro_batch_tokens = 0
    o.micro_batch_size = 4
    out = grpo.micro_batches(torch.arange(6), completion, seq, o)
    assert [m.tolist() for m in out] == [[1, 3, 4, 0], [2, 5]]


def test_micro_batch_tokens_leaves_the_update_unchanged():
    """A token budget changes which rows share a pass, never the gradient (batch-total
    normalisers)."""
    batch = synthetic_batch(60)
    cfg = update_cfg("grpo")
    m1, m2 = tiny_qwen3(60), tiny_qwen3(60)
    loss, grad, _ = one_update(m1, m1, batch, cfg)
    cfg.optim.micro_batch_tokens = 64
    everything = torch.arange(len(batch))
    n_micro = len(grpo.micro_batches(everything, batch.completion_len, batch.seq_len,
                                         cfg.optim))
    assert n_micro not in (len(batch), -(-len(batch) // 3))  # neither 1 nor 3 rows each
    loss_packed, grad_packed, _ = one_update(m2, m2, batch, cfg)
    n = int(batch.completion_mask().sum())  # both sum the same per-token terms, of order 1
    assert loss_packed == pytest.approx(loss, abs=f32_tol(1.0, n))
    torch.testing.assert_close(grad_packed, grad, atol=f32_tol(grad.abs().max(), n), rtol=0)


# ------------------------------------------------------------------------------ generation


def test_kv_dtype_is_bf16_under_autocast(monkeypatch):
    """Under bf16 autocast (DDP, one GPU) the KV cache holds K and V in bf16, not float32 keys, and
    the sampled tokens and behaviour log-probs are bit-identical to HF's own cache's (attention
    casts K and V to bf16 anyway)."""
    tok = build_tokenizer()
    model = qwen2(len(tok))
    caches = []
    def keep_cache(module, args, kwargs):
        # the cache object generate passes: `cache` from transformers 5.24, `past_key_values` before
        caches.append(kwargs["cache"] if "cache" in kwargs else kwargs.get("past_key_values"))

    model.register_forward_pre_hook(keep_cache, with_kwargs=True)
    prompts = [tok(f"{i}+{i * 7}=")["input_ids"] for i in range(3)]
    cfg = RolloutConfig(group_size=2, max_new_tokens=10)
    out = {}
    for name in ("bf16", "float32"):
        if name == "float32":
            monkeypatch.setattr(rollout, "kv_cache", lambda model, length, static=False: {})
        torch.manual_seed(0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out[name], _ = generate(model, tok, prompts, cfg, [])
        layer = caches[-1].layers[0]
        if name == "bf16":
            assert layer.keys.dtype == layer.values.dtype == torch.bfloat16
        else:  # HF's own cache: the RoPE'd keys in float32; V in float32 before transformers 5.24,
            # in v_proj's bf16 from 5.24 (its DynamicLayer keeps K's and V's dtypes apart)
            assert layer.keys.dtype == torch.float32
            assert layer.values.dtype in (torch.float32, torch.bfloat16)
    assert torch.equal(out["bf16"].tokens, out["float32"].tokens)
    assert torch.equal(out["bf16"].behav_logp, out["float32"].behav_logp)
    torch.manual_seed(0)
    generate(model, tok, prompts, cfg, [])
    assert caches[-1].layers[0].keys.dtype == torch.float32  # no autocast: the model's own dtype


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.7, "top_k": 7, "top_p": 0.9}],
                         ids=["T1", "T0.7-k7-p0.9"])
def test_generation_cache_is_written_in_place_and_samples_what_hf_cache_does(monkeypatch,
                                                                            sampling):
    """rollout.generate's KV cache (support.kvcache._KVCache) against HF's own DynamicCache,
    float32, one RNG seed, prompts of several lengths (left padding), some rows ending early: the
    same tokens, behaviour log-probs and entropies bit for bit. HF's cache concatenates each
    layer's whole K and V at every token (2 `cat`s per layer and step); this one concatenates only
    at the prompt and writes each token in place."""
    tok = build_tokenizer()
    model = qwen2(len(tok))
    prompts = [tok("1+" * (i + 1) + "=")["input_ids"] for i in range(5)]
    cfg = RolloutConfig(group_size=3, max_new_tokens=12, **sampling)
    stop = list(range(20, 50))  # a random model's rows: about one in nine ends at each token
    out, cats = {}, {}
    for name in ("hf", "in_place"):
        if name == "hf":
            monkeypatch.setattr(rollout, "kv_cache", lambda model, length, static=False: {})
        else:
            monkeypatch.undo()
        torch.manual_seed(0)
        ops = CountOps()
        with ops:
            out[name], _ = generate(model, tok, prompts, cfg, stop)
        cats[name] = ops.calls.get("cat", 0)
    a, b = out["hf"], out["in_place"]
    assert 0 < int(a.completion_len.min()) < cfg.max_new_tokens  # some rows ended early
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.behav_logp, b.behav_logp)
    assert torch.equal(a.entropy, b.entropy)
    steps, layers = int(a.completion_len.max()) - 1, model.config.num_hidden_layers
    assert cats["hf"] - cats["in_place"] >= 2 * layers * steps


def test_generation_cache_takes_its_full_length_only_after_the_prompt_pass():
    """The prompt's pass runs beside HF's prompt-length K and V, not beside the whole cache (on an
    H100 at Qwen2.5-1.5B's shape allocating it at the prompt put generation 20.6 % over its memory
    plan): while the prompt pass's last MLP runs no layer has its full-length storage; at every
    decode step every layer has."""
    tok = build_tokenizer()
    model = qwen2(len(tok))
    caches, seen = [], []

    def keep_cache(module, args, kwargs):
        caches.append(kwargs["cache"] if "cache" in kwargs else kwargs.get("past_key_values"))

    def storage(module, args):  # (positions in this pass, layers with their storage)
        seen.append((args[0].shape[1], len(caches[-1].storage)))

    model.register_forward_pre_hook(keep_cache, with_kwargs=True)
    model.model.layers[-1].mlp.register_forward_pre_hook(storage)
    prompts = [tok("1+" * (i + 1) + "=")["input_ids"] for i in range(5)]
    generate(model, tok, prompts, RolloutConfig(group_size=2, max_new_tokens=6), [])
    assert [n for q, n in seen if q > 1] == [0]  # one prompt pass, no storage yet
    decode = [n for q, n in seen if q == 1]
    assert len(decode) == 5 and set(decode) == {model.config.num_hidden_layers}


def test_static_cache_samples_within_float_tolerance_of_the_default():
    """rollout.static_cache (transformers' StaticCache, which it compiles on a GPU) against the
    default cache, float32 on the CPU, one seed: the same tokens here, and behaviour log-probs and
    entropies within 1e-4 (attention over the cache's fixed length sums in another order; about
    1e-5 apart). With engine vllm the key is refused."""
    tok = build_tokenizer()
    model = qwen2(len(tok))
    prompts = [tok("1+" * (i + 1) + "=")["input_ids"] for i in range(5)]
    out = {}
    for static in (False, True):
        cfg = RolloutConfig(group_size=3, max_new_tokens=12, top_k=7, static_cache=static)
        torch.manual_seed(0)
        out[static], _ = generate(model, tok, prompts, cfg, list(range(20, 50)))
    a, b = out[False], out[True]
    assert torch.equal(a.tokens, b.tokens)
    gap = (a.behav_logp - b.behav_logp).abs().max()
    assert 0 < gap <= 1e-4 and (a.entropy - b.entropy).abs().max() <= 1e-4
    bad = RolloutConfig(static_cache=True, engine="vllm").check()["static_cache"]
    assert not bad[0] and "vllm" in bad[1]


def test_packed_gqa_decodes_on_the_kv_heads_and_samples_what_transformers_sdpa_does(monkeypatch):
    """rollout.pack_gqa: every decode step's attention runs on the cached K and V as they are (a
    query head group as query rows), so transformers' sdpa runs only for the prompt's step; the
    same tokens as transformers' sdpa, log-probs and entropies within 1e-5 (float32, ragged
    prompts: a padding mask, where transformers before 5.24 copies K and V per head). With engine
    vllm the key is refused."""
    tok = build_tokenizer()
    model = qwen2(len(tok))  # 4 query heads on 2 KV heads
    prompts = [tok("1+" * (i + 1) + "=")["input_ids"] for i in range(5)]
    calls = []
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def counted(module, query, key, *args, **kwargs):
        calls.append(query.shape[2])  # (the step's query length)
        return sdpa(module, query, key, *args, **kwargs)

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._local_mapping, "sdpa", counted)
    out, seen = {}, {}
    for pack in (False, True):
        cfg = RolloutConfig(group_size=3, max_new_tokens=12, top_p=0.9, pack_gqa=pack)
        calls.clear()
        torch.manual_seed(0)
        out[pack], _ = generate(model, tok, prompts, cfg, list(range(20, 50)))
        seen[pack] = list(calls)
    a, b = out[False], out[True]
    layers, steps = model.config.num_hidden_layers, int(a.completion_len.max())
    assert len(seen[False]) == layers * steps and seen[False].count(1) == layers * (steps - 1)
    assert len(seen[True]) == layers and 1 not in seen[True]  # the prompt's step only
    assert torch.equal(a.tokens, b.tokens)
    assert (a.behav_logp - b.behav_logp).abs().max() <= 1e-5
    assert (a.entropy - b.entropy).abs().max() <= 1e-5
    bad = RolloutConfig(pack_gqa=True, engine="vllm").check()["pack_gqa"]
    assert not bad[0] and "vllm" in bad[1]


def test_sampler_checks_finiteness_once_at_the_end():
    """NaN weights: generation runs to its end without a device→host sync per token, then raises the
    same error."""
    tok = build_tokenizer()
    model = qwen2(len(tok))
    calls = []
    model.register_forward_hook(lambda *a: calls.append(1))
    with torch.no_grad():
        model.model.norm.weight.fill_(float("nan"))
    cfg = RolloutConfig(group_size=2, max_new_tokens=6)
    with pytest.raises(FloatingPointError, match="logits are not finite"):
        generate(model, tok, [tok("1+1=")["input_ids"]], cfg, [])
    assert len(calls) == 6  # every token was generated before the check


# ------------------------------------------------------------------------------ FSDP (torchrun)


def fsdp_worker(model_dir: str, out: str) -> None:
    """Under torchrun (2 processes, gloo): FSDP2 as load_policy shards it. Counts the all-gathers of
    one training forward/backward before and after a generation phase (parallel.generation), and
    checks that every module's reshard-after-forward setting comes back as found, for a generation
    phase before the first forward too (train.py's step-0 eval); and which path a compiled FSDP
    policy's training forward takes."""
    import torch.distributed as dist

    from support.models import load_policy

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    tok = build_tokenizer()
    cfg = update_cfg("dapo")
    cfg.model.path, cfg.model.parallel = model_dir, "fsdp"
    result = {}
    for first in ("generation", "training"):
        model, policy, _, _, compute = load_policy(cfg, model_dir, torch.device("cpu"), 2)
        sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
        batch = synthetic_batch(model.config.vocab_size, seed=dist.get_rank())
        rollout_cfg = RolloutConfig(group_size=2, max_new_tokens=4)
        prompt = [tok("1+1=")["input_ids"]]
        if first == "generation":
            with parallel.generation(model, compute):
                generate(model, tok, prompt, rollout_cfg, [])
        gathers = {}
        for phase in ("before", "after"):
            counter = []
            with counting_all_gathers(counter):
                logp, _ = grpo.policy_logprobs(policy, batch, update_settings(cfg),
                                             torch.device("cpu"))
                logp.sum().backward()
            gathers[phase] = len(counter)
            settings = [parallel._reshard_setting(m) for m in sharded]
            with parallel.generation(model, compute):
                generate(model, tok, prompt, rollout_cfg, [])
            restored = [parallel._reshard_setting(m) for m in sharded] == settings
            result[f"{first}_{phase}_restored"] = restored
        result[f"{first}_gathers"] = gathers
    calls = []
    real = grpo.completion_logprobs
    grpo.completion_logprobs = lambda *a, **k: calls.append(k["share_prompt"])  # not run
    grpo.policy_logprobs(torch.compile(model, backend="eager"), batch, update_settings(cfg),
                       torch.device("cpu"))
    result["compiled_fsdp_share_prompt"] = calls
    grpo.completion_logprobs = real
    write_result(out, result)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def fsdp_result(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp")
    tok = build_tokenizer()
    model = tiny_qwen3(len(tok))
    model.config.pad_token_id, model.config.eos_token_id = tok.pad_token_id, tok.eos_token_id
    model.save_pretrained(tmp / "model")
    tok.save_pretrained(tmp / "model")
    return worker_results("tests/test_logprobs.py", str(tmp / "model"), out=tmp / "out.json")


def test_fsdp_reshard_settings_restored_after_generation(fsdp_result):
    """parallel.generation sets reshard-after-forward off for generation and puts each module's own
    setting back: a training forward/backward costs as many all-gathers after a generation phase as
    before (it used to set the root to reshard, one more all-gather of the root's weights per
    backward), whether or not a forward ran before the first generation."""
    for r in fsdp_result:
        for first in ("generation", "training"):
            assert r[f"{first}_before_restored"] and r[f"{first}_after_restored"], first
            gathers = r[f"{first}_gathers"]
            assert gathers["before"] == gathers["after"] > 0, (first, gathers)
        assert r["generation_gathers"] == r["training_gathers"]


def test_compiled_fsdp_policy_runs_whole_rows(fsdp_result):
    """model.compile with FSDP: the compiled module is seen as FSDP-wrapped, so a training forward
    never backpropagates through a prompt KV cache whose weights were already resharded."""
    for r in fsdp_result:
        assert r["compiled_fsdp_share_prompt"] == [False]


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    fsdp_worker(*sys.argv[2:4])


class _Group:
    def __init__(self, mesh):
        self.post_forward_mesh_info = mesh


class _State:  # FSDP2's per-module state, as each torch names its parameter groups
    def __init__(self, groups, single: bool):
        self._auto_reshard_after_forward = True
        if single:  # torch 2.11 (the GPU machine's): one group, or None
            self._fsdp_param_group = groups[0] if groups else None
        else:  # torch 2.13: a list
            self._fsdp_param_groups = groups


class _Sharded:
    def __init__(self, state):
        self.state = state

    def _get_fsdp_state(self):
        return self.state


@pytest.mark.parametrize("single", [True, False])
@pytest.mark.parametrize("n_groups", [0, 1])
def test_reshard_setting_reads_and_restores_either_torchs_parameter_groups(single, n_groups):
    """Found by bench/gpu_run.py --dry-run under torch 2.11 (the H200 machine's): FSDP2's state
    holds `_fsdp_param_group` there, `_fsdp_param_groups` from 2.13, and generation under FSDP
    raised AttributeError. The setting is read and put back on both."""
    groups = [_Group("mesh") for _ in range(n_groups)]
    module = _Sharded(_State(groups, single))
    setting = parallel._reshard_setting(module)
    assert setting == (True, ["mesh"] * n_groups)
    module.state._auto_reshard_after_forward = False
    for g in groups:
        g.post_forward_mesh_info = None
    parallel._restore_reshard_setting(module, setting)
    assert parallel._reshard_setting(module) == setting
