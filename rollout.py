"""Rollouts: G completions per prompt, each token with the behaviour log-prob it was sampled with.

A batch is one `Rollouts` (batch.py): every row is `prompt | completion | right padding`, so the
training forward needs no position-id tricks and the replay buffer stores a row as it is. What
samples is a sampler (`make_sampler`): `HFSampler` (Hugging Face `generate`, the reference) or
support/vllm.py's, behind the same calls: `generate`, `sync` (take the policy's weights), `sleep`
(free memory), `close`.

Our config alone defines what is sampled (`sampling_logits`: temperature, top-k, top-p, the same in
both samplers); one logits processor applies it during `generate` and records the behaviour
log-probs and the sampling entropy. A completion ends at its first end token (kept: the model must
learn to stop); `truncated` means none came within max_new_tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import transformers
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from batch import Rollouts, Row, pack_groups
from support import decode, vllm
from support.kvcache import kv_cache, packed_gqa
from support.logprobs import float32_head, mode, use_chunked_head
from support.parallel import hf_module
from support.preempt import Interrupted, StopRequested, should_stop


# Below it sampling is greedy in all but name (vLLM treats < 1e-5 as greedy), and near 1e-37 logits
# of ~10^2 divided by it overflow float32: inf logits, NaN probabilities.
MIN_TEMPERATURE = 1e-3


@dataclass
class RolloutConfig:
    batch_size: int = 256
    """Fresh rollouts generated per step (= prompts per step × group_size)."""
    group_size: int = 8
    """Completions sampled per prompt (G); advantages are relative within a group."""
    max_new_tokens: int = 48
    """Generation length cap; a completion that reaches it without an end token is truncated."""
    temperature: float = 1.0
    """Sampling temperature; log-probs in the loss use the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling; behaviour log-probs are of the truncated distribution actually sampled."""
    top_k: int = 0
    """Sample among the k most likely tokens only (0 = off); log-probs are of that distribution."""
    gen_batch_size: int = 256
    """Sequences per HF `generate` call (memory knob; a call may mix several prompts' groups)."""
    stop_tokens: list[str] = field(default_factory=list)
    """Extra end tokens (each one token of the vocabulary), besides eos and the end of turn."""
    mask_truncated: bool = False
    """Leave truncated rows out of the loss (DAPO's overlong filtering); their group counts them."""
    dynamic_sampling: int = 0
    """DAPO's dynamic sampling: up to this many generation rounds a step, keeping groups with a
    reward spread."""
    engine: str = "hf"
    """What samples: `hf` (HF generate, the reference loop) or `vllm` (support/vllm.py)."""
    static_cache: bool = False
    """hf: a fixed-size KV cache, with which transformers compiles the decode step on a GPU
    (torch.compile, CUDA graphs: far less host time a token); with `refill`, the slots' own decode
    step compiled on a GPU. Samples agree with the default cache's within float tolerance, not
    bit for bit (docs/gpu.md)."""
    pack_gqa: bool = False
    """hf: at each decode step, attention reads the cached K and V as they are, the query heads
    that share a KV head packed together, instead of transformers' copy of them per head
    (`support.kvcache.packed_gqa`; sdpa attention, transformers' default, only). Samples
    agree within float tolerance (docs/gpu.md)."""
    refill: bool = False
    """hf: decode with support/decode.py's own loop: gen_batch_size slots in one fixed-size KV
    cache, a row that ends freeing its slot for the next row (continuous batching), the host
    reading the device every `sync_every` steps only. Gumbel-max draws keyed by the row, so a
    row's tokens do not depend on its batch: the default path's distribution, other draws."""
    sync_every: int = 8
    """rollout.refill: decode steps between the host's reads (refills, the stop check)."""
    vllm_gpu_memory_utilization: float = 0.3
    """vllm, GPU: share of GPU memory the engine may take for weights and KV cache (vLLM's)."""
    vllm_kv_cache_gb: float = 0.0
    """vllm: KV cache in GiB (0 = from vllm_gpu_memory_utilization on a GPU, 1 GiB on a CPU)."""
    vllm_sleep: bool = True
    """vllm, GPU: sleep mode (KV cache freed, weights offloaded) during the update; CPU: no-op."""

    def check(self) -> dict[str, tuple[bool, str]]:
        G, n = self.group_size, self.batch_size
        return {
            "group_size": (G >= 2, "≥ 2 (GRPO compares completions in a group)"),
            "batch_size": (n > 0 and G > 0 and n % G == 0,
                           f"a positive multiple of rollout.group_size ({G})"),
            "max_new_tokens": (self.max_new_tokens > 0, "> 0"),
            "temperature": (MIN_TEMPERATURE <= self.temperature < 1e6,
                            f"> 0: at least {MIN_TEMPERATURE:g} and below 1e6"),
            "top_p": (0 < self.top_p <= 1, "in (0, 1]"),
            "top_k": (self.top_k >= 0, "≥ 0 (0 = off)"),
            "gen_batch_size": (0 < self.gen_batch_size <= 10**9, "> 0 and ≤ 10^9"),  # MAX_BATCH
            "dynamic_sampling": (self.dynamic_sampling >= 0, "≥ 0 (0 = off)"),
            "engine": (self.engine in ("hf", "vllm"), "hf or vllm"),
            "static_cache": (not self.static_cache or self.engine == "hf",
                             "false with engine vllm (the engine keeps its own cache)"),
            "pack_gqa": (not self.pack_gqa or self.engine == "hf",
                         "false with engine vllm (the engine runs its own attention)"),
            "refill": (not self.refill or self.engine == "hf", "false with engine vllm"),
            "sync_every": (0 < self.sync_every <= 10**6, "> 0 and ≤ 10^6"),
            "vllm_gpu_memory_utilization": (0 < self.vllm_gpu_memory_utilization <= 1, "in (0, 1]"),
            "vllm_kv_cache_gb": (0 <= self.vllm_kv_cache_gb < 1e6, "≥ 0 (0 = automatic)"),
        }




def sampling_logits(scores: torch.Tensor, cfg: RolloutConfig) -> torch.Tensor:
    """(B, V) the logits sampled from, given the model's `scores` (B, V): ÷ temperature (greedy,
    T = 0, records T = 1), cut to the top-k, then to the top-p nucleus (-inf outside); their
    log-softmax is the behaviour distribution, the same in both samplers.
    transformers' temperature and top-k warpers give these bits too; its top-p does not (its
    ascending float32 cumsum kept another set of tokens in 243 of 256 rows of random logits,
    vocabulary 151,936, top_p 0.95), so all three cuts stay here, as the runs sampled them."""
    z = scores.float() / (cfg.temperature or 1.0)  # (B, V)
    if 0 < cfg.top_k < z.shape[1]:
        z = z.masked_fill(z < z.topk(cfg.top_k, dim=-1).values[:, -1:], -torch.inf)
    if cfg.top_p < 1:  # drop a token once the more likely ones hold top_p of the mass
        p, order = z.softmax(-1).sort(-1, descending=True)
        drop = (p.cumsum(-1) - p) >= cfg.top_p
        z = z.masked_fill(drop.scatter(1, order, drop), -torch.inf)
    return z


def entropy_of(logp: torch.Tensor) -> torch.Tensor:
    """(...,) entropy of distributions given by log-probs (..., V); a cut token adds nothing."""
    return torch.special.entr(logp.exp()).sum(-1)


def sampling_distribution(scores: torch.Tensor, cfg: RolloutConfig) -> tuple:
    """What both HF samplers record of the model's scores (B, V): the sampling logits z (B, V),
    their log-softmax (B, V), its entropy (B,), and which rows' scores were all finite (B, 1) (a
    row that is not samples uniformly; its sampler raises once it has read the flag)."""
    finite = torch.isfinite(scores).all(-1, keepdim=True)  # (B, 1), no device→host sync
    z = sampling_logits(torch.where(finite, scores, 0.0), cfg)  # (B, V)
    logp = torch.log_softmax(z, dim=-1)
    return z, logp, entropy_of(logp), finite


class _SamplingDistribution(LogitsProcessor):
    """Turns logits into the sampling distribution (÷ temperature, cut to top-k and to the top-p
    nucleus) and records the log-probability of each sampled token under it (the behaviour log-prob)
    and its entropy. HF `generate` runs with its own processors off, so this one alone defines what
    is sampled. The token drawn from step t's scores only appears in `input_ids` at step t+1, so one
    (B, V) log-softmax is kept and gathered one step late."""

    def __init__(self, cfg: RolloutConfig):
        self.cfg = cfg
        self.prev = None  # (B, V) log-probs of the last step's distribution
        self.logps = []  # T × (B,)
        self.entropies = []  # T × (B,)
        self.finite = None  # () bool on the device, every logit so far finite: read in `finish`

    def __call__(self, input_ids, scores):
        if self.prev is not None:
            self.logps.append(self.prev.gather(1, input_ids[:, -1:]).squeeze(1))
        z, self.prev, entropy, finite = sampling_distribution(scores, self.cfg)  # until `finish`
        self.finite = finite.all() if self.finite is None else self.finite & finite.all()
        self.entropies.append(entropy)
        return z

    def finish(self, last_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # (B, T) each
        if not bool(self.finite):
            raise FloatingPointError("the policy's logits are not finite (NaN or inf weights)")
        self.logps.append(self.prev.gather(1, last_tokens[:, None]).squeeze(1))
        return torch.stack(self.logps, dim=1), torch.stack(self.entropies, dim=1)


@torch.no_grad()
def generate(model, tokenizer, prompts: list[list[int]], cfg: RolloutConfig, stop: list[int],
             prompt_idx=None, step: int = 0, counts: list[int] | None = None,
             group0: int | None = None) -> tuple[Rollouts, list[str]]:
    """Sample `counts[i]` (default cfg.group_size) completions of each prompt (token ids),
    cfg.gen_batch_size sequences per HF `generate` call. Returns `pack_groups`' rollouts (reward,
    correctness and advantage left at 0) and texts. A stop (preempt.should_stop) ends it within a
    token: Interrupted."""
    counts = counts or [cfg.group_size] * len(prompts)
    expanded = [p for p, n in zip(prompts, counts) for _ in range(n)]
    hf = hf_module(model)
    own = hf.generation_config  # (under LoRA, the transformers module's inside peft's wrapper)
    hf.generation_config = GenerationConfig()  # nothing of the model's fills what ours leaves unset
    use_chunked_head(model)  # float32 logits, as the training pass computes them
    rows = []
    try:
        with mode(model, training=False), packed_gqa(cfg.pack_gqa), float32_head(model):
            if cfg.refill:  # one call: its slots take the rows as earlier ones end
                rows = _sample_slots(model, expanded, cfg, stop)
            else:
                for start in range(0, len(expanded), cfg.gen_batch_size):
                    chunk = expanded[start : start + cfg.gen_batch_size]
                    rows += _sample(model, tokenizer, chunk, cfg, stop)
    finally:
        hf.generation_config = own
    return pack_groups(rows, tokenizer, counts, prompt_idx, step, group0)


def _sample(model, tokenizer, prompts: list[list[int]], cfg: RolloutConfig,
            stop: list[int]) -> list[Row]:
    """One HF `generate` call: a completion of each prompt, left-padded into one batch."""
    if should_stop():
        raise Interrupted
    device = next(model.parameters()).device
    batch = tokenizer.pad({"input_ids": prompts}, padding_side="left", return_tensors="pt")
    P = batch["input_ids"].shape[1]
    gen_cfg = GenerationConfig(do_sample=cfg.temperature > 0, temperature=1.0, top_p=1.0, top_k=0,
                               max_new_tokens=cfg.max_new_tokens, eos_token_id=stop or None,
                               pad_token_id=tokenizer.pad_token_id)
    recorder = _SamplingDistribution(cfg)
    out = model.generate(**batch.to(device), generation_config=gen_cfg,
                         logits_processor=LogitsProcessorList([recorder]),
                         **kv_cache(model, P + cfg.max_new_tokens, cfg.static_cache),
                         stopping_criteria=transformers.StoppingCriteriaList([StopRequested()]))
    if should_stop():  # cut short: the rows are incomplete
        raise Interrupted
    completion = out[:, P:]  # (b, T)
    logp, entropy = recorder.finish(completion[:, -1])  # (b, T) each
    return _rows(prompts, completion, logp, entropy, stop)


def _sample_slots(model, prompts: list[list[int]], cfg: RolloutConfig,
                  stop: list[int]) -> list[Row]:
    """rollout.refill: a completion of each prompt from support/decode.py's loop, with a seed for
    its draws taken from torch's global RNG (so a resumed run draws the same)."""
    seed = int(torch.randint(2**62, (1,)))
    compiled = cfg.static_cache and decode.compiles(next(model.parameters()).device)
    out = decode.decode(model, prompts, lambda z: sampling_distribution(z, cfg), stop,
                        cfg.max_new_tokens, cfg.gen_batch_size, cfg.sync_every, seed, should_stop,
                        compiled)
    if out is None:  # cut short: the rows are incomplete
        raise Interrupted
    return _rows(prompts, *out, stop)


def _rows(prompts: list[list[int]], completion, logp, entropy, stop: list[int]) -> list[Row]:
    """The rows of completions (b, T) with their log-probs and entropies (b, T)."""
    device = completion.device
    # a completion ends at its first end token; later tokens are padding
    ends = torch.isin(completion, torch.tensor(stop, dtype=torch.long, device=device))  # (b, T)
    lengths = torch.where(ends.any(1), ends.int().argmax(1) + 1, completion.shape[1]).tolist()
    rows = []
    for b, (prompt, n) in enumerate(zip(prompts, lengths)):
        rows.append(Row(ids=prompt + completion[b, :n].tolist(), prompt_len=len(prompt),
                        logp=logp[b, :n].cpu(), truncated=not bool(ends[b].any()),
                        entropy=entropy[b, :n].mean().item()))
    return rows


class HFSampler:
    """Samples with Hugging Face `generate` from the policy module itself, which always holds the
    policy's weights: `sync`, `sleep` and `close` have nothing to do."""

    def __init__(self, model, tokenizer, stop: list[int]):
        self.model = model
        self.tokenizer = tokenizer
        self.stop = stop  # token ids that end a completion

    def generate(self, prompts: list[list[int]], cfg: RolloutConfig, prompt_idx=None,
                 step: int = 0, counts: list[int] | None = None, group0: int | None = None,
                 key: tuple = ()) -> tuple[Rollouts, list[str]]:
        """`generate` (HF samples from torch's global RNG: `key`, an engine's seed, is unused)."""
        return generate(self.model, self.tokenizer, prompts, cfg, self.stop, prompt_idx, step,
                        counts, group0)

    def sync(self, model) -> None:
        pass

    def sleep(self) -> None:
        pass

    def close(self) -> None:
        pass


def make_sampler(engine: str, model, tokenizer, stop: list[int], path: str, sampling: RolloutConfig,
                 dtype: torch.dtype, longest: int, trust_remote_code: bool = False,
                 adapted: bool = False, what: str = "rollout.engine=vllm"):
    """The sampler set-up picks: HF generate on `model`, or with `engine` vllm a vLLM engine on
    `path` given `model`'s weights (in `dtype`) for prompts and completions of up to `longest`
    tokens, told the distribution sampled (`sampling_logits`) to measure entropies under. `what`
    names the setting in a RunError."""
    if engine == "hf" and sampling.refill:
        decode.check_model(model)  # before the run writes anything
    if engine == "hf":
        return HFSampler(model, tokenizer, stop)
    return vllm.make_sampler(model, tokenizer, stop, path, sampling, dtype, longest,
                             trust_remote_code, adapted, what, logits=sampling_logits)
