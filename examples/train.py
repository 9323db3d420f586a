"""Train a byte-level GPT on real text through zero.

Single process:   python examples/train.py --config configs/zero2.json
Data parallel:    zrun --hostfile examples/hosts examples/train.py --config configs/zero2.json
Tensor parallel:  zrun ... examples/train.py --config configs/zero2.json --mp 2   (4 ranks: 2 x 2)
Checkpointing:    ... --config configs/zero2_activation_checkpointing.json

The model is in gpt.py, the data in data.py; this file is only the loop. Batch size, gradient
accumulation, optimizer, lr schedule, precision and ZeRO stage all come from the config.
Every steps_per_print steps rank 0 prints one line: the step's figures (lr, loss scale, grad
norm, samples/s, tokens/s, TFLOP/s, memory) and its loss, the mean over the whole global batch
(every rank's micro-batches). With a terminal attached a progress bar shows it too.
"""

import argparse
import os
import random
import time

import torch
import torch.distributed as dist
from data import ByteDataset, load_corpus
from gpt import GPT, GPTConfig

import zero
from zero.progress import bar_enabled, progress, redirect_logs


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Train a byte-level GPT with zero.")
    parser.add_argument("--config", required=True, help="zero config (json, hjson or yaml)")
    parser.add_argument("--data", default=None, help="text file (default: Python stdlib source)")
    parser.add_argument("--n_layer", type=int, default=4)
    parser.add_argument("--n_head", type=int, default=4)
    parser.add_argument("--n_embd", type=int, default=128)
    parser.add_argument("--block_size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps")
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--eval_batches", type=int, default=20, help="micro-batches for val loss")
    parser.add_argument(
        "--mp", type=int, default=1, help="model-parallel (tensor-parallel) size; divides ranks"
    )
    parser.add_argument(
        "--activation_checkpointing",
        action="store_true",
        help="recompute each block in backward (also on when the config has the block)",
    )
    parser.add_argument(
        "--zero_init",
        choices=("auto", "on", "off"),
        default="auto",
        help="build the model under zero.Init, partitioned as it is built (auto: with stage 3)",
    )
    parser.add_argument("--local_rank", type=int, default=-1, help="ignored (launchers pass it)")
    return parser.parse_args()


def _data_parallel_size(mp: int) -> int:
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    return max(1, world // mp)


def is_first_rank(engine) -> bool:
    """engine.rank is the data-parallel rank; with --mp the global rank decides."""
    return engine.rank == 0 and (not dist.is_initialized() or dist.get_rank() == 0)


def log(engine, *lines: str) -> None:
    """Print on rank 0 only, flushed so the lines interleave correctly under a launcher."""
    if is_first_rank(engine):
        print(*lines, sep="\n", flush=True)


@torch.no_grad()
def evaluate(engine, data: ByteDataset, num_batches: int, batch_size: int) -> float:
    """Mean loss over num_batches validation micro-batches (this rank's batches)."""
    engine.eval()
    total = 0.0
    for _ in range(num_batches):
        x, y = data.get_batch("val", batch_size, engine.device)
        total += engine(x, y).item()
    engine.train()
    return total / num_batches


def global_batch_loss(step_losses: list[torch.Tensor]) -> float:
    """The loss the optimizer step trained on: the mean over every rank's micro-batches of the
    global batch (each micro-batch's loss is a mean over the same number of tokens, and the
    step's gradient is the mean of theirs). Every rank must call it (one all-reduce); with
    --mp the model-parallel ranks hold the same loss, so the mean over all ranks is the mean
    over the data-parallel ones."""
    loss = torch.stack(step_losses).float().mean()
    if dist.is_initialized():
        dist.all_reduce(loss)
        loss /= dist.get_world_size()
    return loss.item()


def train_steps(engine, data, args, tokens_per_step: int, rank: int) -> float:
    """args.steps optimizer steps; returns the loss of the last logged step (global batch).
    Every steps_per_print steps rank 0 prints one line: the engine's step figures with the
    global batch's loss (the engine's own line, which has only rank 0's loss, is off). A bar
    (rank 0 with a terminal) shows the last printed loss and each step's tokens/s."""
    micro_batch = engine.config.train_micro_batch_size_per_gpu
    accumulation = engine.config.gradient_accumulation_steps
    print_every = engine.config.steps_per_print or args.steps
    engine.monitor.step_log = False  # this loop prints the step line
    bar = progress(total=args.steps, desc="train", rank=rank, unit="step", leave=True)
    train_loss = float("nan")
    step_start = time.perf_counter()
    for step in range(1, args.steps + 1):
        step_losses = []
        for _ in range(accumulation):
            x, y = data.get_batch("train", micro_batch, engine.device)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()  # acts only at the accumulation boundary
            step_losses.append(loss.detach())
        if step % print_every == 0 or step == args.steps:
            train_loss = global_batch_loss(step_losses)
            line = engine.monitor.format_step({**engine.monitor.last, "loss": train_loss})
            if not bar.disable:
                bar.write(line)
            else:
                log(engine, line)
        if not bar.disable:
            now = time.perf_counter()
            bar.update(1)
            bar.set_postfix_str(
                f"loss {train_loss:.4f}, {tokens_per_step / (now - step_start):,.0f} tokens/s"
            )
            step_start = now
    bar.close()
    return train_loss


def main() -> None:
    args = parse_args()
    random.seed(args.seed)
    torch.manual_seed(args.seed)  # same initial weights on every rank
    mpu = None
    if args.mp > 1:
        # Tensor-parallel layers keep slices of the same full matrices on every rank, so this
        # model starts from exactly the weights of the --mp 1 run.
        mpu = zero.mpu.initialize_model_parallel(args.mp)
        zero.checkpointing.model_parallel_manual_seed(args.seed, mpu)  # per-rank head dropout

    model_config = GPTConfig(
        block_size=args.block_size,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        dropout=args.dropout,
        activation_checkpointing=args.activation_checkpointing,
    )
    stage = zero.load_config(args.config, world_size=_data_parallel_size(args.mp)).zero.stage
    partition = args.zero_init == "on" or (args.zero_init == "auto" and stage == 3)
    with zero.Init(config=args.config, mpu=mpu, enabled=partition):
        model = GPT(model_config, mpu)
    num_params = model.num_parameters()  # before initialize: stage 3 may shard the parameters
    engine, _, _, _ = zero.initialize(args=args, model=model, config=args.config, mpu=mpu)
    engine.monitor.tokens_per_sample = args.block_size  # engine step log: tokens/s and TFLOP/s
    if "activation_checkpointing" in engine.config.model_fields_set:
        model_config.activation_checkpointing = True  # the config's block asks for it

    raw, corpus_name = load_corpus(args.data)
    data = ByteDataset(raw, args.block_size, seed=args.seed, rank=engine.rank)
    bits, nats = data.unigram_entropy()
    micro_batch = engine.config.train_micro_batch_size_per_gpu
    accumulation = engine.config.gradient_accumulation_steps
    global_batch = micro_batch * engine.world_size * accumulation
    tokens_per_step = global_batch * args.block_size

    if args.mp > 1 or model_config.activation_checkpointing:
        ckpt = engine.config.activation_checkpointing
        log(
            engine,
            f"model parallel {args.mp} x data parallel {engine.world_size}; activation "
            f"checkpointing {'on' if model_config.activation_checkpointing else 'off'}"
            f" (partitioned {ckpt.partition_activations}, cpu {ckpt.cpu_checkpointing}, "
            f"contiguous {ckpt.contiguous_memory_optimization})",
        )
    log(
        engine,
        f"world size {engine.world_size}, device {engine.device}, "
        f"compute dtype {engine.config.compute_dtype}",
        f"model: {num_params:,} parameters "
        f"({args.n_layer} layers, {args.n_head} heads, width {args.n_embd})"
        + (", built partitioned (zero.Init)" if partition else ""),
        f"corpus: {corpus_name}, {len(raw):,} bytes "
        f"(train {len(data.train):,}, val {len(data.val):,})",
        f"unigram entropy {nats:.4f} nats/byte ({bits:.4f} bits/byte): the loss to beat",
        f"batch: micro {micro_batch} x world {engine.world_size} x accumulation "
        f"{accumulation} = {global_batch} sequences ({tokens_per_step:,} tokens) per step",
    )

    engine.train()
    rank = 0 if is_first_rank(engine) else 1
    with redirect_logs(bar_enabled(rank)):
        train_loss = train_steps(engine, data, args, tokens_per_step, rank)

    val_loss = evaluate(engine, data, args.eval_batches, micro_batch)
    log(engine, f"val loss {val_loss:.4f} over {args.eval_batches} batches")
    if engine.skipped_steps:
        log(engine, f"skipped steps (fp16 overflow): {engine.skipped_steps}")
    log(
        engine,
        f"final: train_loss={train_loss:.4f} val_loss={val_loss:.4f} unigram_entropy={nats:.4f}",
    )
    if dist.is_initialized():
        zero.comm.destroy_process_group()  # a barrier first: every rank exits cleanly


if __name__ == "__main__":
    main()
