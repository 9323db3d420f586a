"""A TRL SFTTrainer program as users write it for DeepSpeed, with nothing of zero in it.

    [zero-as-deepspeed] torchrun --nproc_per_node 2 trl_sft_program.py --model_dir M \
        --output_dir OUT --deepspeed ds_config.json --max_steps 3 --use_cpu

Fine-tunes a causal LM from `--model_dir` with trl.SFTTrainer (its default loss: the fused,
chunked LM head, a custom autograd Function over `lm_head.weight`) on fixed pre-tokenized
sequences, saves the model with trainer.save_model(OUT/final) and writes the training losses to
OUT/result.json (rank 0). The tokenizer is a word-level one built here (nothing is downloaded).
"""

import json
import os
from dataclasses import dataclass, field

import torch
from datasets import Dataset
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import AutoModelForCausalLM, HfArgumentParser, PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer


@dataclass
class ProgramArguments:
    model_dir: str = field(metadata={"help": "a save_pretrained directory"})
    num_samples: int = 32
    seq_len: int = 16


def tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    vocab = {f"t{i}": i for i in range(vocab_size)}
    words = Tokenizer(WordLevel(vocab=vocab, unk_token="t1"))
    return PreTrainedTokenizerFast(
        tokenizer_object=words, pad_token="t0", eos_token="t2", unk_token="t1"
    )


def main():
    program, args = HfArgumentParser((ProgramArguments, SFTConfig)).parse_args_into_dataclasses()
    model = AutoModelForCausalLM.from_pretrained(program.model_dir, dtype=torch.float32)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (program.num_samples, program.seq_len), generator=g)
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_dict({"input_ids": ids.tolist()}),
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
