"""A program in the shape of DeepSpeedExamples' training/cifar/cifar10_deepspeed.py, calling
what it calls, in its order: deepspeed.moe.utils imported and not used (its MoE path is off),
deepspeed.add_config_arguments, init_distributed, get_accelerator().set_device, a config dict
with the example's keys (zero_optimization.cpu_offload, prescale_gradients,
fp16.fp16_master_weights_and_grads, WarmupLR), deepspeed.initialize with args=, a
model_parameters filter and training_data= (the engine's data loader), device_name(local_rank),
bfloat16_enabled / fp16_enabled, engine.local_rank, then an evaluation loop under engine.eval().

The one stand-in: torchvision's CIFAR10 (no CPU torchvision wheel exists for torch 2.13) is
replaced by 64 random 3x32x32 images with labels from a fixed linear rule, so the loss falls.
Prints one JSON line: the losses rank 0 saw and the test accuracy.
"""

import argparse
import json
import os

import deepspeed
import torch
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer  # noqa: F401


def arguments():
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--dtype", default="fp32", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--stage", default=0, type=int, choices=[0, 1, 2, 3])
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def config(args) -> dict:
    return {
        "train_batch_size": 16,
        "steps_per_print": 2000,
        "optimizer": {
            "type": "Adam",
            "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7},
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000},
        },
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "bf16": {"enabled": args.dtype == "bf16"},
        "fp16": {
            "enabled": args.dtype == "fp16",
            "fp16_master_weights_and_grads": False,
            "loss_scale": 0,
            "loss_scale_window": 500,
            "hysteresis": 2,
            "min_loss_scale": 1,
            "initial_scale_power": 15,
        },
        "wall_clock_breakdown": False,
        "zero_optimization": {
            "stage": args.stage,
            "allgather_partitions": True,
            "reduce_scatter": True,
            "allgather_bucket_size": 50000000,
            "reduce_bucket_size": 50000000,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "cpu_offload": False,
        },
    }


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


def stand_in_cifar(seed: int) -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(64, 3, 32, 32, generator=generator)
    rule = torch.randn(3 * 32 * 32, 10, generator=torch.Generator().manual_seed(0))
    labels = (images.reshape(64, -1) @ rule).argmax(dim=1)
    return torch.utils.data.TensorDataset(images, labels)


def main(args):
    deepspeed.init_distributed()
    local_rank = int(os.environ.get("LOCAL_RANK"))
    get_accelerator().set_device(local_rank)
    torch.manual_seed(0)
    trainset, testset = stand_in_cifar(1), stand_in_cifar(2)
    net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    engine, _, trainloader, _ = deepspeed.initialize(
        args=args,
        model=net,
        model_parameters=parameters,
        training_data=trainset,
        config=config(args),
    )
    device = get_accelerator().device_name(engine.local_rank)
    dtype = None
    if engine.bfloat16_enabled():
        dtype = torch.bfloat16
    elif engine.fp16_enabled():
        dtype = torch.half
    criterion = nn.CrossEntropyLoss()
    losses = []
    for _ in range(args.epochs):
        for inputs, labels in trainloader:
            inputs, labels = inputs.to(device), labels.to(device)
            if dtype is not None:
                inputs = inputs.to(dtype)
            loss = criterion(engine(inputs), labels)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    correct = total = 0
    engine.eval()
    with torch.no_grad():
        for images, labels in torch.utils.data.DataLoader(testset, batch_size=4):
            if dtype is not None:
                images = images.to(dtype)
            predicted = engine(images.to(device)).float().argmax(dim=1)
            total += labels.size(0)
            correct += (predicted == labels.to(device)).sum().item()
    if engine.local_rank == 0:
        print(json.dumps({"losses": losses, "accuracy": correct / total}))


if __name__ == "__main__":
    main(arguments())
