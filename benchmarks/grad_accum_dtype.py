r"""What 2-byte gradient accumulation costs: fp32 vs bf16 data_types.grad_accum_dtype, side by side.

    python benchmarks/grad_accum_dtype.py --data /work/shared/data/tinyshakespeare.txt \
        --steps 200 --gas 1 8

Trains the GPT of examples/gpt.py (bf16 compute, ZeRO stage 2, AdamW, gradient clipping 1.0)
in one process for --steps optimizer steps per run, once per (gradient accumulation steps,
accumulation dtype), with the same initialization and the same batches for both dtypes. Prints
the training loss (mean over the optimizer steps since the previous row, each the mean of its
micro-batches) every --every steps, then the final validation loss of each run. One process:
this measures the accumulation over micro-batches (and the reduction's rounding into the shard);
with N ranks, bf16 also adds one rounding per cross-rank sum. A measurement, not a test.

    python benchmarks/grad_accum_dtype.py --memory --world_size 2

instead measures engine.model_state_bytes() on `world_size` gloo ranks for stages 0-3 with fp32
and bf16 accumulation (bf16 compute; the GPT of benchmarks/zero_vs_ddp.py: n_layer 4, n_embd
256, block 128; one optimizer step on 8 tokens so Adam's state exists) beside the paper's
formula on the padded Psi, and prints a markdown table.
"""

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

from data import ByteDataset, load_corpus  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

import zero  # noqa: E402


def train(args, raw: bytes, gas: int, accum: str) -> tuple[list[float], float]:
    """(training loss per optimizer step, final validation loss) of one run."""
    torch.manual_seed(args.seed)
    shape = GPTConfig(
        block_size=args.block_size, n_layer=args.n_layer, n_head=4, n_embd=args.n_embd
    )
    model = GPT(shape)
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "bf16": {"enabled": True},
        "data_types": {"grad_accum_dtype": accum},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.1}},
        "zero_optimization": {"stage": 2},
    }
    engine, _, _, _ = zero.initialize(model=model, config=config)
    data = ByteDataset(raw, args.block_size, args.seed)
    losses = []
    for _ in range(args.steps):
        micro = []
        for _ in range(gas):
            x, y = data.get_batch("train", args.micro_batch)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            micro.append(float(loss.detach()))
        losses.append(statistics.fmean(micro))
    engine.eval()
    with torch.no_grad():
        val = [float(engine(*data.get_batch("val", args.micro_batch))) for _ in range(20)]
    return losses, statistics.fmean(val)


PAPER = {0: "16 Psi", 1: "4 Psi + 12 Psi/N", 2: "2 Psi + 14 Psi/N", 3: "16 Psi/N"}


def _memory_rank(rank: int, world_size: int, port: int, queue) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_PORT=str(port)
    )
    os.environ.update(LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1")
    torch.set_num_threads(1)
    rows = []
    for accum in ("fp32", "bf16"):
        for stage in range(4):
            torch.manual_seed(0)
            model = GPT(GPTConfig(block_size=128, n_layer=4, n_head=4, n_embd=256))
            config = {
                "train_micro_batch_size_per_gpu": 1,
                "bf16": {"enabled": True},
                "data_types": {"grad_accum_dtype": accum},
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
                "zero_optimization": {"stage": stage, "reduce_bucket_size": 400_000},
                "steps_per_print": 10**9,
            }
            engine, _, _, _ = zero.initialize(model=model, config=config)
            x = torch.randint(0, 256, (1, 8))
            engine.backward(engine(x, x))
            engine.step()
            layout = engine.optimizer.layout
            rows.append(
                (accum, stage, layout.padded_numel, layout.num_shards, engine.model_state_bytes())
            )
    if rank == 0:
        queue.put(rows)


def memory_table(world_size: int) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_memory_rank, (world_size, port, queue), nprocs=world_size)
    print(f"world size {world_size}, bf16 compute, AdamW; bytes per rank (padded Psi)\n")
    print(
        "| stage | grad_accum_dtype | Psi (padded) | params | grads | master | optimizer state "
        "| total | paper formula | formula bytes | total/formula |"
    )
    print("|---" * 11 + "|")
    for accum, stage, psi, n, parts in queue.get():
        total = sum(parts.values())
        grad_elements = psi if stage < 2 else psi // n
        paper = {0: 16 * psi, 1: 4 * psi + 12 * psi // n, 2: 2 * psi + 14 * psi // n}
        formula = paper.get(stage, 16 * psi // n) + (2 * grad_elements if accum == "fp32" else 0)
        name = PAPER[stage] + (" + 2-byte wider grads" if accum == "fp32" else "")
        cells = [parts[k] for k in ("params", "grads", "master", "optimizer_state")]
        print(
            f"| {stage} | {accum} | {psi:,} | "
            + " | ".join(f"{c:,}" for c in cells)
            + f" | {total:,} | {name} | {formula:,} | {total / formula:.4f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="text file (default: the example's stdlib corpus)")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps per run")
    parser.add_argument("--gas", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--every", type=int, default=20, help="print a row every N steps")
    parser.add_argument("--n_layer", type=int, default=2)
    parser.add_argument("--n_embd", type=int, default=64)
    parser.add_argument("--block_size", type=int, default=64)
    parser.add_argument("--micro_batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--memory", action="store_true", help="model-state bytes table instead")
    parser.add_argument("--world_size", type=int, default=2, help="ranks for --memory")
    args = parser.parse_args()
    if args.memory:
        memory_table(args.world_size)
        return
    torch.set_num_threads(1)
    raw, source = load_corpus(args.data)
    runs = {}
    for gas in args.gas:
        for accum in ("fp32", "bf16"):
            began = time.perf_counter()
            runs[(gas, accum)] = train(args, raw, gas, accum)
            print(f"# GAS {gas} {accum}: {time.perf_counter() - began:.0f} s", file=sys.stderr)
    print(
        f"GPT n_layer={args.n_layer} n_embd={args.n_embd} block={args.block_size} "
        f"micro_batch={args.micro_batch}, bf16 compute, stage 2, {args.steps} steps, {source}\n"
    )
    names = [f"GAS {g} {a}" for g, a in runs]
    print("| step | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for end in range(args.every, args.steps + 1, args.every):
        cells = [statistics.fmean(losses[end - args.every : end]) for losses, _ in runs.values()]
        print(f"| {end} | " + " | ".join(f"{c:.4f}" for c in cells) + " |")
    print("| final val | " + " | ".join(f"{v:.4f}" for _, v in runs.values()) + " |")


if __name__ == "__main__":
    main()
