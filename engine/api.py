"""zero: ZeRO distributed training for PyTorch (arXiv 1910.02054).

engine, optimizer, dataloader, lr_scheduler = zero.initialize(model=model, config="zero2.json")
"""

import logging

import torch
import torch.distributed as dist

from .accelerator import detect_accelerator
from .comm import data_parallel_comm, init_process_group, read_launch_env
from .config import load_config
from .engine import Engine

logger = logging.getLogger("zero")


def initialize(
    args=None,
    model: torch.nn.Module | None = None,
    optimizer=None,
    model_parameters=None,
    training_data=None,
    lr_scheduler=None,
    mpu=None,
    dist_init_required: bool | None = None,
    collate_fn=None,
    config=None,
    config_params=None,
):
    """Wrap `model` for ZeRO training; DeepSpeed's deepspeed.initialize signature and result.

    Args:
        args: an argparse namespace; its `deepspeed_config` (or `zero_config`) names the config
            when `config` is not given.
        model: the torch.nn.Module to train (required).
        optimizer: a freshly built torch.optim.Optimizer over the model's parameters; it keeps
            its param groups and hyper-parameters but steps on this rank's shards. Without it the
            config's `optimizer` block builds one.
        model_parameters: parameters (or param-group dicts) for the config's optimizer; default
            the model's trainable parameters.
        training_data: a torch Dataset; a DataLoader over a DistributedSampler with
            train_micro_batch_size_per_gpu samples per batch is returned for it.
        lr_scheduler: a scheduler object bound to `optimizer`, or a callable taking the optimizer
            and returning one; default the config's `scheduler` block.
        mpu: a Megatron-style model-parallel unit; ZeRO then shards over its data-parallel group.
        dist_init_required: initialize torch.distributed from RANK/WORLD_SIZE/MASTER_ADDR/
            MASTER_PORT (default: when the launcher set them and no group exists).
        collate_fn: collate function for the DataLoader.
        config, config_params: a path to a JSON/hjson/YAML config, a dict, or a Config.

    Returns (engine, optimizer, dataloader or None, lr_scheduler or None).

    Collective: every rank calls it. Raises ConfigError (a ValueError) for a bad config, before
    any state is changed.
    """
    if model is None:
        raise ValueError("zero.initialize needs model=")
    source = _config_source(args, config, config_params)
    launch = read_launch_env()
    auto = _auto_values(model, optimizer)
    if mpu is None:
        # Validate before touching torch.distributed, so a bad config costs nothing.
        cfg = load_config(source, world_size=_launch_world_size(launch), auto_values=auto)
    accelerator = detect_accelerator(launch.local_rank if launch else 0)
    if launch is not None and dist_init_required is not False:
        init_process_group(accelerator.backend, launch)
    comm = data_parallel_comm(mpu)
    # With an mpu, comm.rank is the data-parallel rank: log as the global rank (one rank 0).
    _default_logging(dist.get_rank() if mpu is not None and dist.is_initialized() else comm.rank)
    if mpu is not None:
        cfg = load_config(source, world_size=comm.world_size, auto_values=auto)
    _configure_checkpointing(cfg, mpu)
    engine = Engine(model, cfg, comm, accelerator, optimizer, model_parameters, lr_scheduler, mpu)
    loader = None
    if training_data is not None:
        loader = _dataloader(training_data, cfg, comm, collate_fn)
    return engine, engine.optimizer, loader, engine.lr_scheduler


def _config_source(args, config, config_params):
    if config is not None and config_params is not None:
        raise ValueError("pass the config once: config= or config_params=, not both")
    source = config if config is not None else config_params
    from_args = getattr(args, "deepspeed_config", None) or getattr(args, "zero_config", None)
    if source is not None and from_args is not None and source != from_args:
        raise ValueError(
            f"two configs given: config={source!r} and args.deepspeed_config={from_args!r}; "
            "pass one"
        )
    source = source if source is not None else from_args
    if source is None:
        raise ValueError(
            "no config: pass config='zero2.json' (a path, dict or zero.Config) to zero.initialize"
        )
    return source


def _default_logging(rank: int) -> None:
    """Give the "zero" logger a stderr handler (INFO on rank 0, WARNING elsewhere) unless the
    application configured one."""
    if logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"[zero rank {rank}] %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    logger.propagate = False


def _launch_world_size(launch) -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return launch.world_size if launch is not None else 1


def _configure_checkpointing(cfg, mpu) -> None:
    """Apply the config's activation_checkpointing block (zero.checkpointing.configure). A config
    without the block leaves an earlier configure() call by the user in force."""
    from . import activation

    if "activation_checkpointing" in cfg.model_fields_set or not activation.is_configured():
        activation.configure(mpu, deepspeed_config=cfg)


def _auto_values(model, optimizer) -> dict:
    """Values that resolve "auto" entries of a Hugging Face style config."""
    values = {}
    model_config = getattr(model, "config", None)
    for attr in ("hidden_size", "n_embd", "d_model"):
        if model_config is not None and isinstance(getattr(model_config, attr, None), int):
            values["hidden_size"] = getattr(model_config, attr)
            break
    if optimizer is not None:
        group = optimizer.param_groups[0]
        for key in ("lr", "betas", "eps", "weight_decay", "momentum"):
            if key in group:
                value = group[key]
                values[f"optimizer.params.{key}"] = (
                    list(value) if isinstance(value, tuple) else value
                )
    return values


def _dataloader(dataset, cfg, comm, collate_fn):
    from torch.utils.data import DataLoader, DistributedSampler

    sampler = DistributedSampler(
        dataset,
        num_replicas=comm.world_size,
        rank=comm.rank,
        shuffle=True,
        drop_last=cfg.dataloader_drop_last,
    )
    return DataLoader(
        dataset,
        batch_size=cfg.train_micro_batch_size_per_gpu,
        sampler=sampler,
        collate_fn=collate_fn,
        drop_last=cfg.dataloader_drop_last,
    )
