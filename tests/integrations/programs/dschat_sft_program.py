"""A supervised fine-tuning program in the style of DeepSpeed-Chat's step 1 (main.py and
dschat/utils), written for DeepSpeed: nothing of zero in it. Run by the `deepspeed` launcher:

    zero-as-deepspeed deepspeed --num_gpus 2 dschat_sft_program.py --model_dir M \
        --output_dir OUT --zero_stage 3 --lora_dim 4 [--offload] --deepspeed

Idioms kept from DeepSpeed-Chat: get_accelerator() for the device and seeds, init_distributed,
HfDeepSpeedConfig before from_pretrained at stage 3, a LoRA layer sized from `weight.ds_shape`,
FusedAdam / DeepSpeedCPUAdam, a transformers scheduler passed to initialize, the engine's
gradient_checkpointing_enable() and tput_timer, LoRA fused inside GatheredParameters(...,
modifier_rank=0, enabled=hasattr(weight, "ds_id")), and main.py's save: save_hf_format on rank 0
alone (module.state_dict(): DeepSpeed's 0-element placeholders at stage 3), then at stage 3
save_zero_three_model, which gathers each parameter with `ds_id` whose ds_status is
NOT_AVAILABLE on every rank and overwrites the file on rank 0.
--reference_out writes, on rank 0, the fused model's weights gathered with GatheredParameters
(for the test to compare with what from_pretrained reads back).
"""

import argparse
import math
import os

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed import get_accelerator
from deepspeed.compression.helper import recursive_getattr
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from transformers import AutoConfig, AutoModelForCausalLM, get_scheduler
from transformers.integrations import HfDeepSpeedConfig


class LinearLayer_LoRA(torch.nn.Module):  # noqa: N801  (DeepSpeed-Chat's name)
    def __init__(self, weight, lora_dim, lora_scaling, bias=None):
        super().__init__()
        self.weight, self.bias = weight, bias
        try:
            rows, columns = weight.ds_shape  # partitioned at stage 3
        except AttributeError:
            rows, columns = weight.shape
        self.lora_right_weight = torch.nn.Parameter(torch.zeros(columns, lora_dim))
        self.lora_left_weight = torch.nn.Parameter(torch.zeros(lora_dim, rows))
        self.lora_scaling = lora_scaling / lora_dim
        torch.nn.init.kaiming_uniform_(self.lora_right_weight, a=math.sqrt(5))
        torch.nn.init.zeros_(self.lora_left_weight)
        self.weight.requires_grad = False
        self.fuse_lora = False

    def fuse_lora_weight(self):
        if not self.fuse_lora:
            self.weight.data += self.lora_scaling * torch.matmul(
                self.lora_left_weight.t(), self.lora_right_weight.t()
            )
        self.fuse_lora = True

    def forward(self, x):
        out = F.linear(x, self.weight, self.bias)
        if self.fuse_lora:
            return out
        return out + (x @ self.lora_right_weight @ self.lora_left_weight) * self.lora_scaling


def convert_linear_layer_to_lora(model, part_module_name, lora_dim):
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    for name in [n for n in names if part_module_name in n]:
        module = recursive_getattr(model, name)
        lora = LinearLayer_LoRA(module.weight, lora_dim, 1, module.bias)
        parent, _, child = name.rpartition(".")
        setattr(recursive_getattr(model, parent), child, lora)
    return model


def convert_lora_to_linear_layer(model):
    for _, module in model.named_modules():
        if isinstance(module, LinearLayer_LoRA):
            stage_3 = hasattr(module.weight, "ds_id")
            params = [module.weight, module.bias, module.lora_left_weight, module.lora_right_weight]
            with deepspeed.zero.GatheredParameters(params, modifier_rank=0, enabled=stage_3):
                module.fuse_lora_weight()
    return model


def _z3_params_to_fetch(param_list):
    return [
        p
        for p in param_list
        if hasattr(p, "ds_id") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE
    ]


def save_zero_three_model(model_ema, global_rank, save_dir, zero_stage=0):
    zero_stage_3 = zero_stage == 3
    os.makedirs(save_dir, exist_ok=True)
    output_model_file = os.path.join(save_dir, "pytorch_model.bin")
    model_to_save = model_ema.module if hasattr(model_ema, "module") else model_ema
    if not zero_stage_3:
        if global_rank == 0:
            torch.save(model_to_save.state_dict(), output_model_file)
    else:
        output_state_dict = {}
        for k, v in model_to_save.named_parameters():
            if hasattr(v, "ds_id"):
                with deepspeed.zero.GatheredParameters(
                    _z3_params_to_fetch([v]), enabled=zero_stage_3
                ):
                    v_p = v.data.cpu()
            else:
                v_p = v.cpu()
            if global_rank == 0 and "lora" not in k:
                output_state_dict[k] = v_p
        if global_rank == 0:
            torch.save(output_state_dict, output_model_file)
        del output_state_dict


def save_hf_format(model, args):
    # DeepSpeed-Chat calls this on rank 0 alone, at every stage: at stage 3 state_dict() gives
    # 0-element placeholders, which save_zero_three_model then overwrites with gathered weights.
    model_to_save = model.module if hasattr(model, "module") else model
    os.makedirs(args.output_dir, exist_ok=True)
    save_dict = model_to_save.state_dict()
    for key in list(save_dict.keys()):
        if "lora" in key:
            del save_dict[key]
    torch.save(save_dict, os.path.join(args.output_dir, "pytorch_model.bin"))
    model_to_save.config.to_json_file(os.path.join(args.output_dir, "config.json"))


def ds_config(args):
    device = "cpu" if args.offload else "none"
    return {
        "train_batch_size": args.batch_size * torch.distributed.get_world_size(),
        "train_micro_batch_size_per_gpu": args.batch_size,
        "steps_per_print": 10,
        "zero_optimization": {
            "stage": args.zero_stage,
            "offload_param": {"device": device},
            "offload_optimizer": {"device": device},
            "stage3_param_persistence_threshold": args.persistence_threshold,
            "stage3_max_live_parameters": 3e7,
            "stage3_prefetch_bucket_size": 3e7,
            "memory_efficient_linear": False,
        },
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "wall_clock_breakdown": False,
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_dir", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--reference_out", default=None)
    parser.add_argument("--zero_stage", type=int, default=0)
    parser.add_argument("--lora_dim", type=int, default=0)
    parser.add_argument("--offload", action="store_true")
    # DeepSpeed-Chat's 1e4 keeps every parameter of a tiny model whole; 0 partitions them all
    parser.add_argument("--persistence_threshold", type=float, default=1e4)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    if args.local_rank == -1:
        device = torch.device(get_accelerator().device_name())
    else:
        get_accelerator().set_device(args.local_rank)
        device = torch.device(get_accelerator().device_name(), args.local_rank)
        deepspeed.init_distributed()
    args.global_rank = torch.distributed.get_rank()
    get_accelerator().manual_seed_all(1234)
    torch.manual_seed(1234)

    config = ds_config(args)
    dschf = HfDeepSpeedConfig(config) if args.zero_stage == 3 else None  # noqa: F841 (kept alive)
    model_config = AutoConfig.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, config=model_config)
    if args.lora_dim > 0:
        model = convert_linear_layer_to_lora(model, "layers.", args.lora_dim)

    groups = [
        {"params": [p for n, p in model.named_parameters() if p.requires_grad and "lora" not in n]},
        {"params": [p for n, p in model.named_parameters() if "lora" in n], "lr": 5e-3},
    ]
    groups = [g for g in groups if g["params"]]
    optimizer_class = DeepSpeedCPUAdam if args.offload else FusedAdam
    optimizer = optimizer_class(groups, lr=1e-3, betas=(0.9, 0.95))
    lr_scheduler = get_scheduler("cosine", optimizer, num_warmup_steps=1, num_training_steps=8)
    model, optimizer, _, lr_scheduler = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        args=args,
        config=config,
        lr_scheduler=lr_scheduler,
        dist_init_required=True,
    )
    model.gradient_checkpointing_enable()

    g = torch.Generator().manual_seed(args.global_rank)
    vocab = model_config.vocab_size
    model.train()
    for _ in range(args.steps):
        ids = torch.randint(0, vocab, (args.batch_size, 16), generator=g).to(device)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        model.backward(loss)
        model.step()
        print(f"rank {args.global_rank} loss {loss.item():.6f}", flush=True)
    model.tput_timer.update_epoch_count()

    model = convert_lora_to_linear_layer(model)
    if args.global_rank == 0:
        save_hf_format(model, args)
    if args.zero_stage == 3:
        save_zero_three_model(model, args.global_rank, args.output_dir, zero_stage=args.zero_stage)
    if args.reference_out:
        from safetensors.torch import save_file

        params = list(model.module.parameters())
        with deepspeed.zero.GatheredParameters(params, enabled=hasattr(params[0], "ds_id")):
            state = {
                k: v.detach().clone() for k, v in model.module.named_parameters() if "lora" not in k
            }
        if args.global_rank == 0:
            save_file(state, args.reference_out)


if __name__ == "__main__":
    main()
