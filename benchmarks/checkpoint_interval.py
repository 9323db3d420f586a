r"""What periodic checkpointing costs a training run: step time without it, with asynchronous
periodic checkpoints and with blocking ones, and how long step() waits per checkpoint.

    python benchmarks/checkpoint_interval.py --hidden 2048 --layers 6 --world_size 2 \
        --steps 30 --interval 5

Spawns `world_size` gloo ranks (CPU processes; --device cuda: one NCCL rank per GPU) once.
Each rank trains an MLP of `layers` Linear(hidden, hidden) layers (hidden^2 + hidden
parameters each; 6 x 2048: 25.2M parameters, 302 MB of fp32 master weights and AdamW state
over all ranks) with zero stage 2 and AdamW, in three modes one after another, each with a
fresh engine and checkpoint directory (under --dir, default a temporary directory):

- none: no checkpoint;
- async: checkpoint.save_interval_steps = --interval, async_save true (the default): step()
  copies the shards to host memory and a background thread writes them;
- sync: the same interval, async_save false: step() returns once the checkpoint is written.

Per mode and rank, after --warmup steps: the median time of a step that saves nothing, the mean
time over all --steps steps (what a run's throughput sees: the saving steps and the background
writes competing for the cores included), the time step() was blocked per checkpoint (measured
by the engine: the snapshot, or the whole write), and for async the time from the snapshot
until the last background write was published (waited for after the last step). A barrier
precedes each clock read. Rank 0 prints a markdown table (the max over ranks of each figure) and
writes --json. A measurement script, not a test: nothing here asserts on time.
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import init_rank, run_spawned, synchronize  # noqa: E402

import zero  # noqa: E402

MODES = ("none", "async", "sync")
MB = 2**20


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=2048, help="width of each Linear layer")
    parser.add_argument("--layers", type=int, default=6, help="number of Linear layers")
    parser.add_argument("--world_size", type=int, default=2, help="ranks to spawn")
    parser.add_argument("--micro_batch", type=int, default=8, help="samples per rank per step")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per mode")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per mode first")
    parser.add_argument("--interval", type=int, default=5, help="save_interval_steps")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dir", default=None, help="checkpoint directory (default: a temp dir)")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds for the whole run")
    return parser.parse_args(argv)


def build(args, mode: str, save_dir: str, device: torch.device):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(args.hidden, args.hidden) for _ in range(args.layers)]
    model = torch.nn.Sequential(*layers).to(device)
    checkpoint = {}
    if mode != "none":
        checkpoint = {
            "save_dir": save_dir,
            "save_interval_steps": args.interval,
            "async_save": mode == "async",
        }
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 2},
        "steps_per_print": 10**9,
        "checkpoint": checkpoint,
    }
    engine, _, _, _ = zero.initialize(model=model, config=config)
    return engine


def run_mode(args, mode: str, root: str, device: torch.device) -> dict:
    save_dir = os.path.join(root, mode)
    engine = build(args, mode, save_dir, device)
    x = torch.randn(args.micro_batch, args.hidden, device=device)
    times, saving = [], []
    for step in range(args.warmup + args.steps):
        synchronize(device)
        dist.barrier()
        began = time.perf_counter()
        engine.backward(engine(x).square().mean())
        engine.step()
        synchronize(device)
        elapsed = time.perf_counter() - began
        if step >= args.warmup:
            times.append(elapsed)
            saving.append(mode != "none" and engine.global_steps % args.interval == 0)
    drained = time.perf_counter()
    pending = engine.periodic.pending if engine.periodic is not None else None
    engine.close()  # waits for the last background write
    after_last = time.perf_counter() - drained
    if pending is not None:
        after_last += drained - pending.started  # time since its snapshot, not a barrier's
    blocking = list(engine.periodic.blocking_s) if engine.periodic is not None else []
    plain = [t for t, s in zip(times, saving, strict=True) if not s]
    return {
        "median_plain_step_s": statistics.median(plain),
        "mean_step_s": statistics.fmean(times),
        "checkpoints": len(blocking),
        "blocking_per_checkpoint_s": statistics.fmean(blocking) if blocking else 0.0,
        "last_write_s": after_last if mode == "async" else 0.0,
    }


def rank_main(rank: int, world_size: int, port: int, spec, results) -> None:
    args, root = spec
    try:
        results.put((rank, "started", None))
        device = init_rank(rank, world_size, port, args.device)
        if rank == 0:
            os.makedirs(root, exist_ok=True)
        dist.barrier()
        results.put((rank, "ok", {mode: run_mode(args, mode, root, device) for mode in MODES}))
    except Exception as error:  # reported by the parent
        results.put((rank, "error", f"{type(error).__name__}: {error}"))


def checkpoint_bytes(root: str) -> int:
    directory = Path(root) / "async"
    tag = (directory / "latest").read_text()
    return sum(f.stat().st_size for f in (directory / tag).iterdir())


def report(args, per_rank: dict, root: str) -> dict:
    params = args.layers * (args.hidden**2 + args.hidden)
    merged = {
        mode: {key: max(per_rank[r][mode][key] for r in per_rank) for key in per_rank[0][mode]}
        for mode in MODES
    }
    base = merged["none"]["mean_step_s"]
    print(
        f"\n{params / 1e6:.1f}M parameters, {args.world_size} ranks ({args.device}), "
        f"checkpoint of {checkpoint_bytes(root) / MB:.0f} MB every {args.interval} steps, "
        f"{args.steps} timed steps\n"
    )
    print(
        "| mode | median step, no save (ms) | mean step (ms) | vs none | checkpoints | "
        "step() blocked per checkpoint (ms) | last background write (ms) |"
    )
    print("|---|---|---|---|---|---|---|")
    for mode, row in merged.items():
        print(
            f"| {mode} | {row['median_plain_step_s'] * 1e3:.1f} | {row['mean_step_s'] * 1e3:.1f}"
            f" | {row['mean_step_s'] / base:.2f}x | {row['checkpoints']} | "
            f"{row['blocking_per_checkpoint_s'] * 1e3:.1f} | {row['last_write_s'] * 1e3:.1f} |"
        )
    return {"params": params, "args": vars(args), "modes": merged}


def main(argv=None) -> int:
    args = parse_args(argv)
    root = args.dir or tempfile.mkdtemp(prefix="zero-ckpt-interval-")
    try:
        outcome, per_rank = run_spawned(rank_main, args.world_size, (args, root), args.timeout)
        if outcome is not None:
            print(f"failed: {outcome[0]}: {outcome[1]}", file=sys.stderr)
            return 1
        result = report(args, per_rank, root)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
