r"""zero stages 0-3 beside torch DDP, FSDP2 and DeepSpeed stages 0-3, round by round.

    python benchmarks/side_by_side.py --rounds 5 --steps_per_round 2 --json side_by_side.json
    python benchmarks/side_by_side.py --device cuda --dtype bf16     # GPUs: nccl, bf16
    python benchmarks/side_by_side.py --compile                      # and compiled twins

Spawns --world_size ranks once (gloo and --threads intra-op threads per rank on the CPU, nccl on
cuda:rank on GPUs). Every rank builds every selected system from the same seed on the same GPT
(examples/gpt.py; default n_layer 6, n_embd 384, block 128, micro-batch 4: 10.8M parameters),
feeds each the same per-rank random byte batches and trains with AdamW (lr 1e-4, the weight
decay zero resolves, 0.0), gradient clipping 1.0, gradient_accumulation_steps 1:

- zero0..zero3: zero.initialize, overlap_comm true, zero's defaults otherwise;
- ddp: DistributedDataParallel, bucket_cap_mb = zero's reduce bucket in fp32 bytes;
- fsdp2: fully_shard per transformer block, then the root;
- ds0..ds3: deepspeed.initialize with the same config dict as zero (DS_ACCELERATOR=cpu on the
  CPU); skipped, with the reason printed, when deepspeed cannot be imported or initialized;
- local (only when named in --systems): each rank trains alone, no communication: the floor;
- <system>_compiled (--compile adds the twin of every selected system but local; or name them
  in --systems), torch.compile with --compile_backend (default inductor): zero<s>_compiled
  and ds<s>_compiled call engine.compile() (zero: the whole forward at stages 0-2, each block's
  forward at stage 3, engine/compiler.py); ddp_compiled is torch.compile(DDP(model)) (Dynamo's
  DDPOptimizer splits the graph at bucket boundaries); fsdp2_compiled compiles each sharded
  block's forward, FSDP2's hooks staying outside, as torchtitan does.

Compiling happens in a system's first step: "first step ms" holds it (the compile time is the
first step less the median step), timed apart from the rounds, whose steps run compiled graphs.

bf16 (--dtype bf16): zero and DeepSpeed get the config's bf16 block; DDP runs torch.autocast,
FSDP2 MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32). All systems stay alive; after
--warmup untimed steps each, the systems take turns round by round (each runs
--steps_per_round steps, the order rotated by one every round), every step clocked between
barriers (a step ends when the slowest rank ends it; on CUDA after a device synchronize).

Rank 0 prints the median step time per system; the ratios zero stage s / DDP (target <= 1.00,
stages 0-2), zero stage s / DeepSpeed stage s (<= 0.80) and zero 3 / FSDP2 (<= 0.85), each
PASS or MISS; every system's largest loss difference to DDP over all steps and ranks (the
sanity check: same model, same data; zero's must be within --loss_tol); and per zero stage the
communication elements / Psi and model-state bytes per rank beside the paper's formula (see
_common.formula). --json writes the same as JSON. A measurement, not a test of time.
"""

import argparse
import json
import logging
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    CLIP,
    LR,
    available_cores,
    build_ddp,
    build_fsdp2,
    build_model,
    formula,
    free_port,
    init_rank,
    make_batches,
    paper_comm,
    timed_step,
    torch_adamw,
    torch_step,
    zero_config,
)

import zero  # noqa: E402
from zero.config import ZeroConfig  # noqa: E402
from zero.optim import resolve_optimizer  # noqa: E402

SYSTEMS = ("zero0", "zero1", "zero2", "zero3", "ddp", "fsdp2", "ds0", "ds1", "ds2", "ds3")
COMPILED = "_compiled"  # suffix of a system's torch.compile twin (--compile)
# Not in the default set: each rank trains its own copy with no communication at all (torch's
# AdamW loop on its micro-batch), the compute floor no engine's step can go below.
FLOOR = "local"
# (numerator, denominator, target): the numerator's median step time over the denominator's.
TARGETS = (
    [(f"zero{s}", "ddp", 1.00) for s in range(3)]
    + [(f"zero{s}", f"ds{s}", 0.80) for s in range(4)]
    + [("zero3", "fsdp2", 0.85)]
)
TARGETS += [(num + COMPILED, den + COMPILED, target) for num, den, target in TARGETS]
LOSS_TOL = {"fp32": 1e-4, "bf16": 5e-2}


class Backend:
    """--compile_backend, one instance per compiled system: Dynamo caches a graph per backend
    object, so each system compiles its own graphs in its first step (otherwise the first
    system to compile GPT.forward would pay for every later one, whose first step would show no
    compile time). Several systems compile the same code, more versions than Dynamo's default
    recompile_limit (8) keeps: main() raises it."""

    def __init__(self, name: str, system: str):
        self.name, self.__name__ = name, f"{name} ({system})"

    def __call__(self, graph, example_inputs, **kwargs):
        return torch._dynamo.lookup_backend(self.name)(graph, example_inputs, **kwargs)


@dataclass
class System:
    """One contestant: its step (x, y) -> detached loss, and what it recorded."""

    name: str
    step: object
    engine: object = None  # the zero engine, for the paper's figures
    losses: list = field(default_factory=list)
    seconds: list = field(default_factory=list)  # timed steps only
    cpu_seconds: list = field(default_factory=list)  # this process's CPU time (all threads)
    first_seconds: float | None = None  # the first step (compiled systems: compiling in it)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n_layer", type=int, default=6)
    parser.add_argument("--n_head", type=int, default=4)
    parser.add_argument("--n_embd", type=int, default=384)
    parser.add_argument("--block_size", type=int, default=128)
    parser.add_argument("--micro_batch", type=int, default=4)
    parser.add_argument("--world_size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps_per_round", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per system first")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per CPU rank")
    parser.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help=f"comma-separated subset of {','.join(SYSTEMS)}, or {FLOOR} (no communication)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help=f"add the torch.compile twin (<name>{COMPILED}) of every selected system but {FLOOR}",
    )
    parser.add_argument(
        "--compile_backend", default="inductor", help="torch.compile backend of compiled systems"
    )
    parser.add_argument(
        "--reduce_bucket_size",
        type=int,
        default=None,
        help="elements per gradient bucket for zero, DeepSpeed and DDP (default: zero's)",
    )
    parser.add_argument(
        "--loss_tol",
        type=float,
        default=None,
        help="largest allowed |loss - DDP loss| of a zero stage (default 1e-4 fp32, 5e-2 bf16)",
    )
    parser.add_argument("--json", default=None, help="write the results to this file")
    args = parser.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(args.systems) - set(SYSTEMS) - {s + COMPILED for s in SYSTEMS} - {FLOOR})
    if unknown:
        parser.error(
            f"--systems: unknown {unknown}; choose from {','.join(SYSTEMS)} (each also as "
            f"<name>{COMPILED}) or {FLOOR}"
        )
    if args.compile:
        twins = [s + COMPILED for s in args.systems if s in SYSTEMS]
        args.systems += [t for t in twins if t not in args.systems]
    if args.loss_tol is None:
        args.loss_tol = LOSS_TOL[args.dtype]
    if args.reduce_bucket_size is None:
        args.reduce_bucket_size = ZeroConfig.model_fields["reduce_bucket_size"].default
    return args


# ----- building the systems ---------------------------------------------------------------------
def build_zero(
    args, stage: int, params: dict, offload: bool = False, compiled: bool = False
) -> System:
    """offload: optimizer state and step on the host (offload_optimizer cpu; stages 1-3);
    compiled: engine.compile(backend=args.compile_backend)."""
    config = zero_config(args, stage, args.dtype, params)
    if offload:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    # largest_model.py builds stage 3 partitioned (zero.Init): the full model never exists.
    with zero.Init(config=config, enabled=stage == 3 and getattr(args, "partitioned_init", False)):
        model = build_model(args)
    engine, _, _, _ = zero.initialize(model=model, config=config)
    if compiled:
        engine.compile(backend=Backend(args.compile_backend, f"zero{stage}"))

    def step(x, y):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss.detach()

    name = f"zero{stage}" + ("_offload" if offload else "") + (COMPILED if compiled else "")
    return System(name, step, engine)


def build_deepspeed(args, stage: int, params: dict, compiled: bool = False) -> System:
    """deepspeed.initialize on the config dict zero gets; DS_ACCELERATOR is set by main().
    compiled: DeepSpeed's engine.compile(backend=args.compile_backend)."""
    import deepspeed
    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)
    config = zero_config(args, stage, args.dtype, params)
    partitioned = stage == 3 and getattr(args, "partitioned_init", False)
    with deepspeed.zero.Init(config_dict_or_path=config, enabled=partitioned):
        model = build_model(args)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    if compiled:
        engine.compile(backend=Backend(args.compile_backend, f"ds{stage}"))

    def step(x, y):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss.detach()

    return System(f"ds{stage}" + (COMPILED if compiled else ""), step)


def build_ddp_compiled(args, params: dict, bucket_cap_mb: float, device) -> System:
    """torch.compile(DDP(model)): Dynamo's DDPOptimizer compiles one graph per gradient bucket
    so DDP's all-reduces still overlap backward; AdamW and clipping as for ddp."""
    from torch.nn.parallel import DistributedDataParallel

    model = build_model(args).to(device)
    ids = [device.index] if device.type == "cuda" else None
    ddp = DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=bucket_cap_mb)
    compiled = torch.compile(ddp, backend=Backend(args.compile_backend, "ddp"))

    def forward(x, y):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bf16"):
            return compiled(x, y)

    optimizer = torch_adamw(ddp.parameters(), params)
    return System("ddp" + COMPILED, torch_step(forward, ddp, optimizer))


def build_fsdp2_compiled(args, params: dict, device) -> System:
    """FSDP2 as fsdp2 (fully_shard per block, then the root), each block's forward compiled
    after sharding: FSDP2's all-gather / reshard hooks run eagerly around the compiled block."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = build_model(args).to(device)
    policy = MixedPrecisionPolicy()
    if args.dtype == "bf16":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
        backend = Backend(args.compile_backend, "fsdp2")
        block.forward = torch.compile(block.forward, backend=backend)
    fully_shard(model, mp_policy=policy)
    optimizer = torch_adamw(model.parameters(), params)
    return System("fsdp2" + COMPILED, torch_step(model, model, optimizer))


def build_one(args, name: str, params: dict, device) -> System:
    """The system called `name` (SYSTEMS, zero<s>_offload, or either + COMPILED) on `device`."""
    compiled = name.endswith(COMPILED)
    base = name.removesuffix(COMPILED)
    if base.startswith("zero"):
        offload = base.endswith("_offload")
        return build_zero(args, int(base[4]), params, offload=offload, compiled=compiled)
    if base.startswith("ds"):
        return build_deepspeed(args, int(base[-1]), params, compiled)
    if base == FLOOR:
        model = build_model(args).to(device)
        return System(name, torch_step(model, model, torch_adamw(model.parameters(), params)))
    if base == "ddp":
        bucket_cap_mb = args.reduce_bucket_size * 4 / 2**20  # fp32 gradients in both dtypes
        if compiled:
            return build_ddp_compiled(args, params, bucket_cap_mb, device)
        return System(name, build_ddp(args, args.dtype, params, bucket_cap_mb, device))
    if compiled:
        return build_fsdp2_compiled(args, params, device)
    return System(name, build_fsdp2(args, args.dtype, params, device)[0])


def build_systems(args, device) -> tuple[dict[str, System], dict[str, str]]:
    """Every requested system (fsdp2 and ds* skipped with the reason if they fail to build)."""
    _, params = resolve_optimizer("AdamW", {"lr": LR})  # {"lr", "weight_decay"} as zero has it
    systems, skipped = {}, {}
    for name in args.systems:
        try:
            systems[name] = build_one(args, name, params, device)
        except Exception as exc:
            if name.startswith("zero") or name == "ddp":
                raise
            skipped[name] = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    return systems, skipped


# ----- running ----------------------------------------------------------------------------------
def run_rounds(args, systems: dict[str, System], batches, device) -> None:
    """Warm-up steps, then --rounds rounds of --steps_per_round steps per system; the order is
    rotated by one each round so no system always follows the same one."""
    for system in systems.values():
        for x, y in batches[: args.warmup]:
            seconds, loss = timed_step(system.step, x, y, device)
            system.losses.append(loss)
            if system.first_seconds is None:
                system.first_seconds = seconds
    names = list(systems)
    for r in range(args.rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            system = systems[name]
            for _ in range(args.steps_per_round):
                x, y = batches[len(system.losses)]
                cpu = time.process_time()
                seconds, loss = timed_step(system.step, x, y, device)
                if system.first_seconds is None:  # no warm-up: compiling is in this one
                    system.first_seconds = seconds
                system.cpu_seconds.append(time.process_time() - cpu)
                system.seconds.append(seconds)
                system.losses.append(loss)


def loss_parity(args, systems: dict[str, System], device) -> dict:
    """Largest |loss - DDP's loss| over all steps and ranks per system (a collective), and the
    mean over ranks of each system's last loss."""
    names = list(systems)
    losses = torch.tensor(
        [[float(v) for v in systems[n].losses] for n in names], dtype=torch.float64, device=device
    )
    last = losses[:, -1].clone()
    dist.all_reduce(last)
    last /= dist.get_world_size()
    out = {n: {"last_loss": float(last[i])} for i, n in enumerate(names)}
    if "ddp" not in systems:
        return out
    diff = (losses - losses[names.index("ddp")]).abs().amax(dim=1)
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    for i, n in enumerate(names):
        if n not in ("ddp", FLOOR):  # the floor trains on its own micro-batch: other losses
            out[n].update(max_abs_diff_vs_ddp=float(diff[i]), tol=args.loss_tol)
            out[n]["pass"] = bool(diff[i] <= args.loss_tol)
    return out


def paper_figures(args, systems: dict[str, System]) -> dict:
    """Per zero stage: communication elements of the last step / Psi and model-state bytes per
    rank beside the paper's formula (_common.formula, _common.paper_comm)."""
    psi = sum(p.numel() for p in build_model(args).parameters() if p.requires_grad)
    out = {}
    for name, system in systems.items():
        if system.engine is None:
            continue
        stage = int(name[4])
        comm = system.engine.comm_stats()
        state = system.engine.model_state_bytes()
        per_psi, formula_name = formula(stage, args.dtype, args.world_size)
        out[name] = {
            "stage": stage,
            "psi": psi,
            "comm_elements_per_psi": sum(op["elements"] for op in comm.values()) / psi,
            "paper_comm_per_psi": paper_comm(stage),
            # stage 3: backward all-gathers of units kept gathered since their forward, not made
            "kept_per_psi": system.engine.comm.ledger.last_kept / psi,
            "comm": {op: t["elements"] for op, t in comm.items()},
            "model_state_bytes": sum(state.values()),
            "model_state_by_kind": state,
            "formula_bytes": per_psi * psi,
            "formula": formula_name,
        }
    return out


def ratios(medians: dict[str, float], cpu: dict[str, float]) -> list[dict]:
    """The targets' ratios of median step times (what the targets are about), with the ratio
    of median CPU time per step beside them (rank 0's process, all its threads: the work a
    step costs, which other jobs on a shared machine disturb far less than the wall clock)."""
    out = []
    for num, den, target in TARGETS:
        if num in medians and den in medians:
            value = medians[num] / medians[den]
            out.append({"ratio": f"{num}/{den}", "value": value, "target": target})
            out[-1]["pass"] = value <= target
            out[-1]["cpu"] = cpu[num] / cpu[den]
    return out


# ----- report -----------------------------------------------------------------------------------
def print_report(result: dict) -> None:
    a = result["args"]
    print(
        f"machine: {result['machine']}; load average {result['load_before']} before, "
        f"{result['load_after']} after"
    )
    print(
        f"model: GPT n_layer={a['n_layer']} n_head={a['n_head']} n_embd={a['n_embd']} "
        f"block_size={a['block_size']} vocab=256 ({result['psi']:,} parameters), micro-batch "
        f"{a['micro_batch']}, {a['dtype']}, AdamW lr {LR}, clip {CLIP}; {a['warmup']} warm-up "
        f"steps, {a['rounds']} rounds x {a['steps_per_round']} steps per system; "
        f"reduce bucket {a['reduce_bucket_size']:,} elements"
    )
    for name, reason in result["skipped"].items():
        print(f"skipped {name}: {reason}")
    print(
        "\n| system | median step ms | min | max | CPU ms per step | first step ms | last loss "
        "| max abs loss diff vs DDP |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, s in result["systems"].items():
        parity = result["loss"].get(name, {})
        diff = parity.get("max_abs_diff_vs_ddp")
        check = "" if diff is None else f"{diff:.2e} ({'PASS' if parity['pass'] else 'MISS'})"
        print(
            f"| {name} | {s['median_ms']:.1f} | {min(s['step_ms']):.1f} | {max(s['step_ms']):.1f} "
            f"| {s['cpu_ms']:.1f} | {s['first_ms']:.0f} "
            f"| {parity.get('last_loss', float('nan')):.6f} | {check} |"
        )
    print_compiled(result)
    print("\n| ratio | median step time ratio | target | result | CPU time ratio |")
    print("|---|---|---|---|---|")
    for r in result["ratios"]:
        verdict = "PASS" if r["pass"] else "MISS"
        print(
            f"| {r['ratio']} | {r['value']:.3f} | <= {r['target']:.2f} | {verdict} "
            f"| {r['cpu']:.3f} |"
        )
    if result["paper"]:
        print(
            "\n| zero stage | comm elements/Psi | kept for backward/Psi | paper "
            "| model-state bytes/rank | formula bytes | formula | measured/formula |"
        )
        print("|---|---|---|---|---|---|---|---|")
    for name, p in result["paper"].items():
        print(
            f"| {name.removeprefix('zero')} | {p['comm_elements_per_psi']:.6f} "
            f"| {p['kept_per_psi']:.6f} "
            f"| {p['paper_comm_per_psi']} "
            f"| {p['model_state_bytes']:,} | {p['formula_bytes']:,.0f} | {p['formula']} "
            f"| {p['model_state_bytes'] / p['formula_bytes']:.4f} |"
        )


def compiled_table(systems: dict) -> dict:
    """Per compiled system: compile seconds (its first step less its median step), its median
    step beside its eager twin's (when that ran) and their ratio."""
    out = {}
    for name, s in systems.items():
        if not name.endswith(COMPILED):
            continue
        eager = systems.get(name.removesuffix(COMPILED))
        row = {"compile_s": (s["first_ms"] - s["median_ms"]) / 1000.0, "median_ms": s["median_ms"]}
        if eager is not None:
            row.update(
                eager_median_ms=eager["median_ms"], ratio=s["median_ms"] / eager["median_ms"]
            )
        out[name] = row
    return out


def print_compiled(result: dict) -> None:
    if not result["compiled"]:
        return
    print(
        f"\n| compiled system ({result['args']['compile_backend']}) | compile s (first step - "
        "median) | median step ms | eager median step ms | compiled / eager |"
    )
    print("|---|---|---|---|---|")
    for name, row in result["compiled"].items():
        eager = row.get("eager_median_ms")
        tail = f"{eager:.1f} | {row['ratio']:.3f}" if eager is not None else "- | -"
        print(f"| {name} | {row['compile_s']:.1f} | {row['median_ms']:.1f} | {tail} |")


# ----- per rank ---------------------------------------------------------------------------------
def worker(rank: int, args: argparse.Namespace, port: int) -> None:
    device = init_rank(rank, args.world_size, port, args.device, args.threads)
    torch._dynamo.config.recompile_limit = 64  # see Backend
    try:
        load_before = os.getloadavg()
        systems, skipped = build_systems(args, device)
        count = args.warmup + args.rounds * args.steps_per_round
        run_rounds(args, systems, make_batches(args, rank, count, device), device)
        medians = {n: 1000.0 * statistics.median(s.seconds) for n, s in systems.items()}
        cpu = {n: 1000.0 * statistics.median(s.cpu_seconds) for n, s in systems.items()}
        result = {
            "args": vars(args),
            "machine": machine(args),
            "load_before": [round(v, 2) for v in load_before],
            "load_after": [round(v, 2) for v in os.getloadavg()],
            "psi": sum(p.numel() for p in build_model(args).parameters()),
            "skipped": skipped,
            "systems": {
                n: {
                    "median_ms": medians[n],
                    "cpu_ms": cpu[n],
                    "first_ms": 1000.0 * s.first_seconds,
                    "step_ms": [1000.0 * t for t in s.seconds],
                }
                for n, s in systems.items()
            },
            "ratios": ratios(medians, cpu),
            "loss": loss_parity(args, systems, device),
            "paper": paper_figures(args, systems),
        }
        result["compiled"] = compiled_table(result["systems"])
        if rank == 0:
            print_report(result)
            if args.json:
                Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def machine(args) -> str:
    if args.device == "cuda":
        where = f"{torch.cuda.get_device_name()} x {args.world_size} (nccl)"
    else:
        where = f"{available_cores()} cores, {args.threads} intra-op thread(s) per rank (gloo)"
    return f"{where}, torch {torch.__version__}, world size {args.world_size}"


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.device == "cpu":
        # zero picks cuda:LOCAL_RANK whenever CUDA is visible; DeepSpeed needs its CPU backend.
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    elif torch.cuda.device_count() < args.world_size:
        raise ValueError(
            f"--device cuda --world_size {args.world_size}: only {torch.cuda.device_count()} "
            "GPU(s) visible; lower --world_size"
        )
    start = time.perf_counter()
    mp.spawn(worker, args=(args, free_port()), nprocs=args.world_size, join=True)
    print(f"\nwall time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
