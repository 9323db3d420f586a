"""An accelerate training loop as users write it, with nothing of zero or DeepSpeed in it:

    zero-as-deepspeed accelerate launch --config_file acc.yaml accelerate_program.py \
        --model_dir M --output_dir OUT [--resume_from DIR]

DeepSpeed comes from the accelerate config (distributed_type DEEPSPEED, deepspeed_config with
zero_stage ...). Trains --steps steps on fixed random tokens, saves the training state
(save_state) after --save_at steps and at the end, and the model (get_state_dict +
save_pretrained); rank 0 writes OUT/result.json with the losses.
"""

import argparse
import json
import os

import torch
from accelerate import Accelerator
from transformers import AutoModelForCausalLM


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_dir", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--save_at", type=int, default=2)
    parser.add_argument("--resume_from", default=None)
    args = parser.parse_args()

    accelerator = Accelerator()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, torch_dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (4 * args.steps * 2, 16), generator=g)
    data = torch.utils.data.DataLoader(ids, batch_size=4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    start = 0
    if args.resume_from:
        accelerator.load_state(args.resume_from)
        start = args.save_at
    losses = []
    model.train()
    for step, batch in enumerate(data):
        if step < start:
            continue
        if step == args.steps:
            break
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if step + 1 == args.save_at and not args.resume_from:
            accelerator.save_state(os.path.join(args.output_dir, "state"))
    state = accelerator.get_state_dict(model)
    accelerator.unwrap_model(model).save_pretrained(
        os.path.join(args.output_dir, "final"),
        state_dict=state,
        is_main_process=accelerator.is_main_process,
        save_function=accelerator.save,
    )
    if accelerator.is_main_process:
        with open(os.path.join(args.output_dir, "result.json"), "w") as f:
            json.dump({"losses": losses}, f)
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
