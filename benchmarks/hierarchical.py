r"""Hierarchical partitioning on simulated nodes: ZeRO-3, hpZ and MiCS, intra- vs inter-node bytes.

    python benchmarks/hierarchical.py --nodes 2 --ranks_per_node 2 --n_layer 2 --n_embd 128 \
        --block_size 64 --micro_batch 4 --steps 5 --warmup 2

Spawns nodes x ranks_per_node gloo ranks (CPU processes) once, with ZERO_RANKS_PER_NODE set so
zero takes consecutive ranks as one node (comm/topology.py). Every rank runs each configuration
in turn on the GPT of examples/gpt.py (the same initialization and per-rank batches for every
row): the ZeRO-3 baseline, hpZ (zero_hpz_partition_size = ranks per node), MiCS at stage 3 and at
stage 2 (mics_shard_size = ranks per node). Per row, from engine.comm_stats() of the last step on
rank 0: intra-node and inter-node bytes, the same in Psi (elements / padded parameter count)
beside zero-estimate's formula (planning/estimator.py tier_comm_psi; the docs/stages.md
derivation), model-state bytes per rank (engine.model_state_bytes(), hpZ's secondary copy
included) and the median step time. Every parameter is partitioned
(stage3_param_persistence_threshold 0) and no unit stays gathered from forward to backward
(stage3_max_reuse_distance 0), so stage 3 moves the paper's 3 Psi. The qwZ / qgZ columns say
whether the row quantizes its all-gathers (zero_quantized_weights, int8) and gradient
reductions (zero_quantized_gradients, int4 all-to-alls in the node, then across nodes); their
ops count the values they stand for as elements and the bytes really sent, so their Psi
columns count values, and qgZ rows (two all-to-alls) have no formula. On one machine the
"nodes" share memory bandwidth: the step times do not show what slower links between real nodes
would cost; the byte columns do. A measurement script, not a test: nothing here asserts on time.
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    available_cores,
    build_model,
    free_port,
    init_rank,
    make_batches,
    zero_config,
)

import zero  # noqa: E402
from zero.planning.estimator import Cluster, Options, tier_comm_psi  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--ranks_per_node", type=int, default=2)
    parser.add_argument("--n_layer", type=int, default=2)
    parser.add_argument("--n_head", type=int, default=4)
    parser.add_argument("--n_embd", type=int, default=128)
    parser.add_argument("--block_size", type=int, default=64)
    parser.add_argument("--micro_batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    return parser.parse_args(argv)


def rows(args) -> list[tuple[str, int, dict]]:
    """(name, stage, zero_optimization keys) of each configuration."""
    g = args.ranks_per_node
    return [
        ("ZeRO-3", 3, {}),
        (f"hpZ k={g}", 3, {"zero_hpz_partition_size": g}),
        (f"MiCS s={g}", 3, {"mics_shard_size": g}),
        (f"MiCS s={g}", 2, {"mics_shard_size": g}),
        ("ZeRO-2", 2, {}),
        ("qwZ", 3, {"zero_quantized_weights": True}),
        ("qgZ", 3, {"zero_quantized_gradients": True}),
        ("qwZ + qgZ", 3, {"zero_quantized_weights": True, "zero_quantized_gradients": True}),
        (
            f"ZeRO++ (qwZ + qgZ + hpZ k={g})",
            3,
            {
                "zero_quantized_weights": True,
                "zero_quantized_gradients": True,
                "zero_hpz_partition_size": g,
            },
        ),
    ]


def run_row(args, stage: int, keys: dict, batches) -> dict:
    args.stage3_overrides = {
        "stage3_param_persistence_threshold": 0,
        "stage3_max_reuse_distance": 0,
    }
    cfg = zero_config(args, stage, "fp32")
    cfg["zero_optimization"].update(keys)
    engine, _, _, _ = zero.initialize(model=build_model(args), config=cfg)
    times = []
    for index, (x, y) in enumerate(batches):
        start = time.perf_counter()
        engine.backward(engine(x, y))
        engine.step()
        if index >= args.warmup:
            times.append(time.perf_counter() - start)
    layout = engine.optimizer.layout
    result = {
        "stats": engine.comm_stats(),
        "padded": layout.padded_numel,
        "psi": layout.numel,
        "state": engine.model_state_bytes(),
        "step_ms": 1e3 * statistics.median(times),
    }
    engine.close()
    return result


def formula(args, stage: int, keys: dict) -> tuple[float, float]:
    options = Options(
        reuse_numel=0,
        mics_shard_size=keys.get("mics_shard_size", -1),
        hpz_partition_size=keys.get("zero_hpz_partition_size", 1),
    )
    return tier_comm_psi(stage, Cluster(args.nodes, args.ranks_per_node), options)


def print_report(args, results) -> None:
    n = args.nodes * args.ranks_per_node
    print(
        f"machine: {available_cores()} cores, torch {torch.__version__}, {n} gloo ranks as "
        f"{args.nodes} simulated nodes x {args.ranks_per_node} (ZERO_RANKS_PER_NODE), fp32"
    )
    print(
        f"model: GPT n_layer={args.n_layer} n_head={args.n_head} n_embd={args.n_embd} "
        f"block_size={args.block_size} vocab=256, micro-batch {args.micro_batch}, "
        f"gradient accumulation 1; median of {args.steps} steps after {args.warmup} warm-up"
    )
    print()
    print(
        "| config | stage | intra bytes/step | inter bytes/step | intra Psi | inter Psi "
        "| formula intra/inter Psi | qwZ | qgZ | model-state bytes/rank | step ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for (name, stage, keys), result in zip(rows(args), results):
        stats = result["stats"]
        intra = sum(t["intra_bytes"] for t in stats.values())
        inter = sum(t["inter_bytes"] for t in stats.values())
        intra_psi = sum(t["intra_elements"] for t in stats.values()) / result["padded"]
        inter_psi = sum(t["inter_elements"] for t in stats.values()) / result["padded"]
        want = "-"
        if not keys.get("zero_quantized_gradients"):
            want = "{:.4g} / {:.4g}".format(*formula(args, stage, keys))
        qwz = "on" if keys.get("zero_quantized_weights") else "off"
        qgz = "on" if keys.get("zero_quantized_gradients") else "off"
        print(
            f"| {name} | {stage} | {intra:,} | {inter:,} | {intra_psi:.4f} | {inter_psi:.4f} "
            f"| {want} | {qwz} | {qgz} "
            f"| {sum(result['state'].values()):,} | {result['step_ms']:.1f} |"
        )
    print()
    print("Psi: the padded parameter count of each row's layout; collectives of the last step:")
    for (name, stage, _), result in zip(rows(args), results):
        ops = ", ".join(
            f"{op} {t['elements']:,} elements ({t['inter_elements']:,} inter-node)"
            for op, t in result["stats"].items()
        )
        kinds = ", ".join(f"{k} {v:,}" for k, v in result["state"].items())
        print(f"- {name} stage {stage} (Psi {result['padded']:,}): {ops}; bytes: {kinds}")


def worker(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ["ZERO_RANKS_PER_NODE"] = str(args.ranks_per_node)
    world = args.nodes * args.ranks_per_node
    init_rank(rank, world, port)
    try:
        batches = make_batches(args, rank, args.warmup + args.steps)
        results = [run_row(args, stage, keys, batches) for _, stage, keys in rows(args)]
        if rank == 0:
            print_report(args, results)
    finally:
        dist.destroy_process_group()


def main(argv=None) -> None:
    args = parse_args(argv)
    mp.spawn(worker, args=(args, free_port()), nprocs=args.nodes * args.ranks_per_node)


if __name__ == "__main__":
    main()
