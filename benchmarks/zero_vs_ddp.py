r"""ZeRO stages 0-2 against torch DistributedDataParallel, side by side, in one spawned group.

    python benchmarks/zero_vs_ddp.py --n_layer 4 --n_embd 256 --block_size 128 --micro_batch 8 \
        --steps 20 --warmup 3 --world_size 2

Spawns `world_size` gloo ranks (CPU processes) once; every rank then runs each configuration in
sequence on the GPT of examples/gpt.py with random byte tokens (the same model initialization and
the same per-rank batches for every configuration). Per configuration it records:

- communication per optimizer step (engine.comm_stats(), elements in the paper's units: an
  all-reduce counts twice its size) divided by Psi, the trainable parameter count with the tied
  embedding counted once; the paper's target is 2 Psi for stages 0-2 (ZeRO, section 7);
- padding overhead of the flat layout (padded elements / parameter elements - 1);
- model-state bytes per rank (engine.model_state_bytes()) beside the paper's formula for that
  stage and precision (see `formula` below for which formula each row uses);
- the median step time (forward + backward + optimizer step of one micro-batch) over --steps
  steps after --warmup steps, beside DDP + torch.optim.AdamW with the same hyper-parameters,
  gradient clipping and data, measured in the same run.

Rank 0 prints a markdown table (the results land in docs/performance.md). This is a measurement
script, not a test: nothing here asserts on time.
"""

import argparse
import gc
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    available_cores,
    build_ddp,
    build_model,
    formula,
    free_port,
    init_rank,
    make_batches,
    native_bf16,
    time_interleaved,
    zero_config,
)

import zero  # noqa: E402

# (stage, dtype name) per row; the DDP baseline of a row runs in the same precision.
RUNS = [(0, "fp32"), (1, "fp32"), (2, "fp32"), (2, "bf16")]


@dataclass
class Row:
    stage: int
    dtype: str
    psi: int
    comm_elements: int
    padding: float
    state: dict
    step_ms: float
    comm: dict
    num_buckets: int


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n_layer", type=int, default=4)
    parser.add_argument("--n_head", type=int, default=4)
    parser.add_argument("--n_embd", type=int, default=256)
    parser.add_argument("--block_size", type=int, default=128)
    parser.add_argument("--micro_batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    parser.add_argument("--world_size", type=int, default=2)
    parser.add_argument(
        "--dtypes", default="fp32,bf16", help="comma-separated subset of fp32,bf16 to run"
    )
    parser.add_argument(
        "--bf16_steps",
        type=int,
        default=None,
        help="timed steps of the bf16 rows; default --steps where the CPU has native bf16 "
        "matmul (avx512_bf16/amx_bf16) or a GPU is used, else 1 (emulated bf16 GEMM is ~70x "
        "slower than fp32, so more steps would take minutes and measure only that)",
    )
    parser.add_argument(
        "--reduce_bucket_size", type=int, default=500_000, help="elements per gradient bucket"
    )
    parser.add_argument(
        "--allgather_bucket_size",
        type=int,
        default=1_000_000,
        help="elements all-gathered at once after the step (two buckets in flight by default)",
    )
    return parser.parse_args(argv)


# ----- the two contestants ----------------------------------------------------------------------
def build_zero(args, stage: int, dtype: str):
    """A zero engine and its one-micro-batch training step (forward, backward, step)."""
    model = build_model(args)
    engine, _, _, _ = zero.initialize(model=model, config=zero_config(args, stage, dtype))

    def step(x, y):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()

    return engine, step


def zero_row(engine, stage: int, dtype: str, psi: int, step_ms: float) -> Row:
    layout = engine.optimizer.layout
    assert layout.numel == psi, (layout.numel, psi)
    comm = engine.comm_stats()
    return Row(
        stage=stage,
        dtype=dtype,
        psi=psi,
        comm_elements=sum(op["elements"] for op in comm.values()),
        padding=layout.padded_numel / layout.numel - 1.0,
        state=engine.model_state_bytes(),
        step_ms=step_ms,
        comm=comm,
        num_buckets=len(layout.buckets),
    )


def run_dtype(args, dtype: str, batches, warmup: int) -> tuple[list[Row], float]:
    """All stages of one precision and their DDP baseline, timed in turns."""
    psi = sum(p.numel() for p in build_model(args).parameters() if p.requires_grad)
    engines, step_fns = {}, {}
    for stage, run_dtype_name in RUNS:
        if run_dtype_name == dtype:
            engines[stage], step_fns[f"zero{stage}"] = build_zero(args, stage, dtype)
    hyper = dict(next(iter(engines.values())).optimizer.param_groups[0])
    step_fns["ddp"] = build_ddp(args, dtype, hyper, args.reduce_bucket_size * 4 / 2**20)
    ms = time_interleaved(step_fns, batches, warmup)
    rows = [zero_row(e, s, dtype, psi, ms[f"zero{s}"]) for s, e in engines.items()]
    del engines, step_fns
    gc.collect()
    return rows, ms["ddp"]


def print_report(args, rows, ddp_ms, steps, threads) -> None:
    n = args.world_size
    print(
        f"machine: {available_cores()} cores, torch {torch.__version__}, world size {n} (gloo), "
        f"{threads} intra-op thread(s) per rank, native bf16 matmul: {native_bf16()}"
    )
    print(
        f"model: GPT n_layer={args.n_layer} n_head={args.n_head} n_embd={args.n_embd} "
        f"block_size={args.block_size} vocab=256, micro-batch {args.micro_batch}; timed steps "
        + ", ".join(f"{d}: {s} after {w} warm-up" for d, (w, s) in steps.items())
    )
    print(
        f"buckets: reduce_bucket_size={args.reduce_bucket_size} elements "
        f"({rows[0].num_buckets} buckets), allgather_bucket_size="
        f"{args.allgather_bucket_size} elements; DDP bucket_cap_mb="
        f"{args.reduce_bucket_size * 4 / 2**20:.2f} (the bytes of one fp32 gradient bucket)"
    )
    print()
    print(
        "| stage | dtype | Psi | comm elements/Psi | padding % | model-state bytes/rank "
        "| paper formula bytes | formula | measured/formula | step ms | DDP step ms "
        "| zero/DDP |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        per_psi, name = formula(row.stage, row.dtype, n)
        measured = sum(row.state.values())
        expected = per_psi * row.psi
        ddp = ddp_ms[row.dtype]
        print(
            f"| {row.stage} | {row.dtype} | {row.psi:,} | {row.comm_elements / row.psi:.6f} "
            f"| {100 * row.padding:.4f} | {measured:,} | {expected:,.0f} | {name} "
            f"| {measured / expected:.4f} | {row.step_ms:.1f} | {ddp:.1f} "
            f"| {row.step_ms / ddp:.3f} |"
        )
    print()
    print("model-state bytes per rank by kind, and the collectives of the last step:")
    for row in rows:
        kinds = ", ".join(f"{k} {v:,}" for k, v in row.state.items())
        ops = ", ".join(
            f"{op} {t['calls']} calls / {t['elements']:,} elements" for op, t in row.comm.items()
        )
        print(f"- stage {row.stage} {row.dtype}: {kinds}; {ops}")


# ----- per rank ---------------------------------------------------------------------------------
def worker(rank: int, args: argparse.Namespace, port: int) -> None:
    init_rank(rank, args.world_size, port)
    try:
        steps = {}
        for dtype in args.dtypes.split(","):
            if dtype == "bf16" and not native_bf16():
                steps[dtype] = (1, 1 if args.bf16_steps is None else args.bf16_steps)
            elif dtype == "bf16" and args.bf16_steps is not None:
                steps[dtype] = (args.warmup, args.bf16_steps)
            else:
                steps[dtype] = (args.warmup, args.steps)
        rows, ddp_ms = [], {}
        for dtype, (warmup, timed) in steps.items():
            dtype_rows, ddp_ms[dtype] = run_dtype(
                args, dtype, make_batches(args, rank, warmup + timed), warmup
            )
            rows += dtype_rows
        if rank == 0:
            print_report(args, rows, ddp_ms, steps, torch.get_num_threads())
    finally:
        dist.destroy_process_group()


def main(argv=None) -> None:
    args = parse_args(argv)
    unknown = set(args.dtypes.split(",")) - {"fp32", "bf16"}
    if unknown:
        raise ValueError(f"--dtypes {args.dtypes!r}: unknown {sorted(unknown)}; use fp32,bf16")
    mp.spawn(worker, args=(args, free_port()), nprocs=args.world_size, join=True)


if __name__ == "__main__":
    main()
