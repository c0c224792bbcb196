"""Rollouts from vLLM (`rollout.engine: vllm`): the same `Rollouts` and texts as `rollout.generate`,
sampled by an in-process vLLM engine that holds a copy of the policy's weights (README, "vLLM").

Same semantics as the HF path: token-id prompts, one request per sample; temperature, top-p and
top-k from our config alone (`generation_config="vllm"`); exactly the ids of `stop` end a completion
(`ignore_eos` plus `stop_token_ids`), the end token kept; `processed_logprobs` are the log-probs
under the distribution actually sampled, as `_SamplingDistribution` records them. The sampling
entropy comes from the engine when 0 < top_k <= ENTROPY_TOP_K (the top-k log-probs hold the whole
distribution), else rows carry NaN and `sampling_entropy` measures it with the trainer's model.

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
from torch.distributed.tensor import DTensor

from rollout import RolloutConfig, Rollouts, Row, pack_groups

ENTROPY_TOP_K = 64  # the engine returns the top-k log-probs per token when top_k is at most this
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

    def __init__(self, path: str, cfg: RolloutConfig, dtype: torch.dtype, device: torch.device,
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

    def generate(self, tokenizer, prompts: list[list[int]], cfg: RolloutConfig, stop: list[int],
                 prompt_idx=None, step: int = 0, counts: list[int] | None = None,
                 group0: int | None = None, key: tuple = ()) -> tuple[Rollouts, list[str]]:
        """`rollout.generate`'s contract; `key` names the call for the per-request seeds."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        counts = counts or [cfg.group_size] * len(prompts)
        top = cfg.top_k if 0 < cfg.top_k <= ENTROPY_TOP_K else 0
        requests, params = [], []
        for i, (p, n) in enumerate(zip(prompts, counts, strict=True)):
            for j in range(n):
                requests.append(TokensPrompt(prompt_token_ids=list(p)))
                params.append(SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p,
                                             top_k=cfg.top_k, max_tokens=cfg.max_new_tokens,
                                             logprobs=top, seed=request_seed(key, i, j),
                                             ignore_eos=True, stop_token_ids=list(stop),
                                             detokenize=False))
        self.wake()
        with kept_rng_and_threads():
            self.llm.reset_prefix_cache()  # every phase starts from the same engine state
            outputs = self.llm.generate(requests, params, use_tqdm=False)
        rows = []
        for req, out in zip(requests, outputs, strict=True):
            rows.append(_row(req["prompt_token_ids"], out.outputs[0], stop, top))
        return pack_groups(rows, tokenizer, counts, prompt_idx, step, group0)


def _row(prompt: list[int], out, stop: list[int], top: int) -> Row:
    """A completion as rollout.pack takes it."""
    ids = list(out.token_ids)
    logp = [d[t].logprob for d, t in zip(out.logprobs, ids, strict=True)]
    if not torch.isfinite(torch.tensor(logp)).all():
        raise FloatingPointError("the engine's log-probs are not finite (NaN or inf weights)")
    entropy = math.nan
    if top and ids:
        entropy = sum(_entropy(d) for d in out.logprobs) / len(ids)
    truncated = not ids or ids[-1] not in stop
    return Row(ids=prompt + ids, prompt_len=len(prompt), logp=logp, truncated=truncated,
               entropy=entropy)


def _entropy(top: dict) -> float:
    """-Σ p log p over the returned log-probs (masked tokens come back as -inf and add nothing)."""
    lps = torch.tensor([x.logprob for x in top.values()], dtype=torch.float64)
    lps = lps[torch.isfinite(lps)]
    return float(-(lps.exp() * lps).sum())


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
        full = p.full_tensor() if isinstance(p, DTensor) else p
        yield name, full.detach().to(dtype)


def fill_entropy(rows: Rollouts, model, temperature: float, device) -> None:
    """Rows the engine returned without a sampling entropy get `sampling_entropy`'s."""
    if rows.entropy.isnan().any():
        rows.entropy = sampling_entropy(model, rows, temperature, device)


def cast(weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype) -> Iterator:
    """The same (name, tensor) pairs in `dtype`, one at a time (e.g. lora.merged_weights)."""
    for name, tensor in weights:
        yield name, tensor.to(dtype)


@torch.no_grad()
def sampling_entropy(model, rows: Rollouts, temperature: float, device,
                     chunk: int = 64) -> torch.Tensor:
    """(B,) each row's mean token entropy under `model` at `temperature` (before any top-k/top-p
    cut), for rows the engine returned without one; `chunk` rows per forward."""
    import grpo

    out = torch.empty(len(rows))
    for start in range(0, len(rows), chunk):
        part = rows.select(torch.arange(start, min(start + chunk, len(rows))))
        _, ent = grpo.completion_logprobs(model, part.tokens.to(device), part.prompt_len.to(device),
                                          part.seq_len.to(device), temperature or 1.0,
                                          with_entropy=True)  # (b, L)
        mean = ent.sum(1) / part.completion_len.to(device).clamp(min=1)  # (b,)
        out[start : start + len(part)] = mean.float().cpu()
    return out
