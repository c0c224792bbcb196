"""Helpers the core modules share: this process's rank, a reduction over the processes, a timer,
an exception as one line."""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import Tensor

MAX = dist.ReduceOp.MAX


def rank_and_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def oneline(e: Exception, n: int = 300) -> str:
    """An exception's message on one line, at most `n` characters."""
    return " ".join(str(e).split())[:n]


def all_ranks(x, op=None):
    """`x` (a number or a float tensor) reduced over the processes, summed by default; `x` itself in
    one process."""
    if not dist.is_initialized():
        return x
    t = torch.as_tensor(x, dtype=torch.float64).clone()
    dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
    if isinstance(x, Tensor):
        return t
    return t.item()


@contextmanager
def timed(times: dict, name: str):
    """Add the seconds the block takes to times[name]."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        times[name] = times.get(name, 0.0) + time.perf_counter() - t0
