"""Helpers the side-by-side benchmarks share: spawned ranks, the GPT workload, the torch
contestants (DDP, FSDP2) and the paper's model-state formulas.

Not a benchmark itself. The scripts put benchmarks/ on sys.path and `from _common import ...`.
Everything here is device-aware: a rank runs on the CPU with gloo, or on cuda:LOCAL_RANK with
nccl (`init_rank(..., device="cuda")`), and the contestants follow the rank's device.
"""

import inspect
import multiprocessing
import os
import queue
import re
import resource
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

from gpt import GPT, GPTConfig  # noqa: E402

LR = 1e-4
CLIP = 1.0


# ----- ranks ------------------------------------------------------------------------------------
def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def evict(path: str) -> None:
    """Drop the (clean, fsync'ed) page-cache pages of every file under path; no root needed."""
    files = [path] if os.path.isfile(path) else [str(f) for f in Path(path).rglob("*")]
    for file in files:
        if os.path.isfile(file):
            fd = os.open(file, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def status_bytes(key: str) -> int:
    """A size field of /proc/self/status (VmData, VmRSS, VmHWM, ...) in bytes."""
    status = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{key}:\s+(\d+) kB", status, re.M).group(1)) * 1024


def run_spawned(target, world_size: int, spec, timeout: float, stack_bytes: int = 0, join_s=10):
    """Start `world_size` fresh processes target(rank, world_size, port, spec, results) and
    collect what each puts on `results`: (rank, kind, info), kind "started" (ignored), "ok" or
    a failure kind. Returns (outcome, {rank: info of "ok"}): outcome is None when every rank
    said "ok", else (kind, message) for the first failure, a rank that exited without a result
    ("crash") or no result within `timeout` seconds ("timeout"). The ranks start with
    RLIMIT_STACK `stack_bytes` (0: inherited): glibc sizes every thread's stack from it, and a
    stack is private writable memory that a cap on it would count. Afterwards each rank gets
    `join_s` seconds to end (0.5 after a failure) before it is killed."""
    ctx = multiprocessing.get_context("spawn")
    results, port = ctx.Queue(), free_port()
    procs = [
        ctx.Process(target=target, args=(r, world_size, port, spec, results))
        for r in range(world_size)
    ]
    stack = resource.getrlimit(resource.RLIMIT_STACK)
    if stack_bytes:
        resource.setrlimit(resource.RLIMIT_STACK, (stack_bytes, stack[1]))
    try:
        for p in procs:
            p.start()
    finally:
        resource.setrlimit(resource.RLIMIT_STACK, stack)
    outcome, seen, deadline = None, {}, time.monotonic() + timeout
    while outcome is None and len(seen) < world_size:
        try:
            rank, kind, info = results.get(timeout=1.0)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in seen]
            if dead:
                outcome = ("crash", f"rank {dead[0]} exited with code {procs[dead[0]].exitcode}")
            elif time.monotonic() > deadline:
                outcome = ("timeout", f"no result within {timeout} s")
            continue
        if kind == "started":
            continue
        seen[rank] = info
        if kind != "ok":
            outcome = (kind, f"rank {rank}: {info}")
    for p in procs:
        p.join(timeout=join_s if outcome is None else 0.5)
        if p.is_alive():
            p.kill()
            p.join()
    return outcome, seen


def init_rank(
    rank: int, world_size: int, port: int, device: str = "cpu", threads: int | None = None
) -> torch.device:
    """A spawned benchmark rank: torchrun's variables, then the process group.

    CPU: gloo and `threads` intra-op threads (default an equal share of the cores). CUDA: nccl
    on cuda:rank (one rank per visible GPU). Returns the rank's torch.device.
    """
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    if device == "cuda":
        torch.cuda.set_device(rank)
        where = torch.device("cuda", rank)
        dist.init_process_group("nccl", rank=rank, world_size=world_size, device_id=where)
        return where
    torch.set_num_threads(threads or max(1, available_cores() // world_size))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    return torch.device("cpu")


def synchronize(device: torch.device) -> None:
    """Wait for queued device work, so a clock read after it sees the step's end."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def native_bf16() -> bool:
    """True when bf16 matmul runs natively (a GPU, or a CPU with avx512_bf16 / amx_bf16)."""
    if torch.cuda.is_available():
        return True
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


# ----- workload ---------------------------------------------------------------------------------
def build_model(args) -> GPT:
    """The same initialization on every rank and for every contestant (fp32, on the CPU)."""
    torch.manual_seed(0)
    return GPT(
        GPTConfig(
            n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size
        )
    )


def make_batches(args, rank: int, count: int, device=None) -> list[tuple[torch.Tensor, ...]]:
    """Random byte tokens, different per rank, identical across contestants."""
    g = torch.Generator().manual_seed(1000 + rank)
    batches = []
    for _ in range(count):
        tokens = torch.randint(0, 256, (args.micro_batch, args.block_size + 1), generator=g)
        x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        batches.append((x.to(device), y.to(device)) if device is not None else (x, y))
    return batches


def zero_config(args, stage: int, dtype: str, optimizer_params: dict | None = None) -> dict:
    """The zero (and DeepSpeed) config of one contestant. Bucket sizes come from
    args.reduce_bucket_size / args.allgather_bucket_size where those exist and are not None
    (elements), else the engine's defaults apply; stage 3 adds args.stage3_overrides (a dict of
    zero_optimization keys) where it exists."""
    zc = {"stage": stage, "overlap_comm": True}
    for key in ("reduce_bucket_size", "allgather_bucket_size"):
        if getattr(args, key, None) is not None:
            zc[key] = getattr(args, key)
    if stage == 3:
        zc.update(getattr(args, "stage3_overrides", None) or {})
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": CLIP,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": optimizer_params or {"lr": LR}},
        "bf16": {"enabled": dtype == "bf16"},
        "zero_optimization": zc,
    }


def time_interleaved(step_fns: dict, batches, warmup: int, device=None) -> dict[str, float]:
    """Median milliseconds per step of each step_fn over batches[warmup:].

    The contestants take turns, one step each per batch, so slow drift of a shared machine hits
    all of them alike. A barrier precedes every clock read: a step ends when the slowest rank
    has finished it.
    """
    times = {name: [] for name in step_fns}
    for i, (x, y) in enumerate(batches):
        for name, step_fn in step_fns.items():
            seconds = timed_step(step_fn, x, y, device or torch.device("cpu"))[0]
            if i >= warmup:
                times[name].append(seconds)
    return {name: 1000.0 * statistics.median(t) for name, t in times.items()}


def timed_step(step_fn, x, y, device: torch.device):
    """(seconds, step_fn's return) of one step, between barriers on every rank."""
    synchronize(device)
    dist.barrier()
    start = time.perf_counter()
    out = step_fn(x, y)
    synchronize(device)
    dist.barrier()
    return time.perf_counter() - start, out


# ----- torch contestants ------------------------------------------------------------------------
def torch_adamw(params, hyper: dict) -> torch.optim.AdamW:
    """torch.optim.AdamW with the hyper-parameters zero resolved (its param_groups[0], or
    zero.optim.resolve_optimizer's kwargs), dropping keys AdamW does not take."""
    accepted = inspect.signature(torch.optim.AdamW).parameters
    return torch.optim.AdamW(
        params, **{k: v for k, v in hyper.items() if k in accepted and k != "params"}
    )


def build_ddp(args, dtype: str, hyper: dict, bucket_cap_mb: float, device=None):
    """DDP + torch.optim.AdamW + clip_grad_norm_(CLIP); returns step(x, y) -> loss. bf16 is
    torch's mixed precision: fp32 parameters and optimizer, bf16 autocast in forward."""
    from torch.nn.parallel import DistributedDataParallel

    device = device or torch.device("cpu")
    model = build_model(args).to(device)
    ids = [device.index] if device.type == "cuda" else None
    ddp = DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=bucket_cap_mb)
    optimizer = torch_adamw(ddp.parameters(), hyper)

    def forward(x, y):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bf16"):
            return ddp(x, y)

    return torch_step(forward, ddp, optimizer)


def torch_step(forward, model, optimizer):
    """step(x, y) -> loss of a plain torch loop: forward, backward, clip_grad_norm_(CLIP),
    optimizer step, zero_grad(set_to_none=True)."""

    def step(x, y):
        loss = forward(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def build_fsdp2(args, dtype: str, hyper: dict, device=None):
    """FSDP2: fully_shard() per block, then the root (defaults otherwise; bf16 through
    MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)), AdamW with zero's resolved
    hyper-parameters, clip_grad_norm_(CLIP). Returns (step(x, y) -> loss, state_bytes())."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    device = device or torch.device("cpu")
    model = build_model(args).to(device)
    policy = MixedPrecisionPolicy()
    if dtype == "bf16":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch_adamw(model.parameters(), hyper)
    step = torch_step(model, model, optimizer)

    def state_bytes() -> int:
        """Local shard bytes of parameters and AdamW state (gradients are freed by
        zero_grad(set_to_none=True))."""
        total = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
        for per_param in optimizer.state.values():
            for value in per_param.values():
                if torch.is_tensor(value) and value.numel() > 1:
                    local = value.to_local() if hasattr(value, "to_local") else value
                    total += local.numel() * local.element_size()
        return total

    return step, state_bytes


# ----- the paper's numbers ----------------------------------------------------------------------
def formula(stage: int, dtype: str, n: int) -> tuple[float, str]:
    """Model-state bytes per parameter per rank that a zero row is compared with, and its name.

    bf16 (mixed precision, K = 12: fp32 master, m, v): the paper's stage formulas with fp32
    gradient accumulation, i.e. a 4-byte gradient term instead of 2 (zero accumulates in fp32).
    fp32: the analogue with no separate master copy (the fp32 parameters are the master), so
    parameters 4, gradients 4, Adam m and v 8 bytes; stage 1 shards the 8, stage 2 the 4 + 8,
    stage 3 all 16.
    """
    if dtype == "bf16":
        table = {
            0: (2 + 4 + 12, "2+4+12 = 18 (DP 16 Psi, fp32 grad)"),
            1: (2 + 4 + 12 / n, "2+4+12/N (stage 1, fp32 grad)"),
            2: (2 + (4 + 12) / n, "2+(4+12)/N (stage 2, fp32 grad)"),
            3: ((2 + 4 + 12) / n, "(2+4+12)/N (stage 3, fp32 grad)"),
        }
    else:
        table = {
            0: (4 + 4 + 8, "4+4+8 = 16 (fp32 DP)"),
            1: (4 + 4 + 8 / n, "4+4+8/N (fp32 stage 1)"),
            2: (4 + (4 + 8) / n, "4+(4+8)/N (fp32 stage 2)"),
            3: ((4 + 4 + 8) / n, "(4+4+8)/N (fp32 stage 3)"),
        }
    return table[stage]


def paper_comm(stage: int) -> int:
    """Communication elements per rank per optimizer step, in units of Psi (ZeRO, section 7):
    2 for data parallelism and stages 1-2, 3 for stage 3."""
    return 3 if stage == 3 else 2
