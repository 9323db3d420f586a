"""Fine-tune a Hugging Face causal language model on a text file with zero.

Without a download (a tiny Llama is created first, tokens are bytes, the text is Python's own
standard library source):
    zrun --num_gpus 2 examples/finetune_hf.py --init-tiny llama --config configs/zero3.json
A local checkpoint directory (config.json + safetensors weights, a tokenizer if it has one):
    zrun --hostfile examples/hosts examples/finetune_hf.py --model DIR --data FILE \
        --config configs/zero3.json [--lora 8] [--gradient_checkpointing]

At stage 3 the model is loaded inside zero.Init, so each rank keeps only its slices of the
weights (docs/hf.md). At the end every rank calls engine.save_pretrained(OUT/model) (with --lora
the adapters are merged into the weights on rank 0), and rank 0 checks that
AutoModelForCausalLM.from_pretrained(OUT/model) gives the trained engine's logits.
Batch size, optimizer, lr schedule, precision and ZeRO stage come from the config.
"""

import argparse
import os

import torch
import torch.distributed as dist
from data import load_corpus
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import zero

TINY = {  # a few hundred thousand parameters; vocabulary 256: the tokens are bytes
    "llama": {"intermediate_size": 128, "num_key_value_heads": 2},
    "qwen2": {"intermediate_size": 128, "num_key_value_heads": 2},
    "mixtral": {"intermediate_size": 64, "num_key_value_heads": 2, "num_local_experts": 4},
    "gpt2": {"bos_token_id": 0, "eos_token_id": 0},
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Fine-tune a Hugging Face model with zero.")
    parser.add_argument("--config", required=True, help="zero config (json, hjson or yaml)")
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--model", help="local Hugging Face checkpoint directory")
    model.add_argument("--init-tiny", choices=sorted(TINY), help="create a tiny model first")
    parser.add_argument("--data", default=None, help="text file (default: Python stdlib source)")
    parser.add_argument("--out", default="finetune_out", help="output directory")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps")
    parser.add_argument("--block_size", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--lora", type=int, default=0, help="LoRA rank (0: full fine-tuning)")
    parser.add_argument("--gradient_checkpointing", action="store_true")
    parser.add_argument("--eval_batches", type=int, default=4, help="val micro-batches per rank")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--local_rank", type=int, default=-1, help="ignored (launchers pass it)")
    return parser.parse_args()


def log(*lines: str) -> None:
    if dist.get_rank() == 0:
        print(*lines, sep="\n", flush=True)


def create_tiny(family: str, directory: str) -> str:
    """Rank 0 writes a randomly initialized tiny model (config.json + model.safetensors)."""
    if dist.get_rank() == 0 and not os.path.isfile(os.path.join(directory, "config.json")):
        sizes = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
        config = AutoConfig.for_model(
            family, vocab_size=256, max_position_embeddings=512, **sizes, **TINY[family]
        )
        AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    dist.barrier()  # the other ranks read it next (across nodes: --out on a shared file system)
    return directory


class TextBlocks:
    """The text's tokens cut into consecutive blocks of block_size: the first 90% for training,
    the rest held out. A short last block is padded (attention_mask 0, labels -100)."""

    def __init__(self, ids: torch.Tensor, block_size: int, pad_id: int, seed: int, rank: int):
        split = int(len(ids) * 0.9)
        parts = {"train": ids[:split], "val": ids[split:]}
        self.splits = {name: self._cut(part, block_size, pad_id) for name, part in parts.items()}
        self.generator = torch.Generator().manual_seed(seed * 1000 + rank)  # per-rank stream

    @staticmethod
    def _cut(ids, block_size, pad_id) -> tuple[torch.Tensor, torch.Tensor]:
        padded = torch.full((-(-len(ids) // block_size) * block_size,), pad_id)
        padded[: len(ids)] = ids
        mask = torch.zeros_like(padded)
        mask[: len(ids)] = 1
        return padded.view(-1, block_size), mask.view(-1, block_size)

    def batch(self, split: str, size: int, index: int | None = None) -> dict:
        """`size` random training blocks, or the index-th group of `size` held-out blocks."""
        ids, mask = self.splits[split]
        if index is None:
            rows = torch.randint(len(ids), (size,), generator=self.generator)
        else:
            rows = (torch.arange(size) + index * size) % len(ids)
        labels = ids[rows].masked_fill(mask[rows] == 0, -100)  # the model shifts them itself
        return {"input_ids": ids[rows], "attention_mask": mask[rows], "labels": labels}


def load_tokens(args, model_dir: str):
    """(token ids, pad id, tokenizer or None, description): the checkpoint's tokenizer, or the
    text's bytes as token ids."""
    raw, corpus = load_corpus(args.data)
    if any(os.path.isfile(os.path.join(model_dir, f)) for f in TOKENIZER_FILES):
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        ids = tokenizer(raw.decode("utf-8", errors="replace"), verbose=False)["input_ids"]
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        return torch.tensor(ids), pad, tokenizer, f"{corpus}, tokenizer of {model_dir}"
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    if vocab < 256:
        raise ValueError(f"{model_dir} has no tokenizer and a vocabulary of {vocab} < 256 bytes")
    ids = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
    return ids, 0, None, f"{corpus}, bytes as tokens"


def build_model(args, model_dir: str, stage: int):
    """from_pretrained (inside zero.Init at stage 3), then the changes that decide what trains."""
    with zero.Init(config=args.config, enabled=stage == 3):  # each rank keeps its slices
        # fp32 whatever the files hold: the config's precision decides the compute dtype
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    experts = {type(m) for m in model.modules() if type(m).__name__.endswith("SparseMoeBlock")}
    if experts:  # routed experts: one stage-3 unit, so ranks never gather different experts
        zero.utils.set_z3_leaf_modules(model, list(experts))
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = None
    if args.lora:
        from peft import LoraConfig, get_peft_model

        targets = lora_targets(model, stage)
        lora = LoraConfig(r=args.lora, lora_alpha=2 * args.lora, target_modules=targets)
        model = get_peft_model(model, lora)  # base frozen; the adapters are what zero trains
    return model, lora


def lora_targets(model, stage: int):
    """peft's "all-linear"; at stage 3 the nn.Linear layers only: peft takes their sizes from
    in_features/out_features, but those of GPT-2's Conv1D and of stacked experts from the
    weight, which zero.Init has replaced by a 0-element placeholder."""
    if stage < 3:
        return "all-linear"
    head = model.get_output_embeddings()
    linear = {
        name.rsplit(".", 1)[-1]
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and module is not head
    }
    if not linear:
        raise NotImplementedError(
            f"--lora at stage 3: {type(model).__name__} has no nn.Linear layers for peft to "
            "adapt while zero.Init holds it partitioned; use a stage 0-2 config"
        )
    return sorted(linear)


@torch.no_grad()
def evaluate(engine, data: TextBlocks, num_batches: int) -> float:
    """Mean held-out loss over num_batches micro-batches on every rank (all ranks' blocks)."""
    engine.eval()
    micro = engine.config.train_micro_batch_size_per_gpu
    total = torch.zeros(1)
    for i in range(num_batches):
        batch = data.batch("val", micro, index=i * engine.world_size + engine.rank)
        total += engine(**batch).loss.float().cpu()
    dist.all_reduce(total)
    engine.train()
    return total.item() / (num_batches * engine.world_size)


def train(engine, data: TextBlocks, steps: int) -> float:
    """`steps` optimizer steps; prints rank 0's mean loss every steps_per_print steps."""
    micro = engine.config.train_micro_batch_size_per_gpu
    losses = []
    engine.train()  # from_pretrained returns the model in eval mode
    for step in range(1, steps + 1):
        for _ in range(engine.config.gradient_accumulation_steps):
            loss = engine(**data.batch("train", micro)).loss
            engine.backward(loss)
            engine.step()  # acts only at the accumulation boundary
            losses.append(loss.detach().float())
        if step % engine.config.steps_per_print == 0 or step == steps:
            train_loss = torch.stack(losses).mean().item()
            log(f"step {step:>5} | loss {train_loss:.4f} | lr {engine.get_lr()[0]:.3e}")
            losses = []
    return train_loss


def export(engine, model_dir: str, lora, out: str) -> None:
    """Write OUT in Hugging Face's layout. Every rank calls engine.save_pretrained: the fp32
    master weights are all-gathered one bucket at a time and rank 0 streams them to disk."""
    if lora is None:
        engine.save_pretrained(out)
        return
    # LoRA: the peft model as trained (base + adapters, peft's names), then merged on rank 0
    # into a plain copy: W + B A * alpha / r. engine.module itself stays as zero laid it out.
    unmerged = engine.save_pretrained(out + "-lora-unmerged")
    if engine.rank == 0:
        from peft import get_peft_model

        copy = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), lora)
        zero.load_pretrained(copy, unmerged)
        copy.merge_and_unload().save_pretrained(out)
    dist.barrier()


@torch.no_grad()
def check_export(engine, data: TextBlocks, out: str) -> float:
    """Max |logits difference| between from_pretrained(out) on rank 0 and the engine (every
    rank runs the engine's forward: a collective at stage 3)."""
    engine.eval()
    batch = data.batch("val", engine.config.train_micro_batch_size_per_gpu, index=0)
    logits = engine(**batch).logits.float().cpu()
    if engine.rank != 0:
        return float("nan")
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=engine.config.compute_dtype)
    return (reloaded(**batch).logits.float() - logits).abs().max().item()


def main() -> None:
    args = parse_args()
    zero.init_distributed(verbose=False)
    torch.manual_seed(args.seed)  # same LoRA adapters on every rank
    model_dir = args.model or create_tiny(
        args.init_tiny, os.path.join(args.out, "tiny-" + args.init_tiny)
    )
    stage = zero.load_config(args.config, world_size=dist.get_world_size()).zero.stage
    model, lora = build_model(args, model_dir, stage)
    num_params = sum(zero.init.full_shape(p).numel() for p in model.parameters())
    trainable = sum(zero.init.full_shape(p).numel() for p in model.parameters() if p.requires_grad)
    engine, _, _, _ = zero.initialize(args=args, model=model, config=args.config)

    ids, pad_id, tokenizer, tokens = load_tokens(args, model_dir)
    data = TextBlocks(ids, args.block_size, pad_id, args.seed, engine.rank)
    log(
        f"world size {engine.world_size}, stage {stage}, device {engine.device}, "
        f"compute dtype {engine.config.compute_dtype}",
        f"model: {model_dir}, {num_params:,} parameters, {trainable:,} trained"
        + (f" (LoRA r={args.lora})" if lora else "")
        + (", loaded partitioned (zero.Init)" if stage == 3 else ""),
        f"data: {tokens}: {len(ids):,} tokens, blocks of {args.block_size} "
        f"(train {len(data.splits['train'][0]):,}, val {len(data.splits['val'][0]):,})",
    )
    val_before = evaluate(engine, data, args.eval_batches)
    log(f"val loss before training {val_before:.4f}")
    train_loss = train(engine, data, args.steps)
    val_loss = evaluate(engine, data, args.eval_batches)
    log(f"val loss {val_loss:.4f} (before training {val_before:.4f})")

    out = os.path.join(args.out, "model")
    export(engine, model_dir, lora, out)
    if tokenizer is not None and engine.rank == 0:
        tokenizer.save_pretrained(out)
    diff = check_export(engine, data, out)
    log(
        f"saved {out}" + (" (LoRA merged)" if lora else "") + ": from_pretrained logits vs the "
        f"trained engine's: max abs difference {diff:.3g}",
        f"final: train_loss={train_loss:.4f} val_loss_before={val_before:.4f} "
        f"val_loss={val_loss:.4f} logits_max_diff={diff:.3g}",
    )
    zero.comm.destroy_process_group()  # a barrier first: every rank exits cleanly


if __name__ == "__main__":
    main()
