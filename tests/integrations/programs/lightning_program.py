"""A Lightning program with its DeepSpeed strategy, as users write it for DeepSpeed, with nothing
of zero in it but one stand-in: Lightning's DeepSpeed strategy refuses accelerators other than
CUDA, so the Trainer gets CPUBackedCUDA, a CUDAAccelerator whose devices are CPU processes
(gloo). Everything else is the user's program.

    [zero-as-deepspeed] python lightning_program.py --model_dir M --out OUT --stage 3

Two ranks (Lightning spawns the second as a subprocess of the first), a tiny causal LM trained
for 3 steps with Adam, a ModelCheckpoint on the logged loss; the checkpoint Lightning writes at
the end (trainer.save_checkpoint: DeepSpeed's save_checkpoint with Lightning's checkpoint dict,
tensors in it, as client_state) is loaded into a fresh Trainer that trains one step more;
OUT/result.json holds the losses, the resumed step and both trainers' best_model_score.
"""

import argparse
import json
import os

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.callbacks import ModelCheckpoint
from transformers import AutoModelForCausalLM


class CPUBackedCUDA(CUDAAccelerator):
    """Lightning's CUDA accelerator on CPU devices: the strategy's CUDA check passes, tensors stay
    on the CPU."""

    def setup_device(self, device):
        pass

    def teardown(self):
        pass

    def get_device_stats(self, device):
        return {}

    @staticmethod
    def parse_devices(devices):
        return list(range(devices))

    @staticmethod
    def get_parallel_devices(devices):
        return [torch.device("cpu", index) for index in devices]  # Lightning checks the index

    @staticmethod
    def auto_device_count():
        return 2

    @staticmethod
    def is_available():
        return True


class LM(pl.LightningModule):
    def __init__(self, model_dir: str):
        super().__init__()
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.losses = []

    def training_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch, labels=batch).loss
        self.losses.append(loss.item())
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(3, self.model.config.vocab_size, (24, 16), generator=g)
        return torch.utils.data.DataLoader(ids, batch_size=4)


def trainer(args, steps: int) -> pl.Trainer:
    best = ModelCheckpoint(dirpath=os.path.join(args.out, "best"), monitor="loss", save_top_k=1)
    return pl.Trainer(
        accelerator=CPUBackedCUDA(),
        devices=2,
        strategy=f"deepspeed_stage_{args.stage}",
        max_steps=steps,
        logger=False,
        callbacks=[best],
        enable_progress_bar=False,
        plugins=[LightningEnvironment()],
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--stage", type=int, default=2)
    args = parser.parse_args()
    pl.seed_everything(0)
    module = LM(args.model_dir)
    fit = trainer(args, 3)
    fit.fit(module)
    checkpoint = os.path.join(args.out, "last.ckpt")
    fit.save_checkpoint(checkpoint)
    resumed = trainer(args, 4)
    again = LM(args.model_dir)
    resumed.fit(again, ckpt_path=checkpoint)
    if fit.global_rank == 0:
        with open(os.path.join(args.out, "result.json"), "w") as handle:
            scores = [t.checkpoint_callback.best_model_score for t in (fit, resumed)]
            result = {"losses": module.losses, "resumed_step": resumed.global_step}
            result["best_scores"] = [None if s is None else s.item() for s in scores]
            json.dump(result, handle)


if __name__ == "__main__":
    main()
