r"""ZeRO stage 3 against PyTorch FSDP2 (torch.distributed.fsdp.fully_shard), side by side.

    python benchmarks/stage3_vs_fsdp.py --n_layer 4 --n_embd 256 --block_size 128 --micro_batch 8 \
        --steps 20 --warmup 3 --world_size 2

Spawns `world_size` gloo ranks (CPU processes) once; every rank builds the GPT of
examples/gpt.py (same seed, tied embedding / lm_head weight, fp32) three times and trains it with
AdamW, one micro-batch per optimizer step (gradient_accumulation_steps 1), in three ways:

- zero stage 3, stage3_module_granularity_threshold = the parameter count of one transformer
  block (so each block is one fetch unit) and stage3_param_persistence_threshold 0 (nothing
  stays gathered);
- zero stage 2 (same config otherwise);
- FSDP2: fully_shard() on each block, then on the root; torch.optim.AdamW with the
  hyper-parameters zero resolved, clip_grad_norm_ with the same max norm.

For stage 3 it reports communication elements per optimizer step / Psi (engine.comm_stats(),
paper units), padding overhead, model-state bytes per rank beside the fp32 analogue of the
paper's stage 3 formula (4 + 4 + 8) Psi / N, and the fetch units. Step times are medians over
--steps steps after --warmup steps; the three contestants take turns one step each (helpers of
benchmarks/_common.py) and a barrier precedes every clock read. If fully_shard fails on
this torch / gloo / CPU, the exact error is printed and the FSDP2 row is skipped. A measurement
script, not a test: nothing asserts on time.
"""

import argparse
import gc
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    CLIP,
    available_cores,
    build_fsdp2,
    build_model,
    free_port,
    init_rank,
    make_batches,
    time_interleaved,
    zero_config,
)

import zero  # noqa: E402


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
        "--reduce_bucket_size", type=int, default=500_000, help="elements per gradient bucket"
    )
    parser.add_argument(
        "--allgather_bucket_size",
        type=int,
        default=1_000_000,
        help="stage 2: elements all-gathered at once after the step",
    )
    parser.add_argument(
        "--prefetch",
        type=int,
        default=None,
        help="stage3_prefetch_bucket_size in elements (default: zero's default)",
    )
    return parser.parse_args(argv)


def block_numel(args) -> int:
    return sum(p.numel() for p in build_model(args).blocks[0].parameters())


def build_zero(args, stage: int):
    config = zero_config(args, stage, "fp32")
    if stage == 3:
        zc = config["zero_optimization"]
        zc["stage3_module_granularity_threshold"] = block_numel(args)
        zc["stage3_param_persistence_threshold"] = 0
        if args.prefetch is not None:
            zc["stage3_prefetch_bucket_size"] = args.prefetch
    engine, _, _, _ = zero.initialize(model=build_model(args), config=config)

    def step(x, y):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()

    return engine, step


def worker(rank: int, args: argparse.Namespace, port: int) -> None:
    init_rank(rank, args.world_size, port)
    try:
        psi = sum(p.numel() for p in build_model(args).parameters() if p.requires_grad)
        engine3, step3 = build_zero(args, 3)
        engine2, step2 = build_zero(args, 2)
        # The same stage 3 without the cross-rank agreement checks (comm.Agreement), to price
        # them; a measurement only: the product always checks.
        unchecked, step3_unchecked = build_zero(args, 3)
        unchecked.comm.agreement = unchecked.gatherer.agreement = None
        step_fns = {"zero3": step3, "zero2": step2, "zero3 unchecked": step3_unchecked}
        checks_before = engine3.comm.agreement.checks if engine3.comm.agreement else 0
        hyper = dict(engine3.optimizer.param_groups[0])
        fsdp_error, fsdp_state = None, None
        try:
            step_fns["fsdp2"], fsdp_state = build_fsdp2(args, "fp32", hyper)
        except Exception as exc:  # report and skip the row, as asked
            fsdp_error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        batches = make_batches(args, rank, args.warmup + args.steps)
        try:
            ms = time_interleaved(step_fns, batches, args.warmup)
        except Exception as exc:
            if "fsdp2" not in step_fns:
                raise
            # fully_shard built but a step failed: report it, time the zero rows alone
            fsdp_error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            step_fns.pop("fsdp2")
            ms = time_interleaved(step_fns, batches, args.warmup)
        checks = engine3.comm.agreement.checks - checks_before if engine3.comm.agreement else 0
        if rank == 0:
            report(args, engine3, psi, ms, fsdp_error, fsdp_state, torch.get_num_threads())
            steps = args.warmup + args.steps
            print(
                f"agreement checks: {checks / steps:.1f} per step; zero stage 3 with / without "
                f"them: {ms['zero3']:.1f} / {ms['zero3 unchecked']:.1f} ms = "
                f"{ms['zero3'] / ms['zero3 unchecked']:.3f}x (target < 1.02x)"
            )
        del engine2, unchecked, step_fns
        gc.collect()
    finally:
        dist.destroy_process_group()


def report(args, engine, psi, ms, fsdp_error, fsdp_state, threads) -> None:
    n = args.world_size
    layout = engine.optimizer.layout
    assert layout.numel == psi, (layout.numel, psi)
    comm = engine.comm_stats()
    comm_elements = sum(op["elements"] for op in comm.values())
    state = engine.model_state_bytes()
    measured = sum(state.values())
    formula = (4 + 4 + 8) * psi / n
    units = engine.gatherer.units
    print(
        f"machine: {available_cores()} cores, torch {torch.__version__}, world size {n} (gloo), "
        f"{threads} intra-op thread(s) per rank"
    )
    print(
        f"model: GPT n_layer={args.n_layer} n_head={args.n_head} n_embd={args.n_embd} "
        f"block_size={args.block_size} vocab=256, micro-batch {args.micro_batch}, fp32, AdamW, "
        f"gradient_accumulation_steps 1, clip {CLIP}; {args.steps} timed steps after "
        f"{args.warmup} warm-up, median"
    )
    zc = engine.config.zero
    print(
        f"stage 3: stage3_module_granularity_threshold={zc.stage3_module_granularity_threshold} "
        f"(one block), stage3_param_persistence_threshold={zc.stage3_param_persistence_threshold}"
        f", stage3_prefetch_bucket_size={zc.stage3_prefetch_bucket_size}, {len(units)} units, "
        f"{len(layout.buckets)} buckets"
    )
    print(
        "units: "
        + ", ".join(f"{u.name} ({sum(b.layout.numel for b in u.buckets):,})" for u in units)
    )
    print()
    print(
        "| run | Psi | comm elements/Psi | padding % | model-state bytes/rank "
        "| 16 Psi / N bytes | measured/formula | step ms |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print(
        f"| zero stage 3 | {psi:,} | {comm_elements / psi:.6f} "
        f"| {100 * (layout.padded_numel / layout.numel - 1):.4f} | {measured:,} "
        f"| {formula:,.0f} | {measured / formula:.4f} | {ms['zero3']:.1f} |"
    )
    print(f"| zero stage 2 | {psi:,} | | | | | | {ms['zero2']:.1f} |")
    if "fsdp2" in ms:
        fb = fsdp_state()
        print(
            f"| FSDP2 (fully_shard) | {psi:,} | | | {fb:,} | {formula:,.0f} "
            f"| {fb / formula:.4f} | {ms['fsdp2']:.1f} |"
        )
    print()
    kinds = ", ".join(f"{k} {v:,}" for k, v in state.items())
    ops = ", ".join(
        f"{op} {t['calls']} calls / {t['elements']:,} elements ({t['elements'] / psi:.6f} Psi)"
        for op, t in comm.items()
    )
    print(f"zero stage 3 model-state bytes by kind: {kinds}")
    print(f"zero stage 3 collectives of the last step: {ops}")
    print(f"zero stage 3 prefetch hits (whole run): {engine.gatherer.prefetch_hits}")
    print(f"zero stage 3 / zero stage 2 step time: {ms['zero3'] / ms['zero2']:.3f}x")
    if "fsdp2" in ms:
        print(
            "FSDP2 model-state bytes: local shards of parameters and AdamW state after the "
            "timed steps; its gradients are freed by zero_grad(set_to_none=True), zero keeps "
            "its fp32 gradient shard (4 Psi / N) between steps"
        )
        print(f"zero stage 3 / FSDP2 step time: {ms['zero3'] / ms['fsdp2']:.3f}x (target <= 1.10x)")
    else:
        print(f"FSDP2 row skipped: fully_shard failed on this torch / gloo / CPU:\n{fsdp_error}")


def main(argv=None) -> None:
    args = parse_args(argv)
    mp.spawn(worker, args=(args, free_port()), nprocs=args.world_size, join=True)


if __name__ == "__main__":
    main()
