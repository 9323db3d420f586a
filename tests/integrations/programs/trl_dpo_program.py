"""A TRL DPOTrainer program with a reference model, as users write it for DeepSpeed, with nothing
of zero in it.

    [zero-as-deepspeed] torchrun --nproc_per_node 2 trl_dpo_program.py --model_dir M \
        --output_dir OUT --deepspeed ds_config.json --max_steps 2 --use_cpu

The policy and the reference model are two copies of `--model_dir`; TRL prepares the reference
as a second DeepSpeed engine (inference, stage 3 when the policy's is). Preference pairs of
word-level text (a tokenizer built here: nothing is downloaded). Saves the policy with
trainer.save_model(OUT/final) and writes the training losses to OUT/result.json (rank 0).
"""

import json
import os
from dataclasses import dataclass, field

import torch
from datasets import Dataset
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import AutoModelForCausalLM, HfArgumentParser, PreTrainedTokenizerFast
from trl import DPOConfig, DPOTrainer


@dataclass
class ProgramArguments:
    model_dir: str = field(metadata={"help": "a save_pretrained directory"})
    num_samples: int = 16


def tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    words = Tokenizer(WordLevel(vocab={f"t{i}": i for i in range(vocab_size)}, unk_token="t1"))
    words.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=words, pad_token="t0", eos_token="t2", unk_token="t1"
    )


def pairs(num_samples: int, vocab_size: int) -> Dataset:
    g = torch.Generator().manual_seed(0)

    def text(n):
        return " ".join(f"t{i}" for i in torch.randint(3, vocab_size, (n,), generator=g).tolist())

    rows = [{"prompt": text(6), "chosen": text(4), "rejected": text(4)} for _ in range(num_samples)]
    return Dataset.from_list(rows)


def main():
    program, args = HfArgumentParser((ProgramArguments, DPOConfig)).parse_args_into_dataclasses()
    model = AutoModelForCausalLM.from_pretrained(program.model_dir, dtype=torch.float32)
    ref_model = AutoModelForCausalLM.from_pretrained(program.model_dir, dtype=torch.float32)
    vocab = model.config.vocab_size
    trainer = DPOTrainer(
        model=model,
        ref_model=ref_model,
        args=args,
        train_dataset=pairs(program.num_samples, vocab),
        processing_class=tokenizer(vocab),
    )
    trainer.train()
    trainer.save_model(os.path.join(args.output_dir, "final"))
    if trainer.is_world_process_zero():
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        with open(os.path.join(args.output_dir, "result.json"), "w") as handle:
            json.dump({"losses": losses, "step": trainer.state.global_step}, handle)


if __name__ == "__main__":
    main()
