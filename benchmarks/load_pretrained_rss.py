r"""Loading and training a Hugging Face checkpoint larger than what any one rank may hold: peak
memory per rank.

    python benchmarks/load_pretrained_rss.py --hidden 1024 --layers 24 --world_size 2 \
        --cap_mib 1100 --train_steps 3 --lora 8

A Llama checkpoint (vocab 32000, the given width and depth, random values) is written once in
safetensors shards of 500 MB (streamed by zero's own writer, so this process never holds it).
Then, in fresh gloo groups of --world_size CPU ranks whose private writable memory is capped with
RLIMIT_DATA at --cap_mib (as `ulimit -d` in docs/examples.md; it counts every tensor, not the
file pages safetensors maps), each way of loading runs once:

- from_pretrained: `with zero.Init(config): AutoModelForCausalLM.from_pretrained(dir)`
  (transformers builds on the meta device; each loaded tensor is partitioned as it is assigned);
- load_pretrained: the model built under zero.Init from its config, then
  zero.load_pretrained(model, dir) (each rank reads only its slice of each tensor);
- control: an ordinary from_pretrained in one process under the same cap, which must fail when
  the full fp32 weights exceed the cap.

Then (--train_steps, both zero modes) the loaded model trains in the same process and under the
same cap: zero.initialize at stage 3 (AdamW; with --lora R, peft's LoRA adapters of rank R on
the attention projections, the base frozen and partitioned), --train_steps steps on one fixed
batch of 32 tokens, whose losses are printed (they fall: it trains). Full fine-tuning (--lora 0)
holds 16 Psi / N bytes of model states per rank, below the fp32 weights (4 Psi) only from N = 5.

Per rank and phase (load: the zero.Init construction and the load; train: initialize and the
steps) it prints how far each field of /proc/self/status rose above its value after a warm-up
(the model's code imported, a tiny model of the same class built, run and trained by zero), at
its peak (sampled every 5 ms), in MiB: RssAnon (private resident memory: tensors, the heap),
VmData (what RLIMIT_DATA limits, set right after the warm-up), VmRSS (also the checkpoint's file
pages that safetensors maps), and the bytes of parameters the rank holds after loading.
MALLOC_MMAP_THRESHOLD_=65536 and MALLOC_ARENA_MAX=2 make glibc return freed tensors at once
(see docs/examples.md).

Linux only (/proc, RLIMIT_DATA). A measurement script, not a test.
"""

import argparse
import os
import re
import resource
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import free_port, init_rank  # noqa: E402

import zero  # noqa: E402
import zero.hf  # noqa: E402, F401  (code, imported before the baseline)

MIB = 2**20
MODES = ("from_pretrained", "load_pretrained", "control")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--world_size", type=int, default=2)
    parser.add_argument("--cap_mib", type=int, default=1400, help="RLIMIT_DATA per rank, MiB")
    parser.add_argument("--dir", default=None, help="checkpoint directory (default: a temp dir)")
    parser.add_argument("--shard_mib", type=int, default=200, help="checkpoint file size, MiB")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument(
        "--dtype", default="fp32", choices=("fp32", "bf16"), help="from_pretrained(dtype=...)"
    )
    parser.add_argument("--train_steps", type=int, default=3, help="0: load only")
    parser.add_argument("--lora", type=int, default=8, help="LoRA rank; 0: full fine-tuning")
    return parser.parse_args(argv)


def llama_config(args):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=32000,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 64,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )


def write_checkpoint(args, directory: str) -> int:
    """Random weights in HF's layout, one tensor at a time. Returns the number of parameters."""
    from transformers import AutoModelForCausalLM

    from zero.checkpoint.safetensors_io import ShardedWriter

    config = llama_config(args)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    named = list(model.named_parameters())
    if not os.path.isfile(os.path.join(directory, "config.json")):
        entries = [(n, tuple(p.shape), torch.float32) for n, p in named]
        writer = ShardedWriter(directory, entries, args.shard_mib * MIB)
        g = torch.Generator().manual_seed(0)
        for name, param in named:
            value = torch.randn(param.shape, generator=g) * 0.02
            writer.write(name, torch.ones(param.shape) if name.endswith("norm.weight") else value)
        writer.close()
        config.save_pretrained(directory)
    return sum(p.numel() for _, p in named)


FIELDS = ("RssAnon", "VmData", "VmRSS")


class Sampler:
    """Peaks of /proc/self/status fields, sampled every 5 ms on a thread."""

    FIELDS = FIELDS

    def __init__(self):
        self.peaks = dict.fromkeys(self.FIELDS, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            for key, value in status(self.FIELDS).items():
                self.peaks[key] = max(self.peaks[key], value)
            time.sleep(0.005)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        for key, value in status(self.FIELDS).items():
            self.peaks[key] = max(self.peaks[key], value)


def status(keys) -> dict:
    text = Path("/proc/self/status").read_text()
    return {k: int(re.search(rf"{k}:\s+(\d+) kB", text).group(1)) * 1024 for k in keys}


def config_for() -> dict:
    """Stage 3 with fetch units of about one decoder layer, nothing prefetched: what a rank
    holds gathered at once stays one unit (the embeddings and the head are units of their own)."""
    return {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": 2e7,
            "allgather_bucket_size": 2e7,
            "stage3_module_granularity_threshold": 2e7,
            "stage3_prefetch_bucket_size": 0,
        },
        "agreement_timeout": 120,  # a rank that failed under the cap stops the others
    }


def load(mode: str, directory: str, dtype):
    """Build and load the model one way; returns (model, bytes of parameters this rank holds)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(directory)
    if mode == "control":  # an ordinary construction: every tensor in private memory
        model = AutoModelForCausalLM.from_config(config)
        return model, sum(p.numel() * p.element_size() for p in model.parameters())
    if mode == "from_pretrained":  # a cast to bf16 makes a private copy of each tensor
        with zero.Init(config=config_for()):
            model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
    else:  # built partitioned (random values), then each rank reads its slices
        with zero.Init(config=config_for()):
            model = AutoModelForCausalLM.from_config(config)
        zero.load_pretrained(model, directory)
    return model, sum(p.zero_shard.data.numel() * p.element_size() for p in model.parameters())


def train(model, steps: int, lora: int) -> list[float]:
    """`steps` stage-3 steps on one fixed batch (LoRA adapters of rank `lora`, or the whole
    model); returns the losses."""
    if lora:
        from peft import LoraConfig, get_peft_model

        targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
        model = get_peft_model(model, LoraConfig(r=lora, target_modules=targets))
    engine, *_ = zero.initialize(model=model, config=config_for())
    vocab = model.config.vocab_size
    x = torch.randint(vocab, (1, 32), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(steps):
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def warm_up(directory: str, lora: int) -> None:
    """Import the model's code, build a tiny model of the same class and train it once with
    zero (the code and allocator state every run has), so the growth measured is the model's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(directory)
    config.update({"hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 1})
    config.update({"num_attention_heads": 1, "num_key_value_heads": 1, "vocab_size": 128})
    with zero.Init(config=config_for()):
        model = AutoModelForCausalLM.from_config(config)
    train(model, 1, lora)
    model = AutoModelForCausalLM.from_config(config)
    model(input_ids=torch.zeros(1, 4, dtype=torch.long))


def worker(rank: int, mode: str, directory: str, world_size: int, cap, args, port, results):
    """Build, load and train under RLIMIT_DATA = VmData after the warm-up + cap; report each
    field's peak growth per phase."""
    if world_size > 1:
        init_rank(rank, world_size, port)
    warm_up(directory, args.lora)
    baseline = status(FIELDS)
    if cap is not None:
        resource.setrlimit(resource.RLIMIT_DATA, (baseline["VmData"] + cap,) * 2)
    row = {"rank": rank, "result": "ok", "held": 0, "load": {}, "train": {}, "losses": []}
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    try:
        with Sampler() as loading:
            model, row["held"] = load(mode, directory, dtype)
        row["load"] = {k: loading.peaks[k] - baseline[k] for k in FIELDS}
        if mode != "control" and args.train_steps:
            with Sampler() as training:
                row["losses"] = train(model, args.train_steps, args.lora)
            row["train"] = {k: training.peaks[k] - baseline[k] for k in FIELDS}
    except (MemoryError, RuntimeError) as error:
        traceback.print_exc()
        row["result"] = f"failed: {type(error).__name__}: {str(error)[:60]}"
    results.put(row)
    if world_size > 1:
        dist.destroy_process_group()


def run(mode: str, directory: str, world_size: int, cap, args) -> list:
    results = mp.get_context("spawn").SimpleQueue()
    port = free_port()
    spawn_args = (mode, directory, world_size, cap, args, port, results)
    mp.spawn(worker, args=spawn_args, nprocs=world_size, join=True)
    return sorted((results.get() for _ in range(world_size)), key=lambda row: row["rank"])


def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    os.environ.setdefault("MALLOC_ARENA_MAX", "2")
    directory = args.dir or tempfile.mkdtemp(prefix="zero-hf-")
    os.makedirs(directory, exist_ok=True)
    psi = write_checkpoint(args, directory)
    cap = args.cap_mib * MIB
    print(
        f"Llama {args.hidden}x{args.layers}, vocab 32000: Psi = {psi:,} parameters, fp32 "
        f"weights {4 * psi / MIB:.0f} MiB; RLIMIT_DATA {args.cap_mib} MiB per rank; "
        f"{args.world_size} gloo ranks; checkpoint {directory}"
    )
    print(
        "| mode | rank | result | load: RssAnon | VmData | VmRSS | weights held "
        "| train: RssAnon | VmData | VmRSS | losses |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for mode in args.modes.split(","):
        world = args.world_size if mode in ("from_pretrained", "load_pretrained") else 1
        for row in run(mode, directory, world, cap, args):
            load = " | ".join(f"{row['load'].get(k, 0) / MIB:.0f}" for k in FIELDS)
            trained = " | ".join(f"{row['train'][k] / MIB:.0f}" for k in FIELDS if row["train"])
            losses = ", ".join(f"{loss:.3f}" for loss in row["losses"])
            print(
                f"| {mode} | {row['rank']} | {row['result']} | {load} | "
                f"{row['held'] / MIB:.0f} | {trained or ' |  | '} | {losses} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
