"""A Hugging Face Trainer program as users write it for DeepSpeed, with nothing of zero in it.

    zero-as-deepspeed torchrun --nproc_per_node 2 trainer_program.py --model_dir M \
        --output_dir OUT --deepspeed ds_config.json --max_steps 4 --save_steps 2

Trains a causal LM from `--model_dir` on fixed random token sequences, evaluates, saves the model
and writes the training losses and final weights' checksum to OUT/result.json (rank 0).
Without --deepspeed it runs on torch DDP: the reference.
"""

import json
import os
from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM, HfArgumentParser, Trainer, TrainingArguments


@dataclass
class ProgramArguments:
    model_dir: str = field(metadata={"help": "a save_pretrained directory"})
    num_samples: int = 64
    seq_len: int = 16


class TokenData(torch.utils.data.Dataset):
    def __init__(self, num_samples: int, seq_len: int, vocab_size: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab_size, (num_samples, seq_len), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main():
    program, args = HfArgumentParser(
        (ProgramArguments, TrainingArguments)
    ).parse_args_into_dataclasses()
    model = AutoModelForCausalLM.from_pretrained(program.model_dir, torch_dtype=torch.float32)
    vocab = model.config.vocab_size
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=TokenData(program.num_samples, program.seq_len, vocab, seed=0),
        eval_dataset=TokenData(16, program.seq_len, vocab, seed=1),
    )
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    metrics = trainer.evaluate()
    trainer.save_model(os.path.join(args.output_dir, "final"))
    if trainer.is_world_process_zero():
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        result = {
            "losses": losses,
            "eval_loss": metrics["eval_loss"],
            "step": trainer.state.global_step,
        }
        with open(os.path.join(args.output_dir, "result.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
