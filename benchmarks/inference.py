r"""Generation with a model larger than a rank's memory: ZeRO-Inference at stage 3.

    python benchmarks/inference.py --world_size 2 --new_tokens 32

A Llama (transformers' LlamaForCausalLM, random weights from a fixed seed, fp32) is written once
with save_pretrained; then each system generates greedily from it in fresh processes:

- `plain`: one process, the whole model, no cap (the reference tokens and speed);
- `zero3_offload`: --world_size ranks, `from_pretrained` inside `zero.Init`, then
  `zero.initialize(model=..., config=...)` without an optimizer (stage 3, `offload_param: cpu`)
  and `engine.generate(...)`;
- `ds3_offload` (when deepspeed imports): the same config through DeepSpeed's own ZeRO-Inference
  path: `HfDeepSpeedConfig` so that `from_pretrained` builds under `deepspeed.zero.Init`, then
  `deepspeed.initialize(model=..., config=...)` without an optimizer and
  `engine.module.generate(..., synced_gpus=True)`.

Each rank generates --batch prompts of its own (different per rank; greedy, exactly
--new_tokens steps); `plain` generates every rank's prompts as one batch, and each rank's tokens
are compared with `plain`'s for the same prompts.

The cap is set as in benchmarks/largest_model.py: after imports, the process group and a one-
token generation of a 1-layer model of the same system (threads, kernels and caches of a first
forward), a rank reads its VmData (private writable memory, what RLIMIT_DATA counts) and calls
setrlimit(RLIMIT_DATA, baseline + M) before it loads the model; M defaults to --cap_fraction
(0.85) of the model's fp32 bytes, so no rank may hold the model. On a CPU-only machine
`offload_param: cpu` keeps the shards in the same process's memory, so the cap sees them: what
this shows is that the model generates although a rank cannot hold it.

DeepSpeed's loading maps the whole file as private memory (transformers' from_pretrained, as
safetensors' safe_open does), which the cap refuses, so the `ds3_offload` row loads without
the cap and sets it (the same baseline + M) before it generates: its peak counts generation
only. zero's `zero.load_pretrained` reads each rank's slices with positioned reads and loads
under the cap.

With --uncapped 1 (the default) each distributed system also runs without the cap, so that
tokens/s compare where a system does not fit under it. Reported per system: tokens/s (new tokens
of every rank / wall time of generate(), the slowest rank), time per generation step, peak RSS
(VmHWM) and peak VmData over the baseline per rank, and whether the tokens equal `plain`'s.
Results: docs/performance.md.
"""

import argparse
import json
import os
import resource
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import run_spawned, status_bytes  # noqa: E402

SYSTEMS = ("plain", "zero3_offload", "ds3_offload")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world_size", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=2, help="prompts per rank")
    parser.add_argument("--prompt_len", type=int, default=16)
    parser.add_argument("--new_tokens", type=int, default=32)
    parser.add_argument(
        "--cap_fraction", type=float, default=0.85, help="M as a fraction of the fp32 model"
    )
    parser.add_argument("--cap_mib", type=int, default=0, help="M in MiB (overrides the fraction)")
    parser.add_argument(
        "--uncapped",
        type=int,
        default=1,
        help="also run each distributed system without the cap (1) or not (0): tokens/s where "
        "a system does not fit under it",
    )
    parser.add_argument("--timeout", type=float, default=900, help="seconds per system")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    args = parser.parse_args(argv)
    args.systems = [s for s in args.systems.split(",") if s]
    unknown = sorted(set(args.systems) - set(SYSTEMS))
    if unknown:
        parser.error(f"--systems: unknown {unknown}; choose from {', '.join(SYSTEMS)}")
    return args


def llama_config(args, layers: int | None = None):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=layers or args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=args.prompt_len + args.new_tokens + 8,
        tie_word_embeddings=False,
    )


def write_model(args, path: str, layers: int | None = None) -> int:
    """Save the seeded fp32 Llama to `path`; returns its parameter count."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(args, layers))
    with torch.no_grad():  # weights far from the init's small values: varied greedy tokens
        generator = torch.Generator().manual_seed(1)
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    model.save_pretrained(path, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def prompts(args, rank: int):
    import torch

    generator = torch.Generator().manual_seed(100 + rank)
    return torch.randint(3, args.vocab, (args.batch, args.prompt_len), generator=generator)


def zero_config(args) -> dict:
    return {
        "train_micro_batch_size_per_gpu": args.batch,
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}},
    }


class Peak:
    """Peak VmData, sampled by a thread every 5 ms (RLIMIT_DATA holds it under the cap; this
    says how close it came)."""

    def __init__(self):
        import threading

        self.value, self._stop = status_bytes("VmData"), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(0.005):
            self.value = max(self.value, status_bytes("VmData"))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.value, status_bytes("VmData"))


def load(system: str, args, path: str, layers: int | None = None):
    """The model of `system` loaded from `path`; returns (generate callable, keep-alive)."""
    import torch
    from transformers import LlamaForCausalLM

    greedy = {"max_new_tokens": args.new_tokens, "min_new_tokens": args.new_tokens}
    greedy.update(do_sample=False, pad_token_id=0)
    if system == "plain":
        model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return (lambda ids: model.generate(ids, **greedy)), model
    if system == "zero3_offload":
        import zero

        config = zero_config(args)
        with zero.Init(config=config):  # each rank keeps its slices
            model = LlamaForCausalLM(llama_config(args, layers))
        engine, *_ = zero.initialize(model=model, config=config)
        zero.load_pretrained(engine, path)  # one tensor at a time, each rank its own part
        engine.eval()
        return (lambda ids: engine.generate(ids, **greedy)), engine
    import deepspeed
    from transformers.integrations import HfDeepSpeedConfig

    config = zero_config(args)
    keep = HfDeepSpeedConfig(config)  # from_pretrained builds under deepspeed.zero.Init
    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.module.eval()
    return (lambda ids: engine.module.generate(ids, synced_gpus=True, **greedy)), (engine, keep)


def run_rank(rank: int, world_size: int, port: int, spec: dict, results) -> None:
    """One rank: imports, process group, a warm generation, the cap, load, timed generate."""
    os.environ.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
    import torch
    import torch.distributed as dist
    from _common import init_rank

    args, system = argparse.Namespace(**spec["args"]), spec["system"]
    if system == "plain":
        torch.set_num_threads(1)
    else:
        init_rank(rank, world_size, port, "cpu", threads=1)
    try:
        ids = prompts(args, rank)
        if system == "plain":  # one process generates every rank's prompts, as one batch
            ids = torch.cat([prompts(args, r) for r in range(args.world_size)])
        warm, keep = load(
            system,
            argparse.Namespace(**{**spec["args"], "new_tokens": 1}),
            spec["warm"],
            layers=1,
        )
        warm(ids[:1, :4])
        del warm, keep
        import gc

        gc.collect()
        baseline = status_bytes("VmData")
        results.put((rank, "started", baseline))  # the queue's feeder thread exists before the cap
        cap = (baseline + spec["cap"], resource.RLIM_INFINITY)
        if spec["cap"] and system != "ds3_offload":
            resource.setrlimit(resource.RLIMIT_DATA, cap)
        peak = Peak()
        generate, keep = load(system, args, spec["path"])
        if spec["cap"] and system == "ds3_offload":  # see the module's docstring
            peak.stop()
            peak = Peak()
            resource.setrlimit(resource.RLIMIT_DATA, cap)
        if world_size > 1:
            dist.barrier()
        start = time.perf_counter()
        tokens = generate(ids)
        seconds = time.perf_counter() - start
        vmdata = peak.stop()
        results.put(
            (
                rank,
                "ok",
                {
                    "seconds": seconds,
                    "new": tokens[:, ids.shape[1] :].tolist(),
                    "vmdata_peak": vmdata - baseline,
                    "rss_peak": status_bytes("VmHWM"),
                    "baseline": baseline,
                },
            )
        )
        if world_size > 1:
            dist.barrier()
    except BaseException as exc:
        traceback.print_exc()
        text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        where = traceback.extract_tb(exc.__traceback__)[-2:]
        frames = "; ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in where)
        results.put((rank, "error", f"{frames}: {text[:600]}"))
        results.close()
        results.join_thread()
        os._exit(1)  # a peer may be waiting in a collective
    if world_size > 1:
        dist.destroy_process_group()


def run_system(args, system: str, path: str, warm: str, cap: int) -> tuple[str, object]:
    """("ok", {rank: result}) or (failure kind, message); `cap`: M in bytes, 0 for none."""
    world_size = 1 if system == "plain" else args.world_size
    spec = {
        "system": system,
        "args": vars(args),
        "path": path,
        "warm": warm,
        "cap": cap,
    }
    # Freed tensors go back to the kernel at once (no heap high-water mark), so the cap sees
    # live memory; the spawned ranks inherit this environment (as in largest_model.py).
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    stack = 1024 * 1024  # see largest_model.py
    outcome, seen = run_spawned(run_rank, world_size, spec, args.timeout, stack, join_s=30)
    return outcome or ("ok", seen)


def main(argv=None) -> None:
    args = parse_args(argv)
    if "ds3_offload" in args.systems:
        try:
            import deepspeed  # noqa: F401
        except Exception as exc:
            print(f"skipped ds3_offload: deepspeed does not import ({exc})")
            args.systems.remove("ds3_offload")
    with tempfile.TemporaryDirectory() as tmp:
        path, warm = os.path.join(tmp, "model"), os.path.join(tmp, "warm")
        psi = write_model(args, path)
        write_model(args, warm, layers=1)
        model_bytes = 4 * psi
        cap = args.cap_mib * 2**20 or int(args.cap_fraction * model_bytes)
        rows = {}
        for system in args.systems:
            caps = [(system, 0)] if system == "plain" else [(system, cap)]
            if system != "plain" and args.uncapped:
                caps.append((f"{system}, no cap", 0))
            for name, limit in caps:
                rows[name] = run_system(args, system, path, warm, limit)
                print(f"{name}: {rows[name][0]}", flush=True)
    report(args, psi, cap, rows)


def report(args, psi: int, cap: int, rows: dict) -> None:
    model_mib = 4 * psi / 2**20
    print(
        f"\nLlama {args.layers} x {args.hidden} (intermediate {args.intermediate}, vocab "
        f"{args.vocab}), Psi = {psi / 1e6:.1f}M, fp32 model {model_mib:.0f} MiB; "
        f"{args.world_size} gloo ranks, one thread each; cap M = {cap / 2**20:.0f} MiB per rank "
        f"over the baseline (RLIMIT_DATA); {args.batch} prompts of {args.prompt_len} tokens per "
        f"rank, {args.new_tokens} new tokens (greedy); load average {os.getloadavg()[0]:.2f}\n"
    )
    print(
        "| system | ranks | tokens/s | s per step | peak VmData over baseline MiB (max rank) "
        "| peak RSS MiB (max rank) | under cap | tokens equal plain |"
    )
    print("|---|---|---|---|---|---|---|---|")
    reference = rows.get("plain")
    for system, (kind, info) in rows.items():
        if kind != "ok":
            print(f"| {system} | | {kind}: {str(info)[:160]} | | | | | |")
            continue
        seconds = max(r["seconds"] for r in info.values())
        new = sum(len(row) for r in info.values() for row in r["new"])
        vmdata = max(r["vmdata_peak"] for r in info.values())
        rss = max(r["rss_peak"] for r in info.values())
        equal = "-"
        if system != "plain" and reference is not None and reference[0] == "ok":
            tokens = reference[1][0]["new"]
            same = all(
                info[r]["new"] == tokens[r * args.batch : (r + 1) * args.batch] for r in info
            )
            equal = "yes" if same else "NO"
        capped = system != "plain" and not system.endswith("no cap")
        under = "yes" if capped and vmdata <= cap else "NO" if capped else "-"
        print(
            f"| {system} | {len(info)} | {new / seconds:.1f} | {seconds / args.new_tokens:.3f} "
            f"| {vmdata / 2**20:.0f} | {rss / 2**20:.0f} | {under} | {equal} |"
        )
    print(json.dumps({s: r[0] for s, r in rows.items()}))


if __name__ == "__main__":
    main()
