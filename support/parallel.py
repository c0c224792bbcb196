"""Everything torchrun adds, as plain calls that do nothing in one process: the process group and
its backend map, this process's rank, reductions and gathers over the processes, whole tensors of
FSDP shards, the generation context that gathers FSDP weights once and runs without FSDP's hooks,
and DDP's micro-batch sync.
"""

from __future__ import annotations

import datetime
import gc
import os
import sys
import signal
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from support.util import RunError, oneline

MAX = dist.ReduceOp.MAX
MIN = dist.ReduceOp.MIN
# What torchrun sets in each worker (and TORCHELASTIC_RUN_ID, which marks a process it started)
TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def backend_map(device_type: str) -> str:
    """gloo for our collectives on host tensors (NCCL serves none); NCCL for the model's."""
    if device_type == "cpu":
        return "gloo"
    return f"cpu:gloo,{device_type}:{dist.Backend.default_device_backend_map[device_type]}"


def init() -> tuple[int, int]:
    """Join torchrun's process group (even of one process); returns (rank, world). The rendezvous
    waits for every rank: a signal then ends the process at once (no handler of ours could run
    inside it, and nothing has been written yet)."""
    if launched() and not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        backend = backend_map("cuda" if torch.cuda.is_available() else "cpu")
        found = {s: signal.signal(s, signal.SIG_DFL) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            dist.init_process_group(backend, timeout=datetime.timedelta(hours=2))
        except (RuntimeError, ValueError) as e:  # (torch's DistError is a RuntimeError)
            where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
            raise RunError(f"torchrun's rendezvous at {where} failed: {oneline(e)}") from None
        finally:
            for s, handler in found.items():
                signal.signal(s, handler)
    return rank_and_world()


def launched() -> bool:
    """Whether torchrun started this process. Its variables left in a shell (a process torchrun
    did not start) or a part of them would have the rendezvous wait two hours for ranks that never
    come: refused."""
    found = [k for k in TORCHRUN if k in os.environ]
    if not found:
        return False
    shown = ", ".join(found)
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        raise RunError(f"{shown} set, but torchrun did not start this process (no "
                       "TORCHELASTIC_RUN_ID): unset them, or launch with torchrun")
    missing = [k for k in TORCHRUN if k not in os.environ]
    if missing:
        raise RunError(f"torchrun's {', '.join(missing)} not set (only {shown}): launch with "
                       "torchrun")
    try:
        rank, world, local = (int(os.environ[k]) for k in TORCHRUN[:3])
    except ValueError:
        rank, world, local = -1, 0, -1
    if not (0 <= rank < world and 0 <= local < world):
        values = " ".join(f"{k}={os.environ[k]!r}" for k in TORCHRUN[:3])
        raise RunError(f"torchrun's {values} do not fit (0 ≤ RANK, LOCAL_RANK < WORLD_SIZE)")
    return True


def close() -> None:
    """Destroy the process group, after whatever holds it (DDP's reducer: train.py drops its
    wrapper first). A reducer freed after the group holds its last reference, and gloo's group,
    destroyed inside the reducer's destructor, waits for its worker threads while holding the GIL,
    which a worker may be waiting for: a hang at exit (seen once in CI's torchrun tests)."""
    if dist.is_initialized():
        gc.collect()  # a wrapper in a reference cycle is freed now, while the group still lives
        dist.destroy_process_group()


def rank_and_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def say_once(line: str) -> None:
    """A note during the run, on stderr, from rank 0 alone."""
    if rank_and_world()[0] == 0:
        print(line, file=sys.stderr)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


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


def gather(items: list) -> list:
    """Every rank's `items`, concatenated in rank order (`items` itself in one process)."""
    if not dist.is_initialized():
        return items
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, items)
    return [x for part in parts for x in part]


def share(items: list) -> list:
    """This rank's share of `items`: every world-th one from the rank's own position."""
    rank, world = rank_and_world()
    return items[rank::world]


def check_share(prompts: int) -> None:
    """A step's `prompts` must split evenly over the ranks (each rank then has as many groups)."""
    world = rank_and_world()[1]
    if prompts % world:
        raise RunError(f"prompts per step ({prompts}) must be divisible by the number of "
                       f"processes ({world})")


def fork_rng(device: torch.device):
    """torch.random.fork_rng over the CPU stream and, on a GPU, this rank's device's."""
    devices = []
    if device.type == "cuda":
        devices = [device]
    return torch.random.fork_rng(devices=devices)


def full_tensor(t: Tensor) -> Tensor:
    """The whole tensor of an FSDP shard (a collective: every rank calls it); others as they are."""
    if isinstance(t, DTensor):
        return t.full_tensor()
    return t


def resharded(model):
    """`model` with FSDP2's root unit sharded again: after a forward FSDP2 keeps the root's weights
    gathered (bf16 copies under mixed precision) until the backward, so its parameters would not
    be the float32 shards the optimizer holds. Nothing changes without FSDP."""
    root = hf_module(model)
    if isinstance(root, FSDPModule):
        root.reshard()
    return model


def trained(model) -> list[Tensor]:
    """The parameters the optimizer moves, each as this rank's part (FSDP: its shard, the root's
    too after a forward left it gathered: `resharded`)."""
    return [local(p) for p in resharded(model).parameters() if p.requires_grad]


def local(t: Tensor) -> Tensor:
    """This rank's part of an FSDP shard; others as they are."""
    if isinstance(t, DTensor):
        return t.to_local()
    return t


def backward(loss: Tensor, real: bool) -> None:
    """Backward of this rank's share of a loss normalised by global totals: DDP and FSDP average
    gradients over ranks, so the loss is × world; a stand-in micro-batch (a rank with fewer runs
    one, so every rank's collectives match) is × 0."""
    world = rank_and_world()[1]
    (loss * (world if real else 0.0)).backward()


def micro_sync(policy, last: bool):
    """DDP all-reduces gradients on the last micro-batch of an optimizer step only."""
    if hasattr(policy, "no_sync") and not last:
        return policy.no_sync()
    return nullcontext()


@contextmanager
def generation(model, compute):
    """Generation with whole weights: under FSDP they are gathered once (in bf16 with bf16 compute)
    and stay for every token of the phase, then are freed, so no collective runs while ranks
    generate different lengths; FSDP's forward hooks are off meanwhile (`_forward_hooks_off`).
    Each module's reshard-after-forward setting is restored as found (FSDP2 keeps the root
    unsharded after forward: the training backward needs its weights at once, and resharding it
    would cost one more all-gather per backward)."""
    sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if sharded:  # the root's first forward would settle its setting: settle it now, then read it
        sharded[0]._get_fsdp_state()._lazy_init()
    found = [_reshard_setting(m) for m in sharded]
    for m in sharded:
        m.unshard()
        m.set_reshard_after_forward(False, recurse=False)
    hooks = []
    try:
        for m in sharded:
            hooks.append(_forward_hooks_off(m))
        with compute:
            yield
    finally:
        for m, saved in zip(sharded, hooks):
            _forward_hooks_back(m, saved)
        for m, setting in zip(sharded, found):
            _restore_reshard_setting(m, setting)
            m.reshard()


# A module's forward hooks, in the dicts `torch.nn.Module.__call__` reads
FORWARD_HOOKS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                 "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def _forward_hooks_off(module) -> dict:
    """Take FSDP's forward hooks off `module` for a generation phase, returning every forward hook
    as it was: with the weights gathered the hooks have nothing to do, yet each costs host time at
    every unit and token (a review of the H200 run put them at about half of a 72 ms decode step
    at 1.5B's shape; bench/generation.py's hooks_on arm measures them). The module then runs as
    the plain HF module over the gathered weights. Its mixed-precision input cast goes too: the HF
    modules hand each unit bf16 hidden states and rotary tables in the hidden states' dtype (a
    test holds tokens and log-probs equal with the hooks and without, float32 and bf16)."""
    state = module._get_fsdp_state()
    saved = {}
    for name in FORWARD_HOOKS:
        saved[name] = dict(getattr(module, name))
    if len(state._modules) > 1:  # fully_shard([a, b]): one hook for the group; left as it is
        return saved
    for handle in (state._pre_forward_hook_handle, state._post_forward_hook_handle):
        for name in FORWARD_HOOKS:
            getattr(module, name).pop(handle.id, None)
    return saved


def _forward_hooks_back(module, saved: dict) -> None:
    """Every forward hook of `module` as `_forward_hooks_off` found it, in its order."""
    for name, hooks in saved.items():
        getattr(module, name).clear()
        getattr(module, name).update(hooks)


def _reshard_setting(module) -> tuple:
    """FSDP2's reshard-after-forward state of `module` (its API sets it but cannot read it)."""
    state = module._get_fsdp_state()
    meshes = [g.post_forward_mesh_info for g in _param_groups(state)]
    return state._auto_reshard_after_forward, meshes


def _restore_reshard_setting(module, setting: tuple) -> None:
    state = module._get_fsdp_state()
    state._auto_reshard_after_forward = setting[0]
    for group, mesh_info in zip(_param_groups(state), setting[1]):
        group.post_forward_mesh_info = mesh_info


def _param_groups(state) -> list:
    """A module's FSDP parameter groups: a list from torch 2.13, one group (or None) before."""
    if hasattr(state, "_fsdp_param_groups"):
        return state._fsdp_param_groups
    return [g for g in [state._fsdp_param_group] if g is not None]


def hf_module(model):
    """The HF model inside the wrappers a run puts around it: DDP, torch.compile, peft's LoRA (an
    FSDP2 model is its own class)."""
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):  # torch.compile's OptimizedModule
            model = model._orig_mod
        elif hasattr(model, "get_base_model"):  # peft's LoRA wrapper
            model = model.get_base_model()
        elif not isinstance(model, torch.nn.Module):  # a plain wrapper (lora.AdaptersOff)
            model = model.model
        else:
            return model

