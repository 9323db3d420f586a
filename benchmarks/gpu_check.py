r"""zero on one GPU: ops, stages 0-3, offload and throughput, in one command under 8 minutes.

    python benchmarks/gpu_check.py --out results/            # on a CUDA machine
    python benchmarks/gpu_check.py --dry --out /tmp/check/   # anywhere: CPU, tiny sizes

Four independent sections; each prints a markdown table, and <out>/gpu_check.json holds every
row, note and, for a section that raised, its traceback (the other sections still run). The
exit status is 1 when a section failed or a row has ok False (a summary line names them), 2 for
bad arguments (an --out that cannot be written is found before any section runs).

1. ops: `zero-report`; the fused CUDA Adam op (ops/csrc/fused_adam.cu) built and checked against
   torch.optim.AdamW / Adam (fp32, and the bf16 parameter copy it writes in the same pass) on a
   few sizes; its step throughput beside torch's AdamW(fused=True).
2. stages: stages 0-3 fp32 (and stage 2 bf16) at world size 1 in this process (an nccl process
   group on CUDA; zero issues no collective at world size 1) and on 2 spawned ranks, both on
   cuda:0 with gloo (NCCL refuses two ranks on one device). Parity with a single-process torch
   reference on the same global batch (fp32 1e-6; bf16 see BF16_TOLERANCE) and, on 2 ranks, the
   fraction of the gradient reduction hidden under backward.
3. offload: optimizer offload with pin_memory at stages 2 and 3, parameter offload at stage 3,
   optimizer offload to nvme at stage 3, parameters and optimizer on nvme at stage 3 (swap files
   under <out>/nvme-swap, removed after the section) and optimizer offload with ratio 0.5: parity
   with the reference, whether the host buffers are pinned, and the host-device copy bandwidth
   the engine's own copies reach (cpu-offloaded buckets) beside the machine's pinned-copy
   bandwidth.
4. throughput: a GPT of about 1B parameters, bf16, stages 0 and 2 at world size 1, beside torch's
   plain AdamW loop (fp32 weights, bf16 autocast) of the same model; then the largest GPT the time
   and host memory allow with optimizer offload, and with parameter offload, at stage 3.
5. compile: engine.compile() (inductor; aot_eager in --dry) at stages 0-3, world size 1: parity
   with the eager engine after PARITY_STEPS steps (fp32, COMPILE_TOLERANCE), the graphs compiled
   and those compiled after the first step (a recompile per step would show there), graph
   breaks; then, time permitting, the offload-section GPT in bf16 at stages 0 and 3, eager
   beside compiled: the first step's seconds (compiling is in it) apart from the median step.

[Note: overlap fraction]
hidden = (T_compute + T_comm - T_backward) / T_comm, clipped to [0, 1]: T_backward is
engine.backward (autograd, zero's gradient hooks, the reductions and their waits), T_compute a
plain torch backward of the same model on the same batch, T_comm the same reductions (one
collective per bucket, same sizes, dtypes and group) issued alone, back to back. zero's hook
copies count against it, so the fraction is a lower bound. Timed with CUDA events on a GPU.

[Note: MFU]
model FLOPs per token = 6 N + 12 L d s (PaLM, appendix B: N parameters without the position
embedding, L layers, width d, sequence length s; causal attention counted in full), times tokens
per second, over the H200's dense bf16 peak of 989 TFLOPS. No peak is known for a CPU (n/a).

--dry runs every section's code on the CPU with gloo and tiny sizes, in well under a minute:
CUDA events become time.perf_counter, the fused CUDA Adam becomes CPUAdam (cpu_adam, or its
pure-PyTorch reference), pinned host memory stays unpinned. tests/test_gpu_check.py runs it.
"""

import argparse
import contextlib
import functools
import gc
import json
import math
import os
import pickle
import platform
import queue as queue_module
import shutil
import socket
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

from gpt import GPT, GPTConfig  # noqa: E402

import zero  # noqa: E402

H200_BF16_DENSE_FLOPS = 989e12
FP32_TOLERANCE = 1e-6
LR, BETAS, EPS, WEIGHT_DECAY, CLIP = 1e-4, (0.9, 0.95), 1e-8, 0.1, 1.0
PARITY_STEPS = 3
# bf16 engine against the fp32 reference: Adam moves a weight by at most about lr per step, so
# the two may part by 2 lr per step, plus one bf16 rounding (2^-8 relative) of the weight.
BF16_TOLERANCE = "2 * lr * steps + 2^-8 * max|w|"
ADAM_BYTES = 28  # per element: read p, g, m, v; write p, m, v (fp32)
SECTION_SHARES = {
    "ops": 0.12, "stages": 0.21, "offload": 0.14, "throughput": 0.43, "compile": 0.10,
}  # fmt: skip
COMPILE_TOLERANCE = 1e-5  # fp32, compiled against eager: fused kernels round differently


@dataclass(frozen=True)
class Shape:
    """A GPT of examples/gpt.py and its batch: micro_batch sequences of block_size tokens."""

    n_layer: int
    n_embd: int
    n_head: int
    block_size: int
    micro_batch: int
    vocab_size: int = 256

    def config(self) -> GPTConfig:
        return GPTConfig(
            vocab_size=self.vocab_size,
            block_size=self.block_size,
            n_layer=self.n_layer,
            n_head=self.n_head,
            n_embd=self.n_embd,
        )

    def numel(self) -> int:
        """Parameters (the tied embedding once), without building the model."""
        d, layer = self.n_embd, 12 * self.n_embd**2 + 13 * self.n_embd
        return self.n_layer * layer + (self.vocab_size + self.block_size + 2) * d


@dataclass
class Plan:
    """Sizes per mode: CUDA (the real check) or --dry (CPU, tiny)."""

    adam_sizes: tuple
    adam_numel: int
    adam_steps: int
    parity: Shape
    parity_bucket: int
    offload: Shape
    big_model: Shape
    ladder: tuple  # (n_layer, n_embd, n_head) largest first, for the offload runs
    big_micro: int
    big_gas: int
    timed_steps: int
    warmup_steps: int
    throughput_bucket: int = 50_000_000  # elements: few buckets (and host pinnings) for 1B+
    offload_steps: tuple = (1, 2)  # (warmup, timed) of the offloaded runs: their steps are long

    @classmethod
    def for_mode(cls, dry: bool) -> "Plan":
        if dry:
            tiny = Shape(2, 32, 2, 16, 2)
            return cls((1, 7, 4097), 1 << 16, 3, tiny, 2_000, tiny, Shape(2, 64, 4, 32, 2),
                       ((4, 64, 4), (2, 32, 2)), 2, 1, 2, 1, 5_000)  # fmt: skip
        ladder = tuple((layers, 4096, 32) for layers in (48, 40, 32, 24, 16, 8))
        return cls(
            adam_sizes=(1, 7, 65_537, 1_000_003, 16_777_216),
            adam_numel=1 << 27,
            adam_steps=20,
            parity=Shape(4, 256, 4, 128, 4),
            parity_bucket=500_000,
            offload=Shape(6, 768, 12, 256, 4),
            big_model=Shape(18, 2048, 16, 1024, 8, vocab_size=50_304),
            ladder=ladder,
            big_micro=8,
            big_gas=4,
            timed_steps=5,
            warmup_steps=2,
        )


@dataclass
class Check:
    """What every section gets: where to run, the plan, and its own deadline."""

    device: torch.device
    dry: bool
    plan: Plan
    deadline: float = math.inf  # time.monotonic() by which the section must end
    notes: list = field(default_factory=list)
    out: Path | None = None  # the --out directory (nvme swap files go under it)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def time_left(self) -> float:
        return self.deadline - time.monotonic()


class Clock:
    """Seconds of device work between start() and stop(): CUDA events on the current stream of a
    GPU (stop() synchronizes on its event), else time.perf_counter."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def start(self) -> None:
        if self.cuda:
            self._begin = torch.cuda.Event(enable_timing=True)
            self._begin.record()
        else:
            self._begin = time.perf_counter()

    def stop(self) -> float:
        if not self.cuda:
            return time.perf_counter() - self._begin
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        return self._begin.elapsed_time(end) / 1e3


def clock_note(check: Check) -> str:
    return "CUDA events" if check.cuda else "time.perf_counter (dry: no CUDA events)"


# ----- the section runner ----------------------------------------------------------------------
def run_sections(sections, budget_s: float, make_check, shares=None) -> dict:
    """Run `sections` ((name, function(check) -> dict) in order) within budget_s seconds.

    Each gets its share of the time still left (shares: name -> weight, default equal) as its
    deadline; a section starting with under 1 s left is skipped with a note. A section that
    raises is recorded with its traceback and the next one runs. Returns name -> record.
    """
    shares = shares or {name: 1.0 for name, _ in sections}
    end = time.monotonic() + budget_s
    records = {}
    for index, (name, function) in enumerate(sections):
        left = end - time.monotonic()
        weight = sum(shares[n] for n, _ in sections[index:])
        allotted = left * shares[name] / weight if weight else left
        if allotted < 1.0:
            note = f"skipped: {max(left, 0):.1f} s of the {budget_s:.0f} s budget left"
            records[name] = {"status": "skipped", "seconds": 0.0, "notes": [note], "rows": []}
            continue
        check = make_check(time.monotonic() + allotted)
        start = time.monotonic()
        try:
            result = function(check)
            record = {"status": "ok", "rows": result.get("rows", []), **result}
        except Exception:
            record = {"status": "failed", "rows": [], "error": traceback.format_exc()}
        record["seconds"] = round(time.monotonic() - start, 2)
        record["allotted_s"] = round(allotted, 1)
        record["notes"] = check.notes + record.get("notes", [])
        records[name] = record
    return records


def markdown_table(rows: list) -> str:
    if not rows:
        return "(no rows)"
    columns = list(dict.fromkeys(key for row in rows for key in row))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row.get(c)) for c in columns) + " |")
    return "\n".join(lines)


def _cell(value) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1e-2 or abs(value) >= 1e4 else f"{value:.3f}"
    return str(value)


# ----- training helpers ------------------------------------------------------------------------
def build_gpt(shape: Shape, device: torch.device, seed: int = 0) -> GPT:
    """The GPT, initialized from `seed` directly on `device` (the same values for the same seed
    and device type)."""
    torch.manual_seed(seed)
    with torch.device(device):
        return GPT(shape.config())


def token_batches(shape: Shape, num_steps: int, world_size: int, seed: int = 1) -> list:
    """batches[step][rank] = (x, y): int64 (micro_batch, block_size) random tokens, on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    size = (shape.micro_batch, shape.block_size)
    return [
        [
            (
                torch.randint(0, shape.vocab_size, size, generator=gen),
                torch.randint(0, shape.vocab_size, size, generator=gen),
            )
            for _ in range(world_size)
        ]
        for _ in range(num_steps)
    ]


def zero_config(
    stage, dtype="fp32", micro=1, gas=1, bucket=500_000, offload=None, nvme=None, ratio=None
) -> dict:
    """The config of every zero run here; offload: None, "optimizer" or "optimizer+param".
    nvme: None (device cpu) or (nvme_path, buffer_size): the offloaded state goes to files
    there (buffer_size, elements, for offload_param: at least the largest parameter's shard;
    max_in_cpu 0, so every parameter shard is in a file). ratio: offload_optimizer.ratio."""
    cfg = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": CLIP,
        "steps_per_print": 10**9,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WEIGHT_DECAY},
        },
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": bucket,
            "allgather_bucket_size": 2 * bucket,
            "overlap_comm": True,
            "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 2 * bucket,
        },
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    zero_cfg = cfg["zero_optimization"]
    if offload is not None:
        zero_cfg["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if nvme is not None:
            zero_cfg["offload_optimizer"].update(device="nvme", nvme_path=nvme[0], buffer_count=2)
        if ratio is not None:
            zero_cfg["offload_optimizer"]["ratio"] = ratio
    if offload == "optimizer+param":
        zero_cfg["offload_param"] = {"device": "cpu", "pin_memory": True}
        if nvme is not None:
            zero_cfg["offload_param"].update(
                device="nvme", nvme_path=nvme[0], buffer_count=2, buffer_size=nvme[1], max_in_cpu=0
            )
    return cfg


def reference_params(shape: Shape, data: list, device: torch.device) -> dict:
    """Plain torch on one process: per step, every rank's micro-batch loss / world size summed by
    autograd, clip, AdamW. name -> fp32 CPU values after the last step."""
    model = build_gpt(shape, device)
    opt = torch.optim.AdamW(
        model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY
    )
    for step in data:
        for x, y in step:
            (model(x.to(device), y.to(device)) / len(step)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: p.detach().to("cpu", torch.float32, copy=True) for n, p in model.named_parameters()}


def train_engine(shape, cfg, data, rank, device):
    """zero.initialize over build_gpt(shape) and one optimizer step per entry of data (this
    rank's micro-batch). Returns the engine."""
    engine, _, _, _ = zero.initialize(model=build_gpt(shape, device), config=cfg)
    for step in data:
        x, y = step[rank]
        engine.backward(engine(x.to(device), y.to(device)))
        engine.step()
    return engine


def full_params(engine) -> dict:
    """name -> full fp32 CPU value of every parameter (a collective at stage 3)."""
    with zero.GatheredParameters(list(engine.module.parameters())):
        return {
            n: p.detach().to("cpu", torch.float32, copy=True)
            for n, p in engine.module.named_parameters()
        }


def max_difference(got: dict, want: dict) -> float:
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    return max(float((got[n] - want[n]).abs().max()) for n in want)


def tolerance(dtype: str, want: dict) -> float:
    if dtype == "fp32":
        return FP32_TOLERANCE
    largest = max(float(v.abs().max()) for v in want.values())
    return 2 * LR * PARITY_STEPS + 2.0**-8 * largest


def release() -> None:
    """Collect what the caller dropped (engines hold reference cycles) and return the cached
    device memory."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ----- section 1: zero-report and the fused CUDA Adam ------------------------------------------
def section_ops(check: Check) -> dict:
    from zero.ops.report import report_lines

    report = report_lines()
    print("\n".join(report))
    from zero.ops import OpBuildError

    try:
        make, name, build_s = _adam_under_test(check)
    except OpBuildError as error:
        row = {"check": "build fused_adam", "ok": False, "error": str(error)[:500]}
        return {"rows": [row], "zero_report": report, "build_s": None, "optimizer": None}
    rows = _adam_parity_rows(check, make, name)
    if check.time_left() > 5:
        rows += _adam_throughput_rows(check, make, name)
    else:
        check.notes.append("throughput rows skipped: section time spent")
    return {"rows": rows, "zero_report": report, "build_s": build_s, "optimizer": name}


def _adam_under_test(check: Check):
    """(constructor, name, build seconds) of the Adam this machine checks: FusedAdam (built
    here) on CUDA, CPUAdam in --dry mode."""
    from zero.ops import CPUAdam, FusedAdam
    from zero.ops.builder import get_builder

    if not check.cuda:
        check.notes.append("dry: no CUDA, so CPUAdam (cpu_adam op, else its reference) stands in")
        return CPUAdam, "zero CPUAdam", None
    start = time.monotonic()
    get_builder("fused_adam").load(verbose=False)  # raises OpBuildError with the reason
    return FusedAdam, "zero FusedAdam (fused_adam.cu)", round(time.monotonic() - start, 1)


def _adam_parity_rows(check: Check, make, name: str) -> list:
    rows = []
    for numel in check.plan.adam_sizes:
        for mode in ("AdamW fp32", "Adam (L2) fp32", "AdamW + bf16 copy"):
            rows.append(_adam_parity(check, make, name, numel, mode))
    return rows


def _adam_parity(check: Check, make, name: str, numel: int, mode: str) -> dict:
    gen = torch.Generator().manual_seed(numel)
    start = torch.randn(numel, generator=gen).to(check.device)
    grads = [(torch.randn(numel, generator=gen) * 1e-2).to(check.device) for _ in range(3)]
    adamw = mode != "Adam (L2) fp32"
    torch_class = torch.optim.AdamW if adamw else torch.optim.Adam
    ref = torch.nn.Parameter(start.clone())
    mine = torch.nn.Parameter(start.clone())
    hyper = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    ref_opt = torch_class([ref], foreach=False, **hyper)
    opt = make([mine], adamw_mode=adamw, **hyper)
    copy = torch.empty(numel, dtype=torch.bfloat16, device=check.device)
    for grad in grads:
        ref.grad, mine.grad = grad.clone(), grad.clone()
        ref_opt.step()
        if mode.endswith("bf16 copy"):
            opt.step_with_copy({mine: copy})
        else:
            opt.step()
    # Weights are N(0, 1), up to ~5 at 16M elements where one fp32 ulp is 4.8e-7: the
    # difference is taken relative to max(1, |w|).
    error = (mine - ref).detach().abs()
    scaled = float((error / ref.detach().abs().clamp(min=1.0)).max())
    row = {"check": f"{name} vs torch {torch_class.__name__}", "mode": mode, "numel": numel}
    row.update(max_abs_diff=float(error.max()), max_scaled_diff=scaled)
    row.update(tolerance=FP32_TOLERANCE, ok=scaled <= FP32_TOLERANCE)
    if mode.endswith("bf16 copy"):
        # The copy must be the updated fp32 value rounded to nearest even: exactly equal.
        row["bf16_copy_mismatches"] = int((copy != mine.detach().to(torch.bfloat16)).sum())
        row["ok"] = row["ok"] and row["bf16_copy_mismatches"] == 0
    return row


def _adam_throughput_rows(check: Check, make, name: str) -> list:
    plan = check.plan
    pieces = 8  # several tensors, as a model's parameter list
    numel = plan.adam_numel // pieces * pieces
    params = [torch.nn.Parameter(torch.randn(numel // pieces, device=check.device))]
    params += [torch.nn.Parameter(torch.randn_like(params[0])) for _ in range(pieces - 1)]
    for param in params:
        param.grad = torch.randn_like(param) * 1e-2
    hyper = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    rows = []
    candidates = [
        (name, lambda: make(params, adamw_mode=True, **hyper)),
        ("torch AdamW fused=True", lambda: torch.optim.AdamW(params, fused=True, **hyper)),
    ]
    for row_name, build in candidates:
        try:
            opt = build()
        except (RuntimeError, TypeError, ValueError) as error:
            rows.append({"check": f"throughput {row_name}", "error": str(error)[:200]})
            continue
        seconds = _time_steps(check, opt.step, plan.adam_steps)
        del opt
        rate = numel / seconds
        rows.append(
            {"check": f"throughput {row_name}", "numel": numel, "ms_per_step": seconds * 1e3,
             "Gelem_per_s": rate / 1e9, "GB_per_s_at_28B": rate * ADAM_BYTES / 1e9}
        )  # fmt: skip
        release()
    return rows


def _time_steps(check: Check, step, num_steps: int) -> float:
    """Median seconds of step() over num_steps calls after two untimed ones."""
    step()
    step()
    clock, times = Clock(check.device), []
    for _ in range(num_steps):
        clock.start()
        step()
        times.append(clock.stop())
    return statistics.median(times)


# ----- section 2: stages 0-3, world size 1 and 2 ----------------------------------------------
STAGE_CASES = ((0, "fp32"), (1, "fp32"), (2, "fp32"), (3, "fp32"), (2, "bf16"))


def section_stages(check: Check) -> dict:
    plan = check.plan
    backend = "nccl" if check.cuda else "gloo"
    rows = []
    data1 = token_batches(plan.parity, PARITY_STEPS, 1)
    want1 = reference_params(plan.parity, data1, check.device)
    with _one_rank_group(backend):
        for stage, dtype in STAGE_CASES:
            cfg = zero_config(stage, dtype, plan.parity.micro_batch, bucket=plan.parity_bucket)
            engine = train_engine(plan.parity, cfg, data1, 0, check.device)
            got = full_params(engine)
            del engine
            release()
            rows.append(_parity_row(1, backend, stage, dtype, got, want1))
    check.notes.append(
        f"world size 1: this process in a one-rank {backend} group; zero issues no collective "
        "at world size 1, so the backend carries nothing there"
    )
    if check.time_left() < 20:
        check.notes.append("2 ranks skipped: section time spent")
        return {"rows": rows}
    data2 = token_batches(plan.parity, PARITY_STEPS, 2)
    want2 = reference_params(plan.parity, data2, check.device)
    where = "both on cuda:0" if check.cuda else "CPU processes"
    check.notes.append(
        f"2 ranks: spawned, {where}, gloo (NCCL refuses two ranks on one device); overlap: "
        f"[Note: overlap fraction], timed with {clock_note(check)}"
    )
    results = spawn_ranks(2, _rank_stages, check.device.type, (plan,), check.time_left())
    for (stage, dtype), (got, overlap) in zip(STAGE_CASES, results[0]):
        row = _parity_row(2, "gloo", stage, dtype, got, want2)
        row.update(overlap)
        rows.append(row)
    return {"rows": rows}


@contextlib.contextmanager
def _one_rank_group(backend: str):
    """A one-rank default process group in this process (a HashStore, no network)."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _parity_row(world_size, backend, stage, dtype, got, want) -> dict:
    diff, tol = max_difference(got, want), tolerance(dtype, want)
    return {"world_size": world_size, "backend": backend, "stage": stage, "dtype": dtype,
            "max_abs_diff": diff, "tolerance": tol, "ok": diff <= tol}  # fmt: skip


def _rank_stages(rank: int, device_type: str, plan: Plan) -> list:
    """One spawned rank: every STAGE_CASES case, its parameters (rank 0) and overlap."""
    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    data = token_batches(plan.parity, PARITY_STEPS, 2)
    out = []
    for stage, dtype in STAGE_CASES:
        cfg = zero_config(stage, dtype, plan.parity.micro_batch, bucket=plan.parity_bucket)
        engine = train_engine(plan.parity, cfg, data, rank, device)
        got = full_params(engine)
        overlap = measure_overlap(engine, plan.parity, dtype, data[0][rank], device)
        del engine
        release()
        out.append((got if rank == 0 else None, overlap))
    return out


def measure_overlap(engine, shape: Shape, dtype: str, batch, device) -> dict:
    """[Note: overlap fraction] for one micro-batch; medians of 3. Collective."""
    x, y = batch[0].to(device), batch[1].to(device)
    plain = build_gpt(shape, device)
    if dtype == "bf16":
        plain = plain.to(torch.bfloat16)
    clock = Clock(device)

    def timed(prepare, action, finish=lambda: None):
        times = []
        for _ in range(4):
            before = prepare()
            dist.barrier()
            clock.start()
            action(before)
            times.append(clock.stop())
            finish()
        return statistics.median(times[1:])

    total = timed(lambda: engine(x, y), engine.backward, engine.step)  # step: untimed
    compute = timed(lambda: plain(x, y), lambda loss: loss.backward())
    comm = timed(lambda: None, lambda _: replay_reductions(engine))
    hidden = (compute + comm - total) / comm if comm > 0 else None
    return {
        "backward_ms": total * 1e3,
        "compute_ms": compute * 1e3,
        "reduction_ms": comm * 1e3,
        "hidden_fraction": None if hidden is None else min(1.0, max(0.0, hidden)),
    }


def replay_reductions(engine) -> None:
    """The gradient reductions of one micro-batch, alone: per bucket one collective of its size
    and dtype on the group zero uses (a scratch buffer: the engine's state is untouched)."""
    optimizer = engine.optimizer
    settings = optimizer.settings
    for bucket in optimizer.buckets:
        numel = bucket.layout.padded_numel
        dtype = settings.reduce_dtype if settings.stage >= 2 else settings.accum_dtype
        scratch = torch.zeros(numel, dtype=dtype, device=bucket.grad_device)
        if settings.stage == 0:
            optimizer.comm.all_reduce(scratch)
        else:
            out = torch.empty(bucket.layout.shard_numel, dtype=dtype, device=scratch.device)
            optimizer.reduce_comm.reduce_scatter(out, scratch)


# ----- spawning ranks --------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_entry(fn, rank, world_size, port, device_type, args, queue):
    os.environ.update(
        RANK=str(rank),
        # Both ranks on cuda:0 share local rank 0 (zero picks cuda:LOCAL_RANK).
        LOCAL_RANK="0" if device_type == "cuda" else str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    if device_type != "cuda":
        torch.set_num_threads(1)
    try:
        if device_type == "cuda":
            torch.cuda.set_device(0)
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        # Plain pickle copies tensors; the queue's own reducer would share them by file
        # descriptor, which dies with this process.
        queue.put((rank, True, pickle.dumps(fn(rank, device_type, *args))))
        dist.barrier()
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn_ranks(world_size: int, fn, device_type: str, args: tuple, timeout: float) -> list:
    """fn(rank, device_type, *args) on world_size spawned ranks over gloo; results by rank.
    Raises RuntimeError with a failing rank's traceback, or when timeout seconds pass."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_rank_entry, args=(fn, r, world_size, port, device_type, args, queue))
        for r in range(world_size)
    ]
    for proc in procs:
        proc.start()
    results, deadline = {}, time.monotonic() + max(timeout, 1.0)
    try:
        while len(results) < world_size:
            try:
                rank, ok, value = queue.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue_module.Empty:
                raise RuntimeError(f"ranks did not finish within {timeout:.0f} s") from None
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = pickle.loads(value)
    finally:
        for proc in procs:
            proc.join(timeout=10 if len(results) == world_size else 0.1)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return [results[r] for r in range(world_size)]


# ----- section 3: offload ----------------------------------------------------------------------
# (stage, offload, device, ratio): device "nvme" puts the offloaded state in files.
OFFLOAD_CASES = (
    (2, "optimizer", "cpu", None),
    (3, "optimizer", "cpu", None),
    (3, "optimizer+param", "cpu", None),
    (3, "optimizer", "nvme", None),
    (3, "optimizer+param", "nvme", None),
    (3, "optimizer", "cpu", 0.5),
)


def offload_case_name(stage, offload, device, ratio) -> str:
    name = f"stage {stage}, offload {offload}"
    if device != "cpu":
        name += f" to {device}"
    return name + (f", ratio {ratio}" if ratio is not None else "")


def largest_param_numel(shape: Shape) -> int:
    """Elements of the GPT's largest parameter: the (tied) token embedding, the position
    embedding or an MLP matrix (4 d x d)."""
    d = shape.n_embd
    return max(shape.vocab_size * d, shape.block_size * d, 4 * d * d)


def section_offload(check: Check) -> dict:
    shape = check.plan.offload
    data = token_batches(shape, PARITY_STEPS, 1)
    want = reference_params(shape, data, check.device)
    machine = machine_copy_bandwidth(check)
    rows = [dict(case="machine", **machine)]
    if not check.cuda:
        check.notes.append("dry: no CUDA, so pin_memory leaves host buffers unpinned")
    swap = Path(check.out if check.out is not None else ".") / "nvme-swap"
    try:
        for stage, offload, device, ratio in OFFLOAD_CASES:
            name = offload_case_name(stage, offload, device, ratio)
            if check.time_left() < 5:
                check.notes.append(f"{name} skipped: section time spent")
                continue
            nvme = None
            if device == "nvme":
                swap.mkdir(parents=True, exist_ok=True)
                nvme = (str(swap), largest_param_numel(shape))
            cfg = zero_config(stage, "fp32", shape.micro_batch, bucket=check.plan.parity_bucket,
                              offload=offload, nvme=nvme, ratio=ratio)  # fmt: skip
            engine = train_engine(shape, cfg, data, 0, check.device)
            try:
                diff = max_difference(full_params(engine), want)
                places = [engine.optimizer._placement(b) for b in engine.optimizer.buckets]
                kinds = [f"{places.count(p)} {p}" for p in ("device", "cpu", "nvme") if p in places]
                row = {"case": name, "max_abs_diff": diff, "tolerance": FP32_TOLERANCE,
                       "ok": diff <= FP32_TOLERANCE, "buckets": ", ".join(kinds)}  # fmt: skip
                row.update(engine_copy_bandwidth(check, engine))
            finally:
                engine.close()  # removes its nvme swap files
                del engine
                release()
            rows.append(row)
    finally:
        shutil.rmtree(swap, ignore_errors=True)
    return {"rows": rows, "machine": machine}


def machine_copy_bandwidth(check: Check) -> dict:
    """GB/s of the best of 3 copies of a 256 MiB (dry: 16 MiB) buffer: host to device and back,
    from pinned and from pageable host memory."""
    numel = (64 << 20) if check.cuda else (4 << 20)
    device = torch.empty(numel, device=check.device)
    pageable = torch.empty(numel)
    pinned = pageable.pin_memory() if check.cuda else pageable
    clock, out = Clock(check.device), {}
    for name, host in (("pinned", pinned), ("pageable", pageable)):
        for direction, dst, src in (("h2d", device, host), ("d2h", host, device)):
            best = min(_timed_copy(clock, dst, src) for _ in range(3))
            out[f"{direction}_{name}_GBps"] = numel * 4 / best / 1e9
    return out


def _timed_copy(clock: Clock, dst: torch.Tensor, src: torch.Tensor) -> float:
    clock.start()
    dst.copy_(src, non_blocking=src.is_pinned() or dst.is_pinned())
    if clock.cuda:
        torch.cuda.current_stream().synchronize()  # a non-blocking D2H ends on the host
    return clock.stop()


def engine_copy_bandwidth(check: Check, engine) -> dict:
    """The engine's own host-device copies, replayed on its buffers (the values they copy are
    the ones already there): gradient shard to host (the step's D2H), fp32 master to the device
    parameter shard (H2D) or, with parameter offload, the host parameter shard to the device
    (the gather's H2D). Best of 3, GB/s; whether every host buffer is pinned. Only the buckets
    offloaded to cpu count (ratio < 1 keeps some on the device); with none (nvme), None."""
    optimizer, clock = engine.optimizer, Clock(check.device)
    buckets = [b for b in optimizer.buckets if optimizer._placement(b) == "cpu"]
    if not buckets:
        keys = ("host_buffers_pinned", "engine_d2h_GBps", "engine_h2d_GBps")
        return dict.fromkeys(keys)
    host_bufs = [b.host_grad for b in buckets] + [b.master for b in buckets]
    param_offload = buckets[0].param_shard.device.type == "cpu" and check.cuda
    if param_offload:
        host_bufs += [b.param_shard for b in buckets]

    # Gradient buffers exist only within a step: stand-ins of the same size, dtype and device.
    grads = [
        torch.zeros(b.layout.shard_numel, dtype=b.grad_dtype, device=b.grad_device) for b in buckets
    ]

    def d2h():
        for b, grad in zip(buckets, grads):
            b.host_grad.copy_(grad, non_blocking=b.host_grad.is_pinned())

    def h2d():
        for b in buckets:
            if param_offload:
                b.param_shard.to(check.device, non_blocking=b.param_shard.is_pinned())
            elif b.param_shard is not b.master:
                b.param_shard.copy_(b.master, non_blocking=b.master.is_pinned())

    out = {"host_buffers_pinned": all(t.is_pinned() for t in host_bufs)}
    d2h_bytes = sum(g.numel() * g.element_size() for g in grads)
    h2d_src = [b.param_shard if param_offload else b.master for b in buckets]
    h2d_bytes = sum(t.numel() * t.element_size() for t in h2d_src)
    for name, action, size in (("d2h", d2h, d2h_bytes), ("h2d", h2d, h2d_bytes)):
        times = []
        for _ in range(3):
            clock.start()
            action()
            if check.cuda:
                torch.cuda.current_stream().synchronize()
            times.append(clock.stop())
        out[f"engine_{name}_GBps"] = size / max(min(times), 1e-9) / 1e9
    return out


# ----- section 4: throughput -------------------------------------------------------------------
def flops_per_token(shape: Shape) -> float:
    """[Note: MFU] 6 N + 12 L d s, N without the position embedding."""
    n = shape.numel() - shape.block_size * shape.n_embd
    return 6 * n + 12 * shape.n_layer * shape.n_embd * shape.block_size


def section_throughput(check: Check) -> dict:
    plan = check.plan
    peak = H200_BF16_DENSE_FLOPS if check.cuda else None
    check.notes.append(
        "MFU = (6 N + 12 L d s) * tokens/s / peak, N without the position embedding; peak "
        + ("H200 dense bf16 989 TFLOPS" if peak else "n/a (dry: CPU)")
    )
    rows = []
    shape = plan.big_model
    runs = [("torch AdamW, fp32 weights + bf16 autocast", None), ("zero stage 0 bf16", 0),
            ("zero stage 2 bf16", 2)]  # fmt: skip
    for name, stage in runs:
        if check.time_left() < 10:
            check.notes.append(f"{name} skipped: section time spent")
            continue
        rows.append(_guarded(name, lambda stage=stage: _throughput_run(check, shape, stage)))
    rows += _largest_offload_rows(check)
    for row in rows:
        if "flops_per_s" in row:
            row["MFU"] = row["flops_per_s"] / peak if peak else None
    return {"rows": rows, "peak_flops": peak}


def _guarded(name: str, run) -> dict:
    """A run's row; an exception (out of memory) becomes a row naming it."""
    try:
        row = {"run": name, **run()}
    except Exception as error:  # a row per failure (out of memory); the section goes on
        row = {"run": name, "error": f"{type(error).__name__}: {str(error)[:300]}"}
    release()  # the run's model, engine and optimizer are unreachable once it returned
    return row


def _throughput_run(check: Check, shape: Shape, stage, gas=1, offload=None) -> dict:
    """tokens/s of training `shape`: torch's loop when stage is None, else zero's."""
    plan, device = check.plan, check.device
    warmup, timed = plan.offload_steps if offload else (plan.warmup_steps, plan.timed_steps)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    started = time.monotonic()
    model = build_gpt(shape, device)
    data = token_batches(shape, gas, 1)
    batch = [(x.to(device), y.to(device)) for ((x, y),) in data]
    if stage is None:
        step = _torch_step(model, batch, device)
    else:
        cfg = zero_config(stage, "bf16", shape.micro_batch, gas, plan.throughput_bucket, offload)
        engine, _, _, _ = zero.initialize(model=model, config=cfg)
        step = _zero_step(engine, batch)
    for _ in range(warmup):
        step()
    clock = Clock(device)
    clock.start()
    for _ in range(timed):
        step()
    seconds = clock.stop()
    tokens = timed * gas * shape.micro_batch * shape.block_size
    flops = flops_per_token(shape) * tokens / seconds
    peak_mem = torch.cuda.max_memory_allocated() / 2**30 if check.cuda else None
    row = {"params": shape.numel(), "layers": shape.n_layer, "d": shape.n_embd,
           "tokens_per_step": tokens // timed, "s_per_step": seconds / timed,
           "tokens_per_s": tokens / seconds, "flops_per_s": flops, "TFLOPS": flops / 1e12,
           "peak_GiB": peak_mem, "wall_s": time.monotonic() - started}  # fmt: skip
    return row


def _torch_step(model, batch, device):
    opt = torch.optim.AdamW(
        model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
        fused=device.type == "cuda",
    )  # fmt: skip

    def step():
        for x, y in batch:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(x, y)
            (loss / len(batch)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _zero_step(engine, batch):
    def step():
        for x, y in batch:
            engine.backward(engine(x, y))
            engine.step()

    return step


def _largest_offload_rows(check: Check) -> list:
    """The largest ladder GPT that host memory and the time left allow, with optimizer offload
    (stage 2) and with parameter offload too (stage 3); a smaller one after a failure."""
    plan, rows = check.plan, []
    runs = (("optimizer", 2, 16), ("optimizer+param", 3, 18))  # host bytes per parameter
    for index, (offload, stage, host_bytes) in enumerate(runs):
        share = check.time_left() / (len(runs) - index)
        for shape in _ladder_shapes(plan):
            estimate = _offload_seconds(check, shape)
            if shape.numel() * host_bytes > 0.6 * _available_host_bytes() or estimate > share:
                continue
            name = f"zero stage {stage} bf16, offload {offload}"
            run = functools.partial(_throughput_run, check, shape, stage, plan.big_gas, offload)
            row = _guarded(name, run)
            row["estimated_s"] = estimate
            rows.append(row)
            if "error" not in row:
                break
            share = check.time_left() / (len(runs) - index)
        else:
            check.notes.append(f"offload {offload}: no ladder size fits the time or host memory")
    return rows


def _ladder_shapes(plan: Plan) -> list:
    big = plan.big_model
    return [
        Shape(layers, d, heads, big.block_size, plan.big_micro, big.vocab_size)
        for layers, d, heads in plan.ladder
    ]


def _offload_seconds(check: Check, shape: Shape) -> float:
    """A rough wall time of one offload run: building and pinning (16 bytes per parameter at
    4 GB/s) plus warmup and timed steps, each a host Adam pass (1 Gelem/s) and the compute at
    30% of the peak."""
    if not check.cuda:
        return 1.0
    n, plan = shape.numel(), check.plan
    tokens = plan.big_gas * shape.micro_batch * shape.block_size
    step = n / 1e9 + 6 * n * tokens / (0.3 * H200_BF16_DENSE_FLOPS)
    return 16 * n / 4e9 + sum(plan.offload_steps) * step


def _available_host_bytes() -> int:
    import psutil

    return psutil.virtual_memory().available


# ----- section 5: engine.compile() --------------------------------------------------------------
class _CountingBackend:
    """A torch.compile backend that counts the graphs Dynamo hands it and compiles each with
    `name` (the count tells a recompile from a cached graph)."""

    def __init__(self, name: str):
        self.name, self.__name__, self.graphs = name, name, 0

    def __call__(self, graph, example_inputs, **kwargs):
        self.graphs += 1
        return torch._dynamo.lookup_backend(self.name)(graph, example_inputs, **kwargs)


def section_compile(check: Check) -> dict:
    from torch._dynamo.utils import counters

    plan, rows = check.plan, []
    name = "inductor" if check.cuda else "aot_eager"
    backend = _CountingBackend(name)  # stages 1-2 reuse the graph stage 0 compiled
    data = token_batches(plan.parity, PARITY_STEPS, 1)
    with _one_rank_group("nccl" if check.cuda else "gloo"):
        for stage in (0, 1, 2, 3):
            cfg = zero_config(stage, "fp32", plan.parity.micro_batch, bucket=plan.parity_bucket)
            want = full_params(train_engine(plan.parity, cfg, data, 0, check.device))
            counters.clear()
            before = backend.graphs
            engine = _compiled_engine(plan.parity, cfg, backend, check.device)
            first = _train_steps(engine, data[:1], check.device)
            after_first = backend.graphs
            _train_steps(engine, data[1:], check.device)
            diff = max_difference(full_params(engine), want)
            rows.append({"case": f"parity stage {stage}", "backend": name, "stage": stage,
                         "dtype": "fp32", "max_abs_diff": diff, "tolerance": COMPILE_TOLERANCE,
                         "graphs": backend.graphs - before,
                         "recompiles_after_first_step": backend.graphs - after_first,
                         "graph_breaks": sum(counters["graph_break"].values()),
                         "first_step_s": first, "ok": diff <= COMPILE_TOLERANCE
                         and backend.graphs == after_first})  # fmt: skip
            del engine
            release()
        rows += _compile_timing_rows(check, name)
    check.notes.append(
        f"backend {name}; stage 3 compiles each block's forward (engine/compiler.py), stages "
        "0-2 the whole forward; recompiles_after_first_step counts graphs compiled after it"
    )
    return {"rows": rows}


def _compiled_engine(shape, cfg, backend, device):
    engine, _, _, _ = zero.initialize(model=build_gpt(shape, device), config=cfg)
    engine.compile(backend=backend)
    return engine


def _train_steps(engine, data, device) -> float:
    """Seconds of one optimizer step per entry of data (rank 0's micro-batch), synchronized."""
    clock = Clock(device)
    clock.start()
    for ((x, y),) in data:
        engine.backward(engine(x.to(device), y.to(device)))
        engine.step()
    return clock.stop()


def _compile_timing_rows(check: Check, name: str) -> list:
    """bf16 on the offload-section GPT, stages 0 and 3: eager and compiled first and median
    steps (a fresh backend per engine: each compiles its own graphs)."""
    plan, rows = check.plan, []
    shape = plan.offload
    data = token_batches(shape, plan.warmup_steps + plan.timed_steps, 1)
    for stage in (0, 3):
        for compiled in (False, True):
            if check.time_left() < 30:
                check.notes.append(f"timing stage {stage} skipped: section time spent")
                return rows
            cfg = zero_config(stage, "bf16", shape.micro_batch, bucket=plan.throughput_bucket)
            engine, _, _, _ = zero.initialize(model=build_gpt(shape, check.device), config=cfg)
            if compiled:
                engine.compile(backend=_CountingBackend(name))
            first = _train_steps(engine, data[:1], check.device)
            _train_steps(engine, data[1 : plan.warmup_steps], check.device)
            steps = [_train_steps(engine, [d], check.device) for d in data[plan.warmup_steps :]]
            rows.append({"case": f"timing stage {stage}" + (" compiled" if compiled else ""),
                         "backend": name if compiled else "eager", "stage": stage,
                         "dtype": "bf16", "params": shape.numel(), "first_step_s": first,
                         "median_step_s": statistics.median(steps),
                         "compile_s": first - statistics.median(steps)})  # fmt: skip
            del engine
            release()
    return rows


# ----- main ------------------------------------------------------------------------------------
SECTIONS = [
    ("ops", section_ops),
    ("stages", section_stages),
    ("offload", section_offload),
    ("throughput", section_throughput),
    ("compile", section_compile),
]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for gpu_check.json")
    parser.add_argument("--dry", action="store_true", help="CPU, gloo, tiny sizes")
    parser.add_argument("--budget_s", type=float, default=420.0, help="total seconds")
    parser.add_argument(
        "--sections", default=",".join(n for n, _ in SECTIONS), help="comma-separated subset"
    )
    args = parser.parse_args(argv)
    unknown = set(args.sections.split(",")) - {n for n, _ in SECTIONS}
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {[n for n, _ in SECTIONS]}")
    if not math.isfinite(args.budget_s) or args.budget_s <= 0:
        parser.error(f"--budget_s must be a finite number of seconds > 0, not {args.budget_s}")
    problem = prepare_out(Path(args.out))
    if problem:
        parser.error(f"--out {args.out}: {problem}")
    return args


def prepare_out(out: Path) -> str | None:
    """Create `out` (and its parents) and write and remove a probe file in it, before any section
    runs; what went wrong, or None."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".gpu_check-probe-{os.getpid()}"
        probe.write_text("probe")
        probe.unlink()
    except OSError as error:
        return f"cannot write there ({type(error).__name__}: {error.strerror or error})"
    return None


def failures(records: dict) -> list:
    """'section' for each failed section, 'section: row' for each row with ok False."""
    out = []
    for name, record in records.items():
        if record["status"] == "failed":
            out.append(f"{name} (section failed)")
        for row in record["rows"]:
            if row.get("ok") is False:
                label = row.get("case") or row.get("check") or row.get("run") or row
                extra = {k: row[k] for k in ("mode", "world_size", "stage", "dtype") if k in row}
                out.append(f"{name}: {label}" + (f" {extra}" if extra else ""))
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.dry and not torch.cuda.is_available():
        print("gpu_check: no CUDA device is visible; use --dry on a CPU", file=sys.stderr)
        return 2
    device = torch.device("cpu") if args.dry else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)  # tiny sizes: threads only contend (spawned ranks take 1 too)
    plan = Plan.for_mode(args.dry)
    chosen = [(n, f) for n, f in SECTIONS if n in args.sections.split(",")]
    started = time.monotonic()
    out = Path(args.out)
    records = run_sections(
        chosen, args.budget_s, lambda deadline: Check(device, args.dry, plan, deadline, out=out),
        SECTION_SHARES,
    )  # fmt: skip
    result = {"meta": _meta(args, device, time.monotonic() - started), "sections": records}
    for name, record in records.items():
        print(f"\n## {name} ({record['status']}, {record['seconds']} s)\n")
        print(markdown_table(record["rows"]))
        for note in record["notes"]:
            print(f"- {note}")
        if record.get("error"):
            print(record["error"])
    (out / "gpu_check.json").write_text(json.dumps(result, indent=1, default=str))
    print(f"\nwrote {out / 'gpu_check.json'}")
    failed = failures(records)
    if failed:
        print(f"gpu_check: FAILED: {'; '.join(failed)}")
        return 1
    return 0


def _meta(args, device, seconds) -> dict:
    meta = {"dry": args.dry, "budget_s": args.budget_s, "seconds": round(seconds, 1),
            "device": str(device), "torch": torch.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version(), "cpu_count": os.cpu_count()}  # fmt: skip
    if device.type == "cuda":
        meta["gpu"] = torch.cuda.get_device_name(device)
    return meta


if __name__ == "__main__":
    sys.exit(main())
