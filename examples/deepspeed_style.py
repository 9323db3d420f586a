"""A DeepSpeed training script that runs on zero with only the import changed.

    zrun --hostfile examples/hosts examples/deepspeed_style.py \\
        --deepspeed --deepspeed_config configs/zero2.json

It is written the way DeepSpeed's own examples are: argparse with deepspeed.add_config_arguments,
deepspeed.init_distributed(), deepspeed.initialize(args=args, ...) returning the data loader
for training_data, deepspeed.comm for the script's own all-reduce, and save_checkpoint /
load_checkpoint with client_state. The only zero-specific line is `import zero as deepspeed`
(and `from zero import comm as dist` for `from deepspeed import comm as dist`).

After the last epoch the script loads the checkpoint it wrote before that epoch and trains the
epoch again: a resume must reproduce the same losses, and the script says whether it did.
"""

import argparse
import json

import torch

import zero as deepspeed
from zero import comm as dist


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="DeepSpeed-style regression training on zero")
    parser.add_argument("--local_rank", type=int, default=-1, help="passed by the launcher")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--save_dir", default="checkpoints/deepspeed_style")
    parser.add_argument("--results", default=None, help="rank 0 writes the losses here (JSON)")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class Net(torch.nn.Module):
    """A two-layer network with sizes that divide no world size."""

    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(13, 37)
        self.out = torch.nn.Linear(37, 5)

    def forward(self, x):
        return self.out(torch.nn.functional.gelu(self.hidden(x)))


def dataset() -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(512, 13, generator=generator)
    y = torch.tanh(x @ torch.randn(13, 5, generator=generator))
    return torch.utils.data.TensorDataset(x, y)


def train_epoch(engine, loader, epoch: int) -> list[float]:
    """One pass over this rank's part of the data; the loss of each micro-batch averaged over
    ranks."""
    engine.train()
    loader.sampler.set_epoch(epoch)
    losses = []
    for x, y in loader:
        x, y = x.to(engine.device), y.to(engine.device)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    return losses


def main() -> None:
    args = parse_args()
    deepspeed.init_distributed()
    torch.manual_seed(1234)
    model = Net()
    engine, optimizer, loader, lr_scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=dataset()
    )
    losses = []
    for epoch in range(args.epochs - 1):
        losses += train_epoch(engine, loader, epoch)
    engine.save_checkpoint(args.save_dir, client_state={"epoch": args.epochs - 1})
    last = train_epoch(engine, loader, args.epochs - 1)
    _, client_state = engine.load_checkpoint(args.save_dir)
    again = train_epoch(engine, loader, client_state["epoch"])
    if dist.get_rank() == 0:
        print(
            f"stage {engine.zero_optimization_stage()}, world size {dist.get_world_size()}: "
            f"loss {losses[0]:.4f} -> {last[-1]:.4f}; resume reproduces the last epoch: "
            f"{again == last}"
        )
        if args.results:
            results = {
                "stage": engine.zero_optimization_stage(),
                "losses": losses + last,
                "again": again,
                "lr": engine.get_lr(),
                "train_batch_size": engine.train_batch_size(),
                "global_steps": engine.global_steps,
            }
            with open(args.results, "w") as f:
                json.dump(results, f)
    dist.destroy_process_group()  # zero.comm's: a barrier first, every rank exits cleanly


if __name__ == "__main__":
    main()
