r"""Peak memory of consolidating a stage-3 checkpoint (zero-to-fp32), beside DeepSpeed's.

    python benchmarks/consolidation_memory.py --n_layer 8 --n_embd 768 --world_size 2

Spawns `world_size` gloo ranks (CPU processes) that build the GPT of examples/gpt.py (default
~57M parameters, ~228 MB of fp32 weights), wrap it in a zero stage-3 fp32 engine with AdamW, take
one optimizer step and save a checkpoint; rank 0 also measures its own peak extra memory during
engine.save_pretrained (the export assembled one tensor at a time). Where deepspeed
imports, the same model is trained one step with DeepSpeed stage 3 on the same number of ranks
and saved with DeepSpeed's save_checkpoint (DeepSpeed cannot read zero's checkpoints, so its
zero_to_fp32 runs on its own).

Then each consolidation runs alone in a fresh process, measured from outside it:
- peak RSS: the child's ru_maxrss from wait4 (the kernel's VmHWM: exact);
- peak private memory: the child's RssAnon (anonymous pages: heap, tensors; not the mapped
  libraries nor file pages) from /proc/<pid>/status, sampled every --sample_ms;
- each figure also minus the same of a process that only imports the same modules, which is
  what the consolidation itself costs.
Contestants: zero's `zero-to-fp32 CKPT OUT.safetensors`, its library writer
`zero.checkpoint.write_consolidated`, `zero.checkpoint.consolidate` (which returns the state
dict, so it holds the model once by design), and DeepSpeed's
convert_zero_checkpoint_to_fp32_state_dict through its `zero_to_fp32` command (its default
pickled output: --safe_serialization refuses the GPT's tied weights). The bound zero aims at is
printed beside them: 1.5 x the largest tensor plus 64 MiB above the import baseline. Finally the
files of zero-to-fp32, write_consolidated and save_pretrained are compared bitwise.
DeepSpeed's first run on a machine builds its CPU ops (minutes); later runs reuse them.

The parent prints a markdown table (the figures land in docs/performance.md). A measurement,
not a test: nothing here asserts on memory.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

from _common import free_port, init_rank  # noqa: E402
from checkpoint_io import PeakMemory  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

MB = 2**20
OVERHEAD = 64 * MB  # the fixed part of the bound zero aims at


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n_layer", type=int, default=8, help="GPT blocks (model size)")
    parser.add_argument("--n_embd", type=int, default=768, help="GPT width (model size)")
    parser.add_argument("--n_head", type=int, default=12)
    parser.add_argument("--block_size", type=int, default=32, help="tokens per sample")
    parser.add_argument("--world_size", type=int, default=2)
    parser.add_argument("--sample_ms", type=float, default=2.0, help="RssAnon sampling period")
    parser.add_argument("--no_deepspeed", action="store_true", help="skip DeepSpeed's row")
    parser.add_argument("--dir", default=None, help="parent of the temporary directory")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints afterwards")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    return parser.parse_args(argv)


def build_model(args) -> GPT:
    torch.manual_seed(0)
    config = GPTConfig(
        n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size
    )
    return GPT(config)


def config(args) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 3},
    }


def one_step(engine, args, rank: int) -> None:
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, 256, (1, args.block_size + 1), generator=g)
    engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
    engine.step()


# ----- saving (spawned ranks) -------------------------------------------------------------------
def zero_rank(rank: int, args, port: int, root: str) -> None:
    import zero

    init_rank(rank, args.world_size, port)
    try:
        engine, _, _, _ = zero.initialize(model=build_model(args), config=config(args))
        one_step(engine, args, rank)
        engine.save_checkpoint(os.path.join(root, "zero"), tag="step1")
        dist.barrier()
        with PeakMemory(args.sample_ms / 1000) as peak:
            engine.save_pretrained(os.path.join(root, "pretrained"))
        if rank == 0:
            figures = {
                "save_pretrained_rss": peak.extra_rss,
                "save_pretrained_anon": peak.extra_anon,
            }
            Path(root, "save_pretrained.json").write_text(json.dumps(figures))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def deepspeed_rank(rank: int, args, port: int, root: str) -> None:
    import deepspeed
    from deepspeed.utils import logger

    logger.setLevel("WARNING")
    init_rank(rank, args.world_size, port)
    try:
        model = build_model(args)
        engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config(args)
        )
        one_step(engine, args, rank)
        engine.save_checkpoint(os.path.join(root, "deepspeed"), tag="step1")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def deepspeed_error() -> str | None:
    """Why DeepSpeed's row is left out, or None when deepspeed imports."""
    try:
        import deepspeed  # noqa: F401
    except Exception as error:  # ImportError, or a broken install raising anything
        return f"deepspeed does not import ({type(error).__name__}: {error})"
    return None


# ----- measuring one fresh process --------------------------------------------------------------
def _rss_anon(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_measured(command: list[str], period_s: float) -> dict:
    """Run `command`; its peak RSS (ru_maxrss from wait4), peak RssAnon (sampled), seconds.
    Raises RuntimeError with its stderr when it fails."""
    start = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak_anon, done = [0], threading.Event()

    def sample():
        while not done.is_set():
            peak_anon[0] = max(peak_anon[0], _rss_anon(child.pid))
            time.sleep(period_s)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stderr = child.stderr.read()
    _, status, usage = os.wait4(child.pid, 0)
    done.set()
    sampler.join()
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise RuntimeError(f"{command} failed ({child.returncode}):\n{stderr.decode()[-3000:]}")
    return {
        "hwm": usage.ru_maxrss * 1024,
        "anon": peak_anon[0],
        "s": time.perf_counter() - start,
    }


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def zero_contestants(root: str) -> dict[str, tuple[list[str], list[str]]]:
    """label -> (command, its import baseline command)."""
    checkpoint = os.path.join(root, "zero")
    script = shutil.which("zero-to-fp32", path=os.path.dirname(sys.executable))
    command = [script] if script else [sys.executable, "-m", "zero.zero_to_fp32"]
    baseline = python("import torch, zero.checkpoint.zero_to_fp32")
    out = os.path.join(root, "out")
    library = (
        "from zero.checkpoint import write_consolidated; "
        f"write_consolidated({checkpoint!r}, {os.path.join(out, 'library.safetensors')!r})"
    )
    state_dict = f"from zero.checkpoint import consolidate; state = consolidate({checkpoint!r})"
    return {
        "zero zero-to-fp32 (command)": (
            [*command, checkpoint, os.path.join(out, "command.safetensors")],
            baseline,
        ),
        "zero write_consolidated() (library)": (python(library), baseline),
        "zero consolidate() (returns the state dict: the model once)": (
            python(state_dict),
            baseline,
        ),
    }


def outputs_agree(root: str) -> str:
    """Whether the command's, write_consolidated's and save_pretrained's files hold bitwise the
    same tensors (save_pretrained: the tied lm_head once)."""
    from safetensors.torch import load_file

    out = os.path.join(root, "out")
    command = load_file(os.path.join(out, "command.safetensors"))
    library = load_file(os.path.join(out, "library.safetensors"))
    pretrained = load_file(os.path.join(root, "pretrained", "model.safetensors"))
    same = command.keys() == library.keys() and set(pretrained) <= set(command)
    same = same and all(torch.equal(v, library[k]) for k, v in command.items())
    same = same and all(torch.equal(v, command[k]) for k, v in pretrained.items())
    return f"bitwise equal ({len(command)} tensors)" if same else "DIFFERENT"


def deepspeed_contestant(root: str) -> dict[str, tuple[list[str], list[str]]]:
    """DeepSpeed's command with its default output (torch.save of pytorch_model.bin):
    --safe_serialization refuses the GPT's tied lm_head (safetensors' shared-tensor check)."""
    out = os.path.join(root, "out", "deepspeed")
    command = [sys.executable, "-m", "deepspeed.utils.zero_to_fp32"]
    command += [os.path.join(root, "deepspeed"), out]
    return {"DeepSpeed zero_to_fp32 (its command)": (command, python(_DS_IMPORTS))}


_DS_IMPORTS = "import torch, deepspeed, deepspeed.utils.zero_to_fp32"


def measure_all(contestants: dict, period_s: float) -> dict[str, dict]:
    figures = {}
    baselines: dict[tuple, dict] = {}
    for label, (command, baseline) in contestants.items():
        if tuple(baseline) not in baselines:
            baselines[tuple(baseline)] = run_measured(baseline, period_s)
        base = baselines[tuple(baseline)]
        run = run_measured(command, period_s)
        run["base_hwm"], run["base_anon"] = base["hwm"], base["anon"]
        figures[label] = run
    return figures


# ----- report -----------------------------------------------------------------------------------
def model_sizes(args) -> dict:
    model = build_model(args)
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}.values()
    return {
        "bytes": sum(t.numel() * t.element_size() for t in tensors),
        "largest": max(t.numel() * t.element_size() for t in tensors),
        "numel": sum(t.numel() for t in tensors),
    }


def mib(value) -> str:
    return f"{value / MB:,.0f}"


def print_report(args, sizes: dict, figures: dict, save_pretrained: dict, skipped) -> None:
    model, largest = sizes["bytes"], sizes["largest"]
    bound = 1.5 * largest + OVERHEAD
    print(
        f"model: GPT n_layer={args.n_layer} n_embd={args.n_embd}: {sizes['numel']:,} elements, "
        f"{mib(model)} MiB fp32; largest tensor {mib(largest)} MiB; stage 3 on "
        f"{args.world_size} ranks, AdamW, one step; torch {torch.__version__}"
    )
    print(
        f"bound zero aims at above the import baseline: 1.5 x largest + 64 MiB = {mib(bound)} MiB"
    )
    if skipped:
        print(f"DeepSpeed: {skipped}")
    print()
    print(
        "| consolidation (fresh process) | peak RSS MiB | imports alone | consolidation's own "
        "| x model | peak private MiB | imports alone | consolidation's own | x largest | s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for label, f in figures.items():
        own_rss, own_anon = f["hwm"] - f["base_hwm"], f["anon"] - f["base_anon"]
        print(
            f"| {label} | {mib(f['hwm'])} | {mib(f['base_hwm'])} | {mib(own_rss)} "
            f"| {own_rss / model:.2f} | {mib(f['anon'])} | {mib(f['base_anon'])} "
            f"| {mib(own_anon)} | {own_anon / largest:.1f} | {f['s']:.1f} |"
        )
    if save_pretrained:
        print()
        print(
            f"engine.save_pretrained on rank 0 (in the training process): peak extra RSS "
            f"{mib(save_pretrained['save_pretrained_rss'])} MiB, of which anonymous "
            f"{mib(save_pretrained['save_pretrained_anon'])} MiB"
        )


def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU ranks; DeepSpeed needs its CPU backend
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    parent = args.dir or "/tmp"
    os.makedirs(parent, exist_ok=True)
    root = tempfile.mkdtemp(prefix="zero_consolidation_", dir=parent)
    os.makedirs(os.path.join(root, "out"))
    try:
        spawn = partial(mp.spawn, nprocs=args.world_size, join=True)
        spawn(zero_rank, args=(args, free_port(), root))
        contestants = zero_contestants(root)
        skipped = "--no_deepspeed" if args.no_deepspeed else deepspeed_error()
        if skipped is None:
            spawn(deepspeed_rank, args=(args, free_port(), root))
            contestants.update(deepspeed_contestant(root))
        figures = measure_all(contestants, args.sample_ms / 1000)
        save_pretrained = json.loads(Path(root, "save_pretrained.json").read_text())
        sizes = model_sizes(args)
        print_report(args, sizes, figures, save_pretrained, skipped)
        print(
            f"zero-to-fp32, write_consolidated and save_pretrained outputs: {outputs_agree(root)}"
        )
        if args.json:
            result = {"model": sizes, "figures": figures, "save_pretrained": save_pretrained}
            Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
