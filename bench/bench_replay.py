"""Time one replay step (sample + push) on a full buffer: the target is a median ≤ 5 ms at \
capacity 100,000.

Usage:
  python bench/bench_replay.py  # uniform and aper, capacity 100k, 256 rows of ~64 tokens
  python bench/bench_replay.py --strategies uniform,aper,exgrpo,rlep,group --steps 500 --threads 1

Each step makes the calls train.py makes around a fresh batch of 256 rows (ratio 0.5): plan,
before_advantages, sample, then push of the update batch with its rows' entropies (exgrpo's
current-policy entropy is a stand-in). The buffer is filled to capacity first, so eviction and
sampling see the worst case; aper's tau_max is set so that no row ages out (with the default
tau_max = 4 it would hold only ~1,000 rows).
One torch thread by default: ops on 100k-element vectors gain little from intra-op threads, and on a
shared machine a second thread mostly waits for a busy core (that wait shows in wall time, not in
CPU time).
"""

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
from replay import STRATEGIES, ReplayConfig, make_replay
from batch import Rollouts
from bench import cli


def fresh_batch(step: int, rows: int, group_size: int, length: int, g: torch.Generator) -> Rollouts:
    """`rows` rollouts of 16 prompt tokens + up to `length - 16` completion tokens, in groups of
    `group_size`."""
    seq_len = torch.randint(length - 16, length + 1, (rows,), generator=g)
    t = torch.arange(length)[None, :]
    correct = torch.rand(rows, generator=g) < 0.5
    reward = correct.float()
    adv = reward - reward.view(-1, group_size).mean(1).repeat_interleave(group_size)
    return Rollouts(
        tokens=torch.where(t < seq_len[:, None],
                           torch.randint(1, 150_000, (rows, length), generator=g),
                           0),
        prompt_len=torch.full((rows,), 16), seq_len=seq_len,
        behav_logp=torch.where((t >= 16) & (t < seq_len[:, None]),
                               -torch.rand(rows, length, generator=g),
                               0.0),
        truncated=seq_len == length,
        prompt_idx=torch.randint(0, 20_000, (rows // group_size,),
                                 generator=g).repeat_interleave(group_size),
        group=torch.arange(rows // group_size).repeat_interleave(group_size),
        born=torch.full((rows,), step),
        reward=reward, correct=correct, advantage=adv, entropy=torch.rand(rows, generator=g),
        replayed=torch.zeros(rows, dtype=torch.bool), onpolicy=torch.ones(rows, dtype=torch.bool),
        slot=torch.full((rows,), -1),
    )  # fmt: skip


def replay_config(strategy: str, args) -> ReplayConfig:
    """The buffer's settings; aper's tau_max so large that no row ages out."""
    return ReplayConfig(strategy=strategy, capacity=args.capacity, ratio=args.ratio, tau_max=10**9)


def bench(strategy: str, args) -> None:
    cfg = replay_config(strategy, args)
    buf = make_replay(cfg, max_len=args.length, pad_id=0, seed=0)
    g = torch.Generator().manual_seed(0)
    batches = [fresh_batch(0, args.rows, args.group_size, args.length, g) for _ in range(16)]
    buf.start([], [], None, None, entropy=lambda rows: torch.rand(len(rows), generator=g))
    step = 0
    # aper skips A = 0 rows: more pushes
    while len(buf) < args.capacity and step < 4 * args.capacity // args.rows:
        batches[step % 16].born.fill_(step)
        buf.push(batches[step % 16], step, batches[step % 16].entropy)
        step += 1
    # wall-clock and process CPU time (ms); CPU time excludes waiting for a busy core
    times, cpu = [], []
    for _ in range(args.steps):
        fresh = batches[step % 16]
        fresh.born.fill_(step)
        t0, c0 = time.perf_counter(), time.process_time()
        buf.plan(fresh.prompt_idx[:: args.group_size].tolist(), args.group_size, step)
        # rlep grows the groups; the others return fresh as it is
        mixed = buf.before_advantages(fresh, step)
        batch = buf.sample(mixed, step)
        buf.push(batch, step, torch.rand(len(batch), generator=g))
        times.append(1e3 * (time.perf_counter() - t0))
        cpu.append(1e3 * (time.process_time() - c0))
        step += 1
    m, median = buf.metrics(), statistics.median(times)
    print(f"{strategy:8s} size {int(m['replay/size']):7d}  "
          f"rows added/step {int(m['replay/sampled']):4d}  "
          f"wall median {median:6.3f} ms  p90 {sorted(times)[int(0.9 * len(times))]:6.3f} ms  "
          f"cpu median {statistics.median(cpu):6.3f} ms  "
          f"{'ok' if median <= args.budget else 'OVER BUDGET'}")  # fmt: skip


def main() -> None:
    p = cli.Parser(__file__, __doc__)
    p.add_argument("--strategies", type=cli.names(list(STRATEGIES)), default="uniform,aper",
                   help="comma-separated strategies to time")
    p.add_argument("--capacity", type=cli.positive_int, default=100_000)
    p.add_argument("--rows", type=cli.positive_int, default=256, help="fresh rows per step")
    p.add_argument("--group_size", type=cli.positive_int, default=16)
    p.add_argument("--length", type=cli.positive_int, default=64,
                   help="max_len; rows hold 16 prompt tokens, up to 48-64 in all")
    p.add_argument("--ratio", type=float, default=0.5, help="replay.ratio (its strategy's domain)")
    p.add_argument("--steps", type=cli.positive_int, default=300,
                   help="timed steps after the buffer is full")
    p.add_argument("--threads", type=cli.count, default=1,
                   help="torch threads (0 = torch's default); see the docstring")
    p.add_argument("--budget", type=cli.positive_float, default=5.0, help="ms per step")
    args = p.parse_args()
    if args.rows % args.group_size:
        p.error(f"--rows {args.rows} is not a multiple of --group_size {args.group_size}")
    if args.length <= 16:
        p.error(f"--length must be > 16 (the prompt's 16 tokens and a completion), got "
                f"{args.length}")
    for strategy in args.strategies:  # replay.py's own rules for each buffer's settings
        for key, (ok, rule) in replay_config(strategy, args).check().items():
            if not ok:
                p.error(f"{strategy}: replay.{key} must be {rule}")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"capacity {args.capacity}, {args.rows} fresh rows of ≤ {args.length} tokens, "
          f"ratio {args.ratio}, "
          f"{args.steps} steps, {torch.get_num_threads()} threads")  # fmt: skip
    for strategy in args.strategies:
        bench(strategy, args)


if __name__ == "__main__":
    main()
