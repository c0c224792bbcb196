"""Stopping at any moment (preemption). SIGTERM or SIGINT asks the process to stop; the work under
way (a generation, an eval, dynamic-sampling rounds, an update of several passes) is abandoned at
its next token, problem or optimizer step, and the caller goes back to its last safe point; an
update of one pass (one batch's time) finishes.

  STOP.install()   once per process: the signal handlers
  setting_up()     around set-up, which writes nothing: a signal ends it at once
  should_stop()    whether a stop was asked for; cheap enough to call after every token.
                   rollout.generate calls it through `StopRequested`, a transformers
                   StoppingCriteria; another generation engine calls the same function
  STOP.agreed()    every rank at the same point: the signal any rank got (all-reduce MAX), 0 if none
  abandonable()    a phase a stop may cut short on one rank: at its end every rank agrees, and all
                   raise Interrupted together if any rank was stopped
  generating()     abandonable, with FSDP's weights gathered for the phase (support/parallel.py)
  rewind()         around a step's rollout: a stop puts back the RNG streams
  StepStart        a step's start kept while its update runs several passes: a stop between two
                   optimizer steps (grpo.run_pass) puts it back
  rng_state()      every global RNG stream (checkpoints save it; rewind puts it back)

Ranks generate different lengths, so no collective can run per token: a rank stops on its own
flag, and the ranks agree at the phase's end, which every rank reaches. A rank that got the signal
also posts it in the process group's key-value store, where the others look once a second while
they generate: torchrun forwards SIGTERM to each of its workers, but a scheduler that drains one
node signals that node's processes only, and the other ranks must not finish a long eval first. A
rank waiting for the others at the agreement keeps looking (the all-reduce runs asynchronously),
so a signal that arrives while it waits reaches the ranks still working too.

A second SIGINT stops at once, without a checkpoint (Ctrl-C twice). A repeated SIGTERM is the same
request: a scheduler may signal every process of a job and torchrun forwards the signal again;
SIGKILL at the end of the grace period is the hard stop.
"""

from __future__ import annotations

import copy
import os
import random
import signal
import time
from contextlib import contextmanager

import numpy as np
import torch
import torch.distributed as dist
import transformers

from support import parallel
from support.util import stderr_line

KEY = "preempt/stop"  # in the process group's store: the signal number a rank got
POLL = 1.0  # seconds between looks into the store


class Interrupted(Exception):
    """A stop abandoned the work under way; the caller goes back to its last safe point."""


class StoppedInSetup(BaseException):
    """A signal during set-up (`setting_up`). Not an Exception: no check of a file or a model that
    catches errors broadly may take it for a fault of what it was reading."""


class Stop:
    """This process's stop request: the signal number (0: none), set by the signal handler or by
    another rank's post."""

    def __init__(self):
        self.signum = 0
        self.setting_up = False  # set-up, before the run writes anything: a signal ends it at once
        self.at = 0.0  # time.monotonic() of the first signal
        self.posted = False  # the signal is in the store (or came from it)
        self.looked = 0.0  # time.monotonic() of the last look into the store

    def install(self) -> None:
        self.__init__()  # a new request for each run (tests run several in one process)
        signal.signal(signal.SIGTERM, self.handle)
        signal.signal(signal.SIGINT, self.handle)

    def handle(self, signum, frame) -> None:
        again = self.signum and signum == signal.SIGINT
        if again and time.monotonic() - self.at > 1:  # (within a second: a launcher's copy)
            stderr_line("\nerror: SIGINT again: stopping now, without a checkpoint")  # every rank
            os._exit(128 + signum)
        if not self.signum:
            self.signum = signum
            self.at = time.monotonic()
        if self.setting_up:  # nothing written yet: out_dir is put back as it was (RunFolder)
            self.setting_up = False  # (a second signal while it is put back only records)
            raise StoppedInSetup

    def requested(self) -> bool:
        """Whether this process, or (looked up once a second) another rank, was asked to stop."""
        store = _store()
        if store is not None and self.signum and not self.posted:
            store.set(KEY, str(self.signum))
            self.posted = True
        elif store is not None and not self.signum and time.monotonic() - self.looked > POLL:
            self.looked = time.monotonic()
            if store.check([KEY]):
                self.signum = int(store.get(KEY))
                self.posted = True
        return bool(self.signum)

    def agreed(self) -> int:
        """The signal any rank got, on every rank (0: none); every rank calls it at one point."""
        if not dist.is_initialized():
            return self.signum
        flag = torch.tensor([float(self.requested() and self.signum)])
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True)
        while not work.is_completed():  # waiting for slower ranks: post a signal that comes now
            self.requested()
            time.sleep(0.01)
        work.wait()
        agreed = int(flag.item())
        self.signum = agreed or self.signum  # (a signal during the wait counts at the next one)
        return agreed


STOP = Stop()
should_stop = STOP.requested


@contextmanager
def setting_up():
    """Set-up, which loads and checks but writes nothing: SIGTERM or SIGINT ends it at once with
    StoppedInSetup (a model load can take minutes), where afterwards a signal is a request that the
    loop honours at its next safe point. On a stop, RunFolder.setting_up puts out_dir back."""
    if STOP.signum:  # a signal between install() and here
        raise StoppedInSetup
    STOP.setting_up = True
    try:
        yield
    finally:
        STOP.setting_up = False


def stopped_in_setup() -> int:
    """The one line and the exit code (128 + the signal) of a stop during set-up."""
    name = signal.Signals(STOP.signum).name
    stderr_line(f"stopped by {name} during set-up; nothing was written (out_dir is as it was)")
    return 128 + STOP.signum


def _store():
    """The process group's key-value store (torchrun's), None without one."""
    if not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):  # a group made without a store
        return None


@contextmanager
def abandonable():
    """A phase a stop may cut short on this rank. It must hold no collective (the other ranks would
    wait in it): an Interrupted inside ends it early; at its end every rank agrees, and all raise
    Interrupted if any rank was stopped."""
    try:
        yield
    except Interrupted:
        pass
    if STOP.agreed():
        raise Interrupted


@contextmanager
def generating(model, compute):
    """A generation phase: whole weights under FSDP, the compute dtype, and a stop abandons it on
    every rank (`abandonable`)."""
    with parallel.generation(model, compute), abandonable():
        yield


class Rewound:
    """What `rewind` yields: `stopped` is set when a stop abandoned the step."""

    stopped = False


@contextmanager
def rewind(generators: list):
    """Around a step's rollout: a stop during it (or agreed at its end) puts back the RNG streams
    and the `generators` (objects with get_state / set_state) and sets `stopped`; the caller puts
    back its data position, so a checkpoint now is this step's start."""
    rng = rng_state()
    states = [g.get_state() for g in generators]
    mark = Rewound()
    try:
        yield mark
        if STOP.agreed():
            raise Interrupted
    except Interrupted:
        set_rng_state(rng)
        for g, state in zip(generators, states):
            g.set_state(state)
        mark.stopped = True


class StepStart:
    """What a checkpoint keeps, taken at a step's start while its update may run several passes
    (lookahead.*, optim.epochs > 1): the trained weights and the optimizer's state (about 3× the
    trained parameters, this rank's parts, in host memory; written back in place), the
    `stateful` objects' states (the replay, the methods), the `generators`, every RNG stream and a
    copy of the run's progress. A stop during the update puts them back (`put_back`): the run
    stops as at the step's start, and --resume redoes the step."""

    def __init__(self, model, optimizer, stateful: list, generators: list, progress):
        self.weights = [_host(p) for p in parallel.trained(model)]
        self.moments = {}  # AdamW's state of each parameter that has one (none before a step)
        for p, state in optimizer.state.items():
            self.moments[p] = {k: _host(parallel.local(v)) for k, v in state.items()}
        self.lrs = [group["lr"] for group in optimizer.param_groups]
        self.states = [copy.deepcopy(obj.state_dict()) for obj in stateful]
        self.generators = [g.get_state() for g in generators]
        self.rng = rng_state()
        self.progress = copy.deepcopy(progress)

    def put_back(self, model, optimizer, stateful: list, generators: list):
        """Every saved state in its place; returns the progress as it was."""
        with torch.no_grad():
            for p, saved in zip(parallel.trained(model), self.weights, strict=True):
                p.copy_(saved)
            for p in list(optimizer.state):  # in place: FSDP's shards stay where they are
                if p not in self.moments:
                    del optimizer.state[p]
                    continue
                for k, saved in self.moments[p].items():
                    optimizer.state[p][k] = _put_back(optimizer.state[p].get(k), saved)
        for group, lr in zip(optimizer.param_groups, self.lrs, strict=True):
            group["lr"] = lr
        for obj, state in zip(stateful, self.states, strict=True):
            obj.load_state_dict(state)
        for g, state in zip(generators, self.generators, strict=True):
            g.set_state(state)
        set_rng_state(self.rng)
        return self.progress


def _host(x):
    """A copy of `x` kept apart from it: a tensor's in host memory, anything else deep."""
    if torch.is_tensor(x):
        return x.detach().to("cpu", copy=True)
    return copy.deepcopy(x)


def _put_back(now, saved):
    """`saved` written into the tensor `now` in place (this rank's part of a shard), or `saved`
    itself where there is no tensor to write into."""
    if torch.is_tensor(now) and torch.is_tensor(saved):
        parallel.local(now).copy_(saved)
        return now
    return saved


class StopRequested(transformers.StoppingCriteria):
    """Ends a `generate` call after the token under way once a stop is asked for."""

    def __call__(self, input_ids, scores, **kwargs):
        B, device = input_ids.shape[0], input_ids.device
        return torch.full((B,), should_stop(), dtype=torch.bool, device=device)


def rng_state() -> dict:
    """Every global RNG as lists and tensors, so the checkpoint loads with weights_only=True."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(), "numpy": [kind, keys.tolist(), pos, has_gauss, gauss],
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
