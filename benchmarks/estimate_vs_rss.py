r"""zero-estimate's predicted peak memory against the measured peak RSS of CPU ranks.

    python benchmarks/estimate_vs_rss.py --sizes 128x4,256x4,384x6 --stages 0,1,2,3 --steps 3

For every model size (n_embd x n_layer of the GPT of examples/gpt.py, block_size 128, vocab 256,
4 heads) and ZeRO stage, the main job's config (configs/zero{stage}.json: fp32, micro-batch 16)
and model construction (stage 3 under zero.Init, as examples/train.py does) trains --steps
optimizer steps on random byte tokens in a fresh group of --world_size gloo ranks
(torch.multiprocessing, _common.init_rank: one intra-op thread per rank on 2 cores).

Measured, per rank: the peak resident set (VmHWM, reset through /proc/self/clear_refs just before
the first step) minus the resident set of the same process after importing torch (with
torch._dynamo, which the first optimizer step imports anyway), zero's engine and the model code,
and initializing the process group: what model construction, zero.initialize and training added
(code excluded). The table shows the largest rank; rank 0 also reports the model-state bytes of
engine.memory_report() to check that term alone.

Predicted: zero.estimator for the same config and model (built on the meta device, so layout and
stage-3 units are exact), the activation shape of the micro-batch and cpu=True (gloo's collective
copies, glibc's heap retention: engine/planning/footprint.py [Note: CPU ranks]), plus the runtime:
the peak RSS of a calibration run (a 1-layer, 32-wide GPT, micro-batch 1, whose tensors take well
under 1 MiB) minus its own prediction, measured first in the same way. The runtime is the only
measured input; everything else comes from the formulas.

Linux only (/proc). A measurement script, not a test.
"""

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import hjson
import torch
import torch._dynamo  # noqa: F401  (imported by the first optimizer step; code, not data)
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import free_port, init_rank, status_bytes  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

import zero  # noqa: E402
import zero.api  # noqa: E402, F401  (pydantic and the engine: code, imported before the baseline)
from zero import estimator  # noqa: E402
from zero.footprint import TransformerShape  # noqa: E402

VOCAB = 256
MIB = 2**20


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="128x4,256x4,384x6", help="n_embd x n_layer, ...")
    parser.add_argument("--stages", default="0,1,2,3")
    parser.add_argument("--n_head", type=int, default=4)
    parser.add_argument("--block_size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per run")
    parser.add_argument("--world_size", type=int, default=2)
    parser.add_argument(
        "--checkpointing", action="store_true", help="also run every size with checkpointing"
    )
    return parser.parse_args(argv)


def reset_peak() -> None:
    """Start VmHWM again from the current resident set (Linux: clear_refs 5)."""
    Path("/proc/self/clear_refs").write_text("5")


@dataclass(frozen=True)
class Run:
    """One measured configuration: GPT width x depth, ZeRO stage, checkpointing, micro-batch
    (None: the config file's)."""

    n_embd: int
    n_layer: int
    stage: int
    checkpointing: bool = False
    micro_batch: int | None = None


CALIBRATION = Run(32, 1, 0, False, 1)  # tensors of well under 1 MiB: the rest is runtime


def config_for(run: Run) -> dict:
    config = hjson.loads((ROOT / "configs" / f"zero{run.stage}.json").read_text())
    config["steps_per_print"] = 10**9
    if run.micro_batch is not None:
        config["train_micro_batch_size_per_gpu"] = run.micro_batch
    return config


def gpt_config(args, run: Run) -> GPTConfig:
    return GPTConfig(
        vocab_size=VOCAB,
        block_size=args.block_size,
        n_layer=run.n_layer,
        n_head=args.n_head,
        n_embd=run.n_embd,
        activation_checkpointing=run.checkpointing,
    )


def worker(rank: int, args, run: Run, port: int, results) -> None:
    init_rank(rank, args.world_size, port)
    try:
        baseline = status_bytes("VmRSS")
        torch.manual_seed(0)
        config = config_for(run)
        with zero.Init(config=config, enabled=run.stage == 3):  # as examples/train.py builds it
            model = GPT(gpt_config(args, run))
        engine, _, _, _ = zero.initialize(model=model, config=config)
        batch = engine.config.train_micro_batch_size_per_gpu
        g = torch.Generator().manual_seed(rank)
        reset_peak()
        for _ in range(args.steps * engine.config.gradient_accumulation_steps):
            tokens = torch.randint(0, VOCAB, (batch, args.block_size + 1), generator=g)
            loss = engine(tokens[:, :-1], tokens[:, 1:])
            engine.backward(loss)
            engine.step()
        peak = status_bytes("VmHWM") - baseline
        results.put((rank, peak, sum(engine.memory_report()["measured"].values())))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def measure(args, run: Run) -> tuple[int, int]:
    """(largest peak RSS over the ranks, rank 0's model-state bytes) of one fresh group."""
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(worker, args=(args, run, free_port(), results), nprocs=args.world_size, join=True)
    figures = {}
    for _ in range(args.world_size):
        rank, peak, states = results.get()
        figures[rank] = (peak, states)
    return max(peak for peak, _ in figures.values()), figures[0][1]


def predict(args, run: Run, runtime: int) -> estimator.Estimate:
    """zero.estimator's row for the run's stage (exact layout from the meta-device model)."""
    config = zero.load_config(config_for(run), world_size=args.world_size)
    options = estimator.Options.from_config(
        config, cpu=True, checkpointing=run.checkpointing, runtime_bytes=runtime
    )
    with torch.device("meta"):
        model = GPT(gpt_config(args, run))
    micro_batch = config.train_micro_batch_size_per_gpu
    shape = TransformerShape(
        run.n_layer, run.n_embd, args.block_size, micro_batch, VOCAB, args.n_head
    )
    cluster = estimator.Cluster(nodes=1, devices_per_node=args.world_size)
    rows = estimator.estimate(model.num_parameters(), cluster, options, model, shape)
    return next(r for r in rows if r.stage == run.stage and not r.offload)


def main(argv=None) -> None:
    args = parse_args(argv)
    sizes = [tuple(map(int, s.split("x"))) for s in args.sizes.split(",")]
    stages = [int(s) for s in args.stages.split(",")]
    modes = (False, True) if args.checkpointing else (False,)
    runs = [Run(h, n, s, c) for c in modes for h, n in sizes for s in stages]
    calibration, _ = measure(args, CALIBRATION)
    runtime = calibration - predict(args, CALIBRATION, 0).per_device
    print(
        f"GPT block_size {args.block_size}, vocab {VOCAB}, {args.n_head} heads; "
        f"configs/zero{{stage}}.json (fp32, micro-batch 16); {args.world_size} gloo ranks, "
        f"{args.steps} steps; runtime {runtime / MIB:.1f} MiB (calibration: GPT 32x1, "
        f"micro-batch 1, measured {calibration / MIB:.1f} MiB)"
    )
    print(
        "| size | stage | ckpt | Psi | model states MiB (measured / predicted) | buffers MiB "
        "| activations MiB | glibc retention MiB | predicted peak MiB | measured peak RSS MiB "
        "| measured / predicted |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for run in runs:
        row = predict(args, run, runtime)
        peak, states = measure(args, run)
        psi = GPT(gpt_config(args, run)).num_parameters()
        print(
            f"| {run.n_embd}x{run.n_layer} | {run.stage} | {'yes' if run.checkpointing else 'no'} "
            f"| {psi:,} | {states / MIB:.1f} / {row.model_states / MIB:.1f} "
            f"| {row.buffers / MIB:.1f} | {row.activations / MIB:.1f} "
            f"| {row.peak.allocator / MIB:.1f} | {row.per_device / MIB:.1f} | {peak / MIB:.1f} "
            f"| {peak / row.per_device:.3f} |",
            flush=True,
        )


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
