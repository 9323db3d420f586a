"""zero: ZeRO distributed training for PyTorch (arXiv 1910.02054).

engine, optimizer, dataloader, lr_scheduler = zero.initialize(model=model, config="zero2.json")
"""

import argparse
import logging
import math
import os

import torch
import torch.distributed as dist

from .accelerator import detect_accelerator
from .comm import data_parallel_comm, init_process_group, read_launch_env
from .config import load_config, settings_without_effect
from .engine import Engine
from .model_parallel.mpu import model_parallel_comm
from .partition.ds_params import refuse_partitioned_elsewhere

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
        args: an argparse namespace (add_config_arguments adds the flags): its
            `deepspeed_config` (also set by --zero_config), or `deepspeed` when that holds a
            path (Hugging Face's --deepspeed ds_config.json), names the config when `config` is
            not given; its `local_rank` (zrun and DeepSpeed's launcher pass --local_rank) picks
            the device when no LOCAL_RANK variable is set, and must equal LOCAL_RANK when one is.
        model: the torch.nn.Module to train (required).
        optimizer: a freshly built torch.optim.Optimizer over the model's parameters; it keeps
            its param groups and hyper-parameters but steps on this rank's shards. Without it the
            config's `optimizer` block builds one. Without either (or when no parameter of the
            model requires grad) the engine is built for inference, as DeepSpeed's is: see
            below.
        model_parameters: parameters (or param-group dicts) for the config's optimizer; default
            the model's trainable parameters.
        training_data: a torch Dataset: a DistributedDataLoader over it is returned, with
            train_micro_batch_size_per_gpu samples per batch (each epoch shuffled anew, alike
            on every rank; checkpoints save its position). Or a data loader with state_dict()
            and load_state_dict() (torchdata's StatefulDataLoader): returned as it is, and
            checkpoints save its state on every rank. engine.training_dataloader is the loader
            (None without training_data).
        lr_scheduler: a scheduler object bound to `optimizer`, or a callable taking the optimizer
            and returning one; default the config's `scheduler` block.
        mpu: a Megatron-style model-parallel unit; ZeRO then shards over its data-parallel group.
        dist_init_required: initialize torch.distributed from RANK/WORLD_SIZE/MASTER_ADDR/
            MASTER_PORT (default: when the launcher set them and no group exists).
        collate_fn: collate function for the DataLoader.
        config, config_params: a path to a JSON/hjson/YAML config, a dict, or a Config.

    Returns (engine, optimizer, dataloader or None, lr_scheduler or None).

    With `"checkpoint": {"auto_resume": true, "save_dir": DIR}` the engine then resumes from
    DIR's `latest` checkpoint, if there is one, at this job's world size, the data loader
    included (Engine.resume_latest; ValueError when train_batch_size differs from the
    checkpoint's).

    ZeRO-Inference: with no optimizer= and no `optimizer` block, or a model none of whose
    parameters requires grad (a given optimizer or block is then not used, with a warning), the
    engine runs forward, evaluation and generation at any stage and holds the parameters only
    (stage 3: a 1/N shard of each, on the host or nvme with offload_param; stages 0-2: whole);
    no gradient buffer, fp32 master weight or optimizer state is allocated. The optimizer and
    lr_scheduler returned are None; engine.backward() and engine.step() raise RuntimeError
    naming why there is no optimizer. DeepSpeed builds such an engine at stage 3 (its
    DeepSpeedZeRoOffload) and at stage 0, and refuses stages 1 and 2; zero builds it at each
    stage (stages 1 and 2 then hold what stage 0 holds: there is nothing else to partition).

    Collective: every rank calls it. Raises ConfigError (a ValueError) for a bad config, and
    ValueError for a model partitioned by another library's zero.Init (DeepSpeed's
    deepspeed.zero.Init: its parameters carry DeepSpeed's ds_id / ds_status, not zero's), naming
    the first such parameter, before any state is changed; ValueError for an lr_scheduler=
    without an optimizer.
    """
    if model is None:
        raise ValueError("zero.initialize needs model=")
    source = _config_source(args, config, config_params)
    launch = read_launch_env()
    refuse_partitioned_elsewhere(model, _global_rank(launch))
    local_rank = _local_rank(args, launch)
    auto = _auto_values(model, optimizer)
    notes: list[str] = []  # info lines of the config, logged once the handler exists
    if mpu is None:
        # Validate before touching torch.distributed, so a bad config costs nothing.
        cfg = load_config(
            source, world_size=_launch_world_size(launch), auto_values=auto, notes=notes
        )
    accelerator = detect_accelerator(local_rank)
    if launch is not None and dist_init_required is not False:
        init_process_group(accelerator.backend, launch)
    comm = data_parallel_comm(mpu)
    # With an mpu, comm.rank is the data-parallel rank: log as the global rank (one rank 0).
    _default_logging(dist.get_rank() if mpu is not None and dist.is_initialized() else comm.rank)
    if mpu is not None:
        cfg = load_config(source, world_size=comm.world_size, auto_values=auto, notes=notes)
    mp_size = model_parallel_comm(mpu).world_size
    for note in notes + settings_without_effect(cfg, model_parallel_world_size=mp_size):
        logger.info(note)
    _configure_checkpointing(cfg, mpu)
    engine = Engine(model, cfg, comm, accelerator, optimizer, model_parameters, lr_scheduler, mpu)
    loader = None
    if _is_stateful_loader(training_data):
        loader = training_data
    elif training_data is not None:
        loader = DistributedDataLoader(
            training_data,
            cfg.train_micro_batch_size_per_gpu,
            comm.world_size,
            comm.rank,
            drop_last=cfg.dataloader_drop_last,
            collate_fn=collate_fn,
        )
    engine.training_dataloader = loader  # DeepSpeed's name; save_checkpoint saves its state
    if cfg.checkpoint.auto_resume and not engine.inference_only:
        engine.resume_latest(cfg.checkpoint.save_dir)  # after the loader: it resumes too
    optimizer = None if engine.inference_only else engine.optimizer
    return engine, optimizer, loader, engine.lr_scheduler


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add zero's command-line flags to `parser` and return it; DeepSpeed's
    deepspeed.add_config_arguments. zero.initialize(args=parser.parse_args(), ...) reads them.

    --deepspeed: a flag for the script's own use (DeepSpeed's meaning: "zero is enabled").
    --deepspeed_config PATH, alias --zero_config PATH: the config file (args.deepspeed_config).
    --deepspeed_mpi: accepted for DeepSpeed's scripts; zero discovers mpirun's variables itself.
    Raises argparse.ArgumentError when the parser already defines one of these flags.
    """
    group = parser.add_argument_group("zero", "zero configuration (DeepSpeed's flags)")
    group.add_argument(
        "--deepspeed", action="store_true", help="enable zero (a flag for the script's own use)"
    )
    group.add_argument(
        "--deepspeed_config",
        "--zero_config",
        dest="deepspeed_config",
        default=None,
        help="zero config file (JSON, hjson or YAML)",
    )
    group.add_argument(
        "--deepspeed_mpi", action="store_true", help="accepted; mpirun is detected without it"
    )
    return parser


def is_compile_supported() -> bool:
    """True when torch.compile can run in this process (torch's Dynamo supports this Python
    and platform); DeepSpeed's deepspeed.is_compile_supported."""
    try:
        from torch._dynamo import is_dynamo_supported
    except ImportError:
        return False
    return bool(is_dynamo_supported())


def _local_rank(args, launch) -> int:
    """The rank on this node: the launcher's variable, else args.local_rank, else 0."""
    from_args = getattr(args, "local_rank", None)
    if not isinstance(from_args, int) or from_args < 0:
        return launch.local_rank if launch is not None else 0
    if launch is not None and launch.local_rank != from_args:
        raise ValueError(
            f"args.local_rank={from_args} but the launcher's environment says local rank "
            f"{launch.local_rank}; pass the --local_rank the launcher gives (or none)"
        )
    return from_args


def _config_source(args, config, config_params):
    if config is not None and config_params is not None:
        raise ValueError("pass the config once: config= or config_params=, not both")
    source = config if config is not None else config_params
    from_args = getattr(args, "deepspeed_config", None) or getattr(args, "zero_config", None)
    path_flag = getattr(args, "deepspeed", None)
    if isinstance(path_flag, (str, os.PathLike)):  # Hugging Face's --deepspeed ds_config.json
        if from_args is not None and from_args != path_flag:
            raise ValueError(
                f"two configs given: args.deepspeed={path_flag!r} and "
                f"args.deepspeed_config={from_args!r}; pass one"
            )
        from_args = path_flag
    if source is not None and from_args is not None and source != from_args:
        raise ValueError(
            f"two configs given: config={source!r} and args.deepspeed_config={from_args!r}; "
            "pass one"
        )
    source = source if source is not None else from_args
    if source is None:
        if args is not None:  # a script that reads its config from the command line
            raise ValueError(
                "no config: the command line gave no --deepspeed_config (or --zero_config) "
                "file; add --deepspeed_config zero2.json, or pass config='zero2.json' to "
                "zero.initialize"
            )
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


def _global_rank(launch) -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return launch.rank if launch is not None else 0


def _launch_world_size(launch) -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return launch.world_size if launch is not None else 1


def _configure_checkpointing(cfg, mpu) -> None:
    """Apply the config's activation_checkpointing block (zero.checkpointing.configure). A config
    without the block leaves an earlier configure() call by the user in force."""
    from .model_parallel import activation

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


def _is_stateful_loader(data) -> bool:
    """A data loader (not a Dataset) that saves its position: torchdata's StatefulDataLoader."""
    methods = ("state_dict", "load_state_dict", "__iter__")
    stateful = all(callable(getattr(data, m, None)) for m in methods)
    return stateful and not isinstance(data, torch.utils.data.Dataset)


class EpochSampler(torch.utils.data.Sampler):
    """This rank's sample indices of epoch `epoch`, as torch's DistributedSampler(shuffle=True,
    seed=seed) gives them after set_epoch(epoch): one shuffle of the whole dataset per epoch
    (torch.randperm seeded with seed + epoch, the same on every rank), padded by repeating its
    first indices (or, with drop_last, cut) to a multiple of num_replicas, rank r taking every
    num_replicas-th index from r. Unlike DistributedSampler it starts anywhere in the epoch:
    the first `start` indices of the shuffle (global samples, over all ranks) are done, and the
    rest is split over the ranks afresh, so a run resumed on another world size sees each
    sample of the epoch once. len() is this rank's number of samples in a whole epoch."""

    def __init__(self, num_samples: int, num_replicas: int, rank: int, drop_last: bool, seed=0):
        self.num_samples, self.num_replicas, self.rank = num_samples, num_replicas, rank
        self.drop_last, self.seed = drop_last, seed
        self.epoch = 0
        self.start = 0  # samples of this epoch's shuffle done (all ranks together)

    def set_epoch(self, epoch: int) -> None:
        """DistributedSampler's: use epoch `epoch`'s shuffle. Another epoch than the current one
        starts at its beginning; the current one continues where it is (a script calling
        set_epoch at the top of each epoch resumes mid-epoch after load_checkpoint)."""
        if epoch != self.epoch:
            self.epoch, self.start = epoch, 0

    def remaining(self) -> list[int]:
        """This rank's indices still to come in the epoch."""
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.num_samples, generator=generator).tolist()
        rest = order[self.start :]
        if self.drop_last:
            rest = rest[: len(rest) - len(rest) % self.num_replicas]
        elif pad := -len(rest) % self.num_replicas:
            rest += (order * math.ceil(pad / len(order)))[:pad]
        return rest[self.rank :: self.num_replicas]

    def num_remaining(self) -> int:
        """len(remaining()), without shuffling."""
        left = max(self.num_samples - self.start, 0)
        left += -(left % self.num_replicas) if self.drop_last else -left % self.num_replicas
        return left // self.num_replicas

    def __iter__(self):
        return iter(self.remaining())

    def __len__(self) -> int:
        if self.drop_last:
            return self.num_samples // self.num_replicas
        return math.ceil(self.num_samples / self.num_replicas)


class DistributedDataLoader(torch.utils.data.DataLoader):
    """The data loader zero.initialize(training_data=dataset) returns (DeepSpeed's
    DeepSpeedDataLoader): `batch_size` samples per batch from this rank's part of each epoch
    (EpochSampler). Iterating to the end of an epoch moves to the next epoch, whose shuffle
    differs; breaking off and iterating again continues where it stopped. state_dict() is the
    position (epoch, samples of its shuffle done), which Engine.save_checkpoint saves and
    load_checkpoint restores: the resumed loader's next batch is the one the saving run would
    have loaded next (at another world size: the epoch's remaining samples, split anew).
    Not a collective; every rank must take the same number of batches between checkpoints."""

    def __init__(
        self,
        dataset,
        batch_size: int,
        num_replicas: int,
        rank: int,
        drop_last: bool = False,
        collate_fn=None,
    ):
        sampler = EpochSampler(len(dataset), num_replicas, rank, drop_last)
        super().__init__(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            collate_fn=collate_fn,
            drop_last=drop_last,
        )

    def set_epoch(self, epoch: int) -> None:
        """See EpochSampler.set_epoch (also loader.sampler.set_epoch, as with torch's)."""
        self.sampler.set_epoch(epoch)

    def _batches_left(self) -> int:
        left = self.sampler.num_remaining()
        return left // self.batch_size if self.drop_last else math.ceil(left / self.batch_size)

    def __iter__(self):
        sampler = self.sampler
        if self._batches_left() == 0:  # the last batch was taken, but not StopIteration
            sampler.set_epoch(sampler.epoch + 1)
        left, epoch = self._batches_left(), sampler.epoch
        for index, batch in enumerate(super().__iter__()):
            # Counted before the batch is handed out: a checkpoint saved while the script
            # trains on it resumes with the next one.
            if index + 1 == left:
                sampler.set_epoch(epoch + 1)
            else:
                sampler.start += self.batch_size * sampler.num_replicas
            yield batch

    def state_dict(self) -> dict:
        """{"epoch", "samples" (of the epoch's shuffle done, all ranks), "dataset_size",
        "seed"}: JSON numbers."""
        sampler = self.sampler
        return {
            "epoch": sampler.epoch,
            "samples": sampler.start,
            "dataset_size": sampler.num_samples,
            "seed": sampler.seed,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from a state_dict(). Raises ValueError for another dataset size or seed, or
        a malformed state, naming the key."""
        own = self.state_dict()
        if not isinstance(state, dict) or set(state) != set(own):
            raise ValueError(f"data loader state {state!r:.200} lacks or adds keys: {sorted(own)}")
        for key, value in state.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"data loader state '{key}' is {value!r}, not a count")
        for key in ("dataset_size", "seed"):
            if state[key] != own[key]:
                raise ValueError(
                    f"the saved data loader state is for {key} {state[key]}, this loader has "
                    f"{own[key]}: its position means nothing here; pass the dataset the saving "
                    "run used"
                )
        self.sampler.epoch, self.sampler.start = state["epoch"], state["samples"]
