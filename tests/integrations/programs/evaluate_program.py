"""A Hugging Face Trainer program that only evaluates and predicts, as users write it for
DeepSpeed (ZeRO-Inference), with nothing of zero in it.

    zero-as-deepspeed torchrun --nproc_per_node 2 evaluate_program.py --model_dir M \
        --output_dir OUT --deepspeed ds_config.json

Builds the Trainer on a causal LM from `--model_dir` with no training data, calls
trainer.evaluate() and trainer.predict() on fixed random token sequences (never train()), and on
rank 0 writes the metrics to OUT/result.json and the predicted logits to OUT/logits.pt. Under
a DeepSpeed config the Trainer builds the engine without an optimizer (deepspeed_init with
inference=True); without --deepspeed it runs on plain torch: the reference.
"""

import json
import os
from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM, HfArgumentParser, Trainer, TrainingArguments


@dataclass
class ProgramArguments:
    model_dir: str = field(metadata={"help": "a save_pretrained directory"})
    num_samples: int = 12
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
        eval_dataset=TokenData(program.num_samples, program.seq_len, vocab, seed=1),
    )
    metrics = trainer.evaluate()
    predicted = trainer.predict(TokenData(program.num_samples, program.seq_len, vocab, seed=2))
    if trainer.is_world_process_zero():
        result = {
            "eval_loss": metrics["eval_loss"],
            "test_loss": predicted.metrics["test_loss"],
            "engine": type(trainer.model_wrapped).__module__,
        }
        with open(os.path.join(args.output_dir, "result.json"), "w") as f:
            json.dump(result, f)
        logits = torch.as_tensor(predicted.predictions)
        torch.save(logits, os.path.join(args.output_dir, "logits.pt"))


if __name__ == "__main__":
    main()
