"""Rollouts from vLLM (`rollout.engine: vllm`): the same `Rollouts` and texts as `rollout.generate`,
sampled by an in-process vLLM engine that holds a copy of the policy's weights (docs/vllm.md).
rollout.make_sampler builds it and hands it the sampling distribution (`rollout.sampling_logits`):
nothing here imports the reading path.

Same semantics as the HF path: token-id prompts, one request per sample; temperature, top-p and
top-k from our config alone (`generation_config="vllm"`); exactly the ids of `stop` end a completion
(`ignore_eos` plus `stop_token_ids`), the end token kept; `processed_logprobs` are the log-probs
under the distribution actually sampled, as `_SamplingDistribution` records them. The sampling
entropy (of that distribution, after the top-k and top-p cuts) is measured with the trainer's
model, `sampling_entropy`: the engine returns too few log-probs.

Determinism: each request's seed hashes (key, prompt, sample), so no sample depends on the rest of
the batch; the prefix cache is emptied before every phase; the global RNG streams vLLM reseeds or
draws from are put back around every call. Weights: `sync` streams (HF name, full tensor) pairs
through the worker's `reload_weights`; GPU `sleep`/`wake` free and restore the KV cache.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import random
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import numpy as np
import torch

from batch import Rollouts, Row, pack_groups
from support import lora
from support.logprobs import completion_logprobs
from support.parallel import full_tensor
from support.util import RunError, oneline

CPU_KV_CACHE_GB = 1.0  # the CPU backend's default KV cache when rollout.vllm_kv_cache_gb is 0


def available() -> bool:
    """Whether vLLM can be imported here (without importing it)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


@contextmanager
def kept_rng_and_threads():
    """Put back Python's, NumPy's and torch's global RNG state and torch's thread count: vLLM
    reseeds them when it starts, draws from torch's while sampling, and changes the thread count
    (and `torch.set_num_threads`)."""
    py, npy, pt = random.getstate(), np.random.get_state(), torch.get_rng_state()
    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)
        random.setstate(py)
        np.random.set_state(npy)
        torch.set_rng_state(pt)


def request_seed(key: tuple, i: int, j: int) -> int:
    """A 31-bit seed for sample j of prompt i of the call `key` (the same on every machine)."""
    digest = hashlib.blake2b(repr((*key, i, j)).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") >> 1


class Engine:
    """One vLLM engine in this process, for this rank's prompts (DDP/FSDP: one per rank)."""

    def __init__(self, path: str, cfg, dtype: torch.dtype, device: torch.device,
                 max_model_len: int, trust_remote_code: bool = False):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process: weights pass by reference
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        from vllm import LLM

        # Rotary embeddings and a tied head have no checkpoint tensor: a warning per layer and sync.
        reload_log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
        reload_log.setLevel(logging.ERROR)
        gpu = device.type == "cuda"
        kv_gb = cfg.vllm_kv_cache_gb or (0.0 if gpu else CPU_KV_CACHE_GB)
        args = {
            "model": path,
            "dtype": dtype,
            "seed": 0,
            "generation_config": "vllm",
            "logprobs_mode": "processed_logprobs",
            "max_model_len": max_model_len,
            "trust_remote_code": trust_remote_code,
            "enable_prefix_caching": True,
            "gpu_memory_utilization": cfg.vllm_gpu_memory_utilization,
            "enable_sleep_mode": gpu and cfg.vllm_sleep,
            "enforce_eager": not gpu,
        }
        if kv_gb:
            args["kv_cache_memory_bytes"] = int(kv_gb * 2**30)
        if not gpu:  # a prefill split over steps rewinds its generator, which CPU generators cannot
            args["enable_chunked_prefill"] = False
            args["max_num_batched_tokens"] = max(max_model_len, 4096)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun: an engine per rank, in its world
            args["distributed_executor_backend"] = "external_launcher"
        with kept_rng_and_threads():
            self.llm = LLM(**args)
        self.sleeping = False
        self.can_sleep = gpu and cfg.vllm_sleep

    def sync(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new weights: (HF name, full tensor) pairs, consumed one at a time. The prefix cache
        (keys and values of the old weights) is dropped."""
        self.wake()
        with kept_rng_and_threads():
            self.llm.collective_rpc(_reload, args=(iter(weights),))
            self.llm.reset_prefix_cache()

    def close(self) -> None:
        """Shut the engine down; vLLM also tears down the process groups it set up (the
        torch.distributed world among them when it created it: without torchrun, vLLM initialises a
        world of one)."""
        self.llm.llm_engine.engine_core.shutdown()

    def sleep(self) -> None:
        """GPU: free the KV cache and offload the weights while the trainer needs the memory."""
        if self.can_sleep and not self.sleeping:
            self.llm.sleep(level=1)
            self.sleeping = True

    def wake(self) -> None:
        if self.sleeping:
            self.llm.wake_up()
            self.sleeping = False

    def generate(self, tokenizer, prompts: list[list[int]], cfg, stop: list[int],
                 prompt_idx=None, step: int = 0, counts: list[int] | None = None,
                 group0: int | None = None, key: tuple = ()) -> tuple[Rollouts, list[str]]:
        """`rollout.generate`'s contract; `key` names the call for the per-request seeds."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        counts = counts or [cfg.group_size] * len(prompts)
        requests, params = [], []
        for i, (p, n) in enumerate(zip(prompts, counts, strict=True)):
            for j in range(n):
                requests.append(TokensPrompt(prompt_token_ids=list(p)))
                params.append(SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p,
                                             top_k=cfg.top_k, max_tokens=cfg.max_new_tokens,
                                             logprobs=0, seed=request_seed(key, i, j),
                                             ignore_eos=True, stop_token_ids=list(stop),
                                             detokenize=False))
        if not requests:  # a stage with nothing to sample on this rank
            return pack_groups([], tokenizer, counts, prompt_idx, step, group0)
        self.wake()
        with kept_rng_and_threads():
            self.llm.reset_prefix_cache()  # every phase starts from the same engine state
            outputs = self.llm.generate(requests, params, use_tqdm=False)
        rows = []
        for req, out in zip(requests, outputs, strict=True):
            rows.append(_row(req["prompt_token_ids"], out.outputs[0], stop))
        return pack_groups(rows, tokenizer, counts, prompt_idx, step, group0)


def _row(prompt: list[int], out, stop: list[int]) -> Row:
    """A completion as batch.pack takes it (its entropy measured later: `sampling_entropy`)."""
    ids = list(out.token_ids)
    logp = [d[t].logprob for d, t in zip(out.logprobs, ids, strict=True)]
    if not torch.isfinite(torch.tensor(logp)).all():
        raise FloatingPointError("the engine's log-probs are not finite (NaN or inf weights)")
    truncated = not ids or ids[-1] not in stop
    return Row(ids=prompt + ids, prompt_len=len(prompt), logp=logp, truncated=truncated,
               entropy=math.nan)


def _reload(worker, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    """In the worker: load new weights layer by layer, then rebuild what was derived from them but
    not reloaded: the CPU backend's packed copy of a tied LM head (on a GPU this does nothing)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    worker.model_runner.reload_weights(weights_iterator=weights)
    for module in worker.model_runner.get_model().modules():
        if isinstance(module, ParallelLMHead):
            module.quant_method.process_weights_after_loading(module)


def full_parameters(model, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor in `dtype`) for each parameter of the HF module, one at a time: under
    FSDP2 each is gathered on its own (every rank must iterate together) and freed once the engine
    has copied it."""
    for name, p in model.named_parameters():
        yield name, full_tensor(p).detach().to(dtype)


def cast(weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype) -> Iterator:
    """The same (name, tensor) pairs in `dtype`, one at a time (e.g. lora.merged_weights)."""
    for name, tensor in weights:
        yield name, tensor.to(dtype)


@torch.no_grad()
def sampling_entropy(model, rows: Rollouts, cfg, device, logits, chunk: int = 64) -> torch.Tensor:
    """(B,) each row's mean token entropy of the distribution sampled (`logits`, the cut logits of
    rollout.sampling_logits, as HF generation records it) under `model`, `chunk` rows per forward.
    Without a top-k or top-p cut, the chunked head gives it without a (rows, tokens, vocabulary)
    tensor."""
    out = torch.empty(len(rows))
    for start in range(0, len(rows), chunk):
        part = rows.select(torch.arange(start, min(start + chunk, len(rows))))
        tokens = part.tokens.to(device)
        if cfg.top_k == 0 and cfg.top_p == 1:
            _, ent = completion_logprobs(model, tokens, part.prompt_len.to(device),
                                         part.seq_len.to(device), cfg.temperature or 1.0,
                                         with_entropy=True)  # (b, L)
        else:
            ent = _cut_entropy(model, part, cfg, tokens, logits)
        mean = ent.sum(1) / part.completion_len.to(device).clamp(min=1)  # (b,)
        out[start : start + len(part)] = mean.float().cpu()
    return out


def _cut_entropy(model, part: Rollouts, cfg, tokens: torch.Tensor, logits) -> torch.Tensor:
    """(b, L) the sampled distribution's entropy at each completion token's column, 0 elsewhere."""
    mask = part.completion_mask().to(tokens.device)  # (b, L)
    attention = (torch.arange(tokens.shape[1], device=tokens.device) < part.seq_len.to(
        tokens.device)[:, None]).long()
    scores = model(input_ids=tokens, attention_mask=attention).logits  # (b, L, V) float32
    b, L, V = scores.shape
    logp = torch.log_softmax(logits(scores.view(b * L, V), cfg), dim=-1)
    ent = torch.special.entr(logp.exp()).sum(-1).view(b, L)  # column t: of token t + 1
    ent = torch.nn.functional.pad(ent[:, :-1], (1, 0))  # column t: the distribution of token t
    return torch.where(mask, ent, 0.0)


class VLLMSampler:
    """rollout.engine=vllm: an `Engine` behind rollout.HFSampler's four calls. `sync` streams the
    policy's weights (LoRA: merged; FSDP: gathered one parameter at a time) into the engine."""

    def __init__(self, model, tokenizer, stop: list[int], engine: Engine, dtype: torch.dtype,
                 device: torch.device, adapted: bool, logits):
        self.model = model
        self.tokenizer = tokenizer
        self.stop = stop
        self.engine = engine
        self.dtype = dtype  # of the weights the engine holds
        self.device = device
        self.adapted = adapted
        self.logits = logits  # rollout.sampling_logits: the distribution the engine samples

    def generate(self, prompts: list[list[int]], cfg, prompt_idx=None,
                 step: int = 0, counts: list[int] | None = None, group0: int | None = None,
                 key: tuple = ()) -> tuple[Rollouts, list[str]]:
        """rollout.generate's contract; `key` names the call for the per-request seeds."""
        rows, texts = self.engine.generate(self.tokenizer, prompts, cfg, self.stop, prompt_idx,
                                           step, counts, group0, key)
        rows.entropy = sampling_entropy(self.model, rows, cfg, self.device, self.logits)
        return rows, texts

    def sync(self, model) -> None:
        """The engine gets `model`'s weights (every rank calls it together)."""
        weights = full_parameters(model, self.dtype)
        if self.adapted:
            weights = cast(lora.merged_weights(model), self.dtype)
        self.engine.sync(weights)

    def sleep(self) -> None:
        self.engine.sleep()

    def close(self) -> None:
        self.engine.close()


def make_sampler(model, tokenizer, stop: list[int], path: str, sampling, dtype: torch.dtype,
                 longest: int, trust_remote_code: bool, adapted: bool, what: str, logits):
    """A vLLM engine on `path` given `model`'s weights (in `dtype`), for prompts and completions of
    up to `longest` tokens, behind the sampler's calls (rollout.make_sampler: `logits` is
    rollout.sampling_logits). `what` names the setting in a RunError."""
    if not available():
        raise RunError(f"{what} needs vLLM (pip install -r requirements-vllm.txt)")
    device = next(model.parameters()).device
    try:
        llm = Engine(path, sampling, dtype, device, longest, trust_remote_code)
    except (ValueError, RuntimeError, OSError) as e:
        raise RunError(f"{what}: {type(e).__name__}: {oneline(e)}") from None
    sampler = VLLMSampler(model, tokenizer, stop, llm, dtype, device, adapted, logits)
    sampler.sync(model)
    return sampler
