"""The real-scale distributed path on this CPU (issue 24): collectives under an accelerator's
backend map, a checkpoint that resumes on another number of processes, the model read once per job,
RLEP's phase-I store, and the replay ring's bytes.

  python -m pytest -q tests/test_distributed.py   # minutes on 2 CPU cores; torchrun, gloo, 1 thread

Under NCCL only CUDA tensors have a backend. gloo's "cuda:gloo" map is the same situation on a CPU:
any collective on a host tensor fails with "No backend type associated with device type cpu".
"""

import datetime
import gc
import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from fixtures import torchrun

import train
from support import checkpoint
from support.parallel import all_ranks, backend_map

from fixtures import REPO  # (tests/fixtures.py: the repository's root)
TINY = [
    "--config",
    "configs/tiny.yaml",
    "--rollout.batch_size=16",
    "--rollout.group_size=4",
    "--rollout.max_new_tokens=16",
    "--eval.n=8",
    "--eval.k=1",
    "--eval.every=0",
    "--checkpoint.every=1",
    "--reward.no_answer=-1",
    "--threads=1",
    "--wandb.mode=disabled",
]


def worker(opts: dict, args: list[str]) -> None:
    """Under torchrun: train.py's main, the process group first initialised with opts["backend"]
    (setup sees it and keeps it); with opts["probe"], what restore loaded is written there (see
    `probe`)."""
    if "backend" in opts:
        dist.init_process_group(opts["backend"], timeout=datetime.timedelta(minutes=5))
    if "probe" in opts:
        restore = checkpoint.restore

        def probed(ck, state, cfg, model, optimizer, replay, progress, *rest):
            said = restore(ck, state, cfg, model, optimizer, replay, progress, *rest)
            probe(model, optimizer, replay, Path(opts["probe"]))
            return said

        checkpoint.restore = probed
    if "loads" in opts:
        count_loads(Path(opts["loads"]))
    if "teardown" in opts:
        count_wrappers_at_teardown(Path(opts["teardown"]))
    sys.exit(train.main(args))


def count_loads(out: Path) -> None:
    """Record, per rank, every from_pretrained of a model (the paths read) into out/loads<rank>.json
    at exit."""
    import atexit

    from support import models

    calls, read = [], models.AutoModelForCausalLM.from_pretrained

    def counted(path, *a, **kw):
        calls.append(str(path))
        return read(path, *a, **kw)

    def write():
        (out / f"loads{os.environ['RANK']}.json").write_text(json.dumps(calls))

    models.AutoModelForCausalLM.from_pretrained = counted
    atexit.register(write)


def count_wrappers_at_teardown(out: Path) -> None:
    """Record, per rank, the DDP wrappers alive when the process group is destroyed (into
    out/wrappers<rank>.json). A wrapper's reducer freed after its group holds the group's last
    reference, and gloo's group destroyed there can hang the exit (support/parallel.close)."""
    destroy = dist.destroy_process_group

    def counted(*a, **kw):
        alive = sum(isinstance(o, DistributedDataParallel) for o in gc.get_objects())
        (out / f"wrappers{dist.get_rank()}.json").write_text(json.dumps(alive))
        return destroy(*a, **kw)

    dist.destroy_process_group = counted


def probe(model, optimizer, replay, out: Path) -> None:
    """Right after restore: rank 0 writes the whole weights and optimizer state (gathered as a
    checkpoint gathers them); every rank its buffer's stored rows (prompt, birth step, tokens) and
    its RNG state."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    weights = get_model_state_dict(model, options=checkpoint.FULL)
    optim = checkpoint.optimizer_state(model, optimizer)
    rank = dist.get_rank()
    if rank == 0:
        torch.save({"weights": weights, "optimizer": optim}, out / "restored.pt")
    rows = replay_rows(replay.state_dict())
    (out / f"rows{rank}.json").write_text(json.dumps({"rows": rows, "rng": torch.rand(1).item()}))


def replay_rows(d: dict) -> list:
    """The stored rows of a replay state_dict as sortable [prompt, born, tokens] lists."""
    slots = d["valid"].nonzero().squeeze(1).tolist()
    return sorted(
        [
            int(d["prompt_idx"][s]),
            int(d["born"][s]),
            d["tokens"][i, : int(d["seq_len"][s])].tolist(),
        ]
        for i, s in enumerate(slots)
    )


# -------------------------------------------------------------------------------------- backend map


def test_nccl_backend_map_registers_gloo_for_host_tensors(monkeypatch):
    """On a GPU, setup initialises "cpu:gloo,cuda:nccl": host tensors go to gloo, CUDA tensors to
    NCCL."""
    seen = []

    def init(backend, **kw):
        seen.append(backend)
        raise KeyboardInterrupt  # stop set-up here: nothing else is under test

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: None)
    monkeypatch.setattr(dist, "init_process_group", init)
    torchrun_env = {"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400"}  # as torchrun sets them
    for name, value in torchrun_env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(KeyboardInterrupt):
        train.setup(train.load_config(None, []), None, False)
    assert seen == ["cpu:gloo,cuda:nccl"] == [backend_map("cuda")]
    assert backend_map("cpu") == "gloo"


def host_collectives(backend: str) -> None:
    """Under torchrun: the trainer's host-tensor collectives (parallel.all_ranks,
    preempt.Stop.agreed) under `backend`; prints what each did."""
    from support import preempt

    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=5))
    done = {}
    for name, call in (
        ("all_ranks", lambda: all_ranks(1.0)),
        ("stop_signal", lambda: preempt.Stop().agreed()),
    ):
        try:
            done[name] = f"ok {call()}"
        except RuntimeError as e:
            done[name] = str(e)
    # one write of < 4 KiB to a pipe is atomic: the ranks' lines never interleave (print's
    # separate newline write let them)
    sys.stdout.write(json.dumps(done) + "\n")
    sys.stdout.flush()
    dist.destroy_process_group()


def test_nccl_like_backend_map_without_cpu_fails_on_host_collectives():
    """The control: with only an accelerator's backend registered (cuda:gloo here, as NCCL alone
    on a GPU), the trainer's host-tensor collectives fail; under train.py's map (the accelerator's
    part played by gloo) they run."""
    bare = torchrun(__file__, "--control=cuda:gloo").stdout.splitlines()
    mapped = backend_map("cuda").replace("nccl", "gloo")
    ok = torchrun(__file__, f"--control={mapped}").stdout.splitlines()
    refused = "No backend type associated with device type cpu"
    assert [json.loads(x) for x in bare] == [{"all_ranks": refused, "stop_signal": refused}] * 2
    assert [json.loads(x) for x in ok] == [{"all_ranks": "ok 2.0", "stop_signal": "ok 0"}] * 2


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_nccl_backend_map_runs_setup_eval_step_checkpoint_resume(tmp_path, parallel):
    """train.py's own map for a GPU, its accelerator backend played by gloo (NCCL needs a GPU):
    set-up, the step-0 eval, steps with replay, checkpoints, a stop signal's agreement, --resume,
    final/; at the end no DDP wrapper outlives the process group (else the exit can hang)."""
    backend = backend_map("cuda").replace("nccl", "gloo")
    assert backend == "cpu:gloo,cuda:gloo"
    out = tmp_path / "run"
    common = [
        __file__,
        f"--backend={backend}",
        *TINY,
        f"--out_dir={out}",
        f"--model.parallel={parallel}",
        "--replay.strategy=uniform",
        "--replay.ratio=0.25",
        f"--teardown={tmp_path}",
    ]
    torchrun(*common, "--max_steps=1")
    assert (out / "checkpoints" / "step_000001").is_dir()
    wrappers = [json.loads((tmp_path / f"wrappers{i}.json").read_text()) for i in range(2)]
    assert wrappers == [0, 0], "a DDP wrapper lived on when the process group was destroyed"
    r = torchrun(*common, "--max_steps=2", "--resume")
    assert "resuming from" in r.stderr
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in rows] == [1, 2] and (out / "final").is_dir()


# ------------------------------------------------------------------------------------ buffer memory


def test_world_size_free_replay_state_holds_int32_ids_and_occupied_slots_only(tmp_path):
    """The ring: 4 bytes per token id (int32) + 4 per log-prob = 8 bytes per position, from 12
    (int64 ids); its checkpoint state holds the occupied slots, cut to their longest row, and
    restores the same draws."""
    import test_replay as tr

    C, L = 64, 100
    buf = tr.buffer("uniform", ratio=0.5, capacity=C, max_len=L)
    per_slot = sum(getattr(buf.rows, k)[0].nbytes for k in ("tokens", "behav_logp"))
    assert buf.rows.tokens.dtype == torch.int32 and per_slot == 8 * L == 800  # was 12 * L = 1,200
    stored = tr.rollouts(5, L=12, born=1)  # rows of 5..12 tokens
    tr.push(buf, stored, 1)
    state = buf.state_dict()
    L5 = int(stored.seq_len.max())
    assert state["tokens"].shape == state["behav_logp"].shape == (5, L5)  # not (64, 100)
    torch.save(state, tmp_path / "replay.pt")
    loaded = torch.load(tmp_path / "replay.pt", weights_only=True)
    again = tr.buffer("uniform", ratio=0.5, capacity=C, max_len=L)
    again.load_state_dict(loaded)
    assert (
        torch.equal(again.rows.tokens, buf.rows.tokens) and again.rows.tokens.dtype == torch.int32
    )
    assert torch.equal(again.rows.behav_logp, buf.rows.behav_logp)
    fresh = tr.rollouts(4, born=2, seed=3)
    tr.assert_same(again.sample(fresh, 2), buf.sample(fresh, 2))  # the same rows drawn, bit for bit
    assert (
        tmp_path / "replay.pt"
    ).stat().st_size < C * L * 8 / 3  # the whole ring's ids and log-probs: 51 kB


# ------------------------------------------------------------------------------------- RLEP phase I


def phase_one_file(path: Path, rows_per_problem: int, suffix: list[int] | None = None) -> int:
    """A phase-I file of `rows_per_problem` verified answers to every tiny training problem
    (distinct token sequences: the answer, then 0..k-1 spaces, then the end token); returns its
    number of rows."""
    from data.loaders import load_task
    from support.models import load_pretrained

    _, tok = load_pretrained(str(REPO / "data" / "tiny_model"))
    problems, _ = load_task(train.load_config("configs/tiny.yaml", []).data, 1)
    lines = []
    for p in problems:
        answer = tok(f"\\boxed{{{p.answer}}}", add_special_tokens=False)["input_ids"]
        space = tok(" ", add_special_tokens=False)["input_ids"]
        for k in range(rows_per_problem):
            ids = answer + space * k + (suffix or []) + [tok.eos_token_id]
            lines.append(json.dumps({"problem": p.problem, "completion_ids": ids}) + "\n")
    path.write_text("".join(lines))
    return len(lines)


def test_phase_one_store_keeps_every_prompts_successes_past_capacity(tmp_path):
    """Through train.py: 6,000 phase-I rows (3 per problem) and replay.capacity 64. Every group of
    every step gets rlep_n = 2 stored successes (the ring capped at 64 rows evicted 5,936 of them
    and replayed 0, 0, 2 rows in these 3 steps, against 8, 8, 8 here); the checkpoint holds no
    phase-I row; a changed file refuses --resume."""
    src = tmp_path / "phase1.jsonl"
    assert phase_one_file(src, 3) == 6000
    out = tmp_path / "run"
    args = [
        *TINY,
        f"--out_dir={out}",
        "--replay.strategy=rlep",
        f"--replay.rlep_source={src}",
        "--replay.capacity=64",
        "--replay.rlep_n=2",
    ]
    assert train.main([*args, "--max_steps=3"]) == 0
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    prompts_per_step = 16 // 4
    assert [r["replay/rows"] for r in rows] == [2 * prompts_per_step] * 3
    assert [r["replay/size"] for r in rows] == [6000.0] * 3
    state = torch.load(out / "checkpoints" / "step_000003" / "state_rank0.pt", weights_only=True)
    assert state["replay"]["tokens"].numel() == 0 and len(state["replay"]["source_sha256"]) == 64
    assert int(state["replay"]["source_used"].sum()) == 3 * 2 * prompts_per_step
    phase_one_file(src, 2)
    assert train.main([*args, "--max_steps=4", "--resume"]) == 2


def test_phase_one_store_refuses_a_row_it_would_cut(tmp_path, capsys):
    src = tmp_path / "phase1.jsonl"
    phase_one_file(src, 1, suffix=[5] * 20)  # 20 more tokens: over rollout.max_new_tokens=16
    out = tmp_path / "run"
    args = [*TINY, f"--out_dir={out}", "--replay.strategy=rlep", f"--replay.rlep_source={src}"]
    assert train.main([*args, "--max_steps=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "over rollout.max_new_tokens (16): it would be cut" in err
    assert not out.exists()


# --------------------------------------------------------------------------------------- world size


@pytest.mark.parametrize(
    "parallel,saved,resumed", [("ddp", 2, 1), ("ddp", 1, 2), ("fsdp", 2, 1), ("fsdp", 1, 2)]
)
def test_world_size_change_resumes_the_same_weights_optimizer_and_buffer(
    tmp_path, parallel, saved, resumed
):
    """A run saved by `saved` processes resumes on `resumed`: right after loading, the whole weights
    and optimizer state equal the checkpoint's, every stored replay row is on exactly one rank, and
    the run completes its steps (its RNG streams restart from (seed, rank, step): not the same
    samples)."""
    out = tmp_path / "run"
    common = [
        __file__,
        *TINY,
        f"--out_dir={out}",
        f"--model.parallel={parallel}",
        "--replay.strategy=uniform",
        "--replay.ratio=0.25",
    ]
    torchrun(*common, "--max_steps=2", n=saved)
    ck = out / "checkpoints" / "step_000002"
    opt = torch.load(ck / "optimizer.pt", weights_only=True)
    states = [torch.load(ck / f"state_rank{i}.pt", weights_only=True) for i in range(saved)]
    assert all("optimizer" not in s for s in states) and not (ck / "state_rank2.pt").exists()
    r = torchrun(*common, f"--probe={tmp_path}", "--max_steps=3", "--resume", n=resumed)
    assert f"saved by {saved} processes: buffers re-split, RNG reseeded" in r.stderr
    got = torch.load(tmp_path / "restored.pt", weights_only=True)
    from safetensors.torch import load_file

    weights = load_file(ck / "model.safetensors")
    assert got["weights"].keys() >= weights.keys()
    assert all(torch.equal(got["weights"][k], weights[k]) for k in weights)
    assert json.dumps(got["optimizer"]["param_groups"]) == json.dumps(
        opt["param_groups"]
    )  # (tuples as lists)
    assert got["optimizer"]["state"].keys() == opt["state"].keys() and opt["state"]
    for k, s in opt["state"].items():
        assert all(torch.equal(got["optimizer"]["state"][k][n], v) for n, v in s.items()), k
    rows = [json.loads((tmp_path / f"rows{i}.json").read_text()) for i in range(resumed)]
    before = sorted(x for s in states for x in replay_rows(s["replay"]))
    assert len(before) > 0 and sorted(x for p in rows for x in p["rows"]) == before
    lines = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3] and (out / "final").is_dir()


def test_world_size_final_is_written_in_the_compute_dtype(tmp_path):
    """final/ holds the compute dtype (bf16: half the bytes); checkpoints keep the float32 master
    weights."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    assert (
        train.main([*TINY, f"--out_dir={out}", "--max_steps=1", "--model.compute_dtype=bfloat16"])
        == 0
    )
    final, ck = (
        load_file(out / "final" / "model.safetensors"),
        load_file(out / "checkpoints" / "step_000001" / "model.safetensors"),
    )
    assert {v.dtype for v in final.values()} == {torch.bfloat16} and {
        v.dtype for v in ck.values()
    } == {torch.float32}
    assert all(torch.equal(final[k], ck[k].to(torch.bfloat16)) for k in final)
    assert json.loads((out / "final" / "config.json").read_text())["dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(out / "final", dtype="auto")
    assert next(model.parameters()).dtype == torch.bfloat16


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_world_size_2_reads_the_model_on_rank_0_only(tmp_path, parallel):
    """Under torchrun every rank builds the model on the meta device; rank 0 alone reads the weights
    (at the start, then from the checkpoint on --resume) and sends each rank its part; a resumed run
    continues."""
    out = tmp_path / "run"
    common = [
        __file__,
        f"--loads={tmp_path}",
        *TINY,
        f"--out_dir={out}",
        f"--model.parallel={parallel}",
    ]
    torchrun(*common, "--max_steps=1")
    loads = [json.loads((tmp_path / f"loads{i}.json").read_text()) for i in range(2)]
    assert loads == [["data/tiny_model"], []]
    torchrun(*common, "--max_steps=2", "--resume")
    loads = [json.loads((tmp_path / f"loads{i}.json").read_text()) for i in range(2)]
    assert loads == [[str(out / "checkpoints" / "step_000001")], []]


if __name__ == "__main__" and sys.argv[1].startswith("--control="):
    host_collectives(sys.argv[1].partition("=")[2])
elif __name__ == "__main__":
    named = ("--backend=", "--probe=", "--loads=", "--teardown=")
    flags = [a for a in sys.argv[1:] if a.startswith(named)]
    worker(dict(a[2:].split("=", 1) for a in flags), [a for a in sys.argv[1:] if a not in flags])
