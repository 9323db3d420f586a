"""The training state: the parts of an engine a checkpoint saves and restores.

`TrainingState` is what checkpoint/ reads and writes, never the Engine itself: the model
(`module`), the ZeroOptimizer (its fp32 master shards and optimizer state, laid out in
buckets), the lr scheduler, the loss scaler, the step counters and the data loader, each with
state_dict() / load_state_dict() (the ZeroOptimizer's shards are written range by range,
checkpoint/writer.py); at stage 3 also the partitioned frozen parameters (`frozen`) and the
ParamGatherer whose gathered copies a load replaces (`gatherer`). The random number generators
are the process's (torch, the device's, Python's, NumPy's: checkpoint/rank_state.py). `comm`,
`config` and `device` say where the state lives: the data-parallel group its shards are spread
over, the config it was built from, the device its tensors are on.
"""

import dataclasses

import torch.distributed as dist


@dataclasses.dataclass
class StepCounters:
    """DeepSpeed's step counters: optimizer steps taken (skipped ones included), samples seen
    (train_batch_size per step), steps skipped for an fp16/bf16 overflow, micro-batches seen."""

    global_steps: int = 0
    global_samples: int = 0
    skipped_steps: int = 0
    micro_steps: int = 0

    def state_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict) -> None:
        """Take the four counters from `state` (KeyError naming a missing one)."""
        for field in dataclasses.fields(self):
            setattr(self, field.name, int(state[field.name]))


@dataclasses.dataclass
class TrainingState:
    """One engine's training state (see the module docstring). Built by the Engine; the parts
    are the engine's own objects, not copies."""

    module: object
    optimizer: object
    lr_scheduler: object
    scaler: object
    counters: StepCounters
    comm: object
    config: object
    device: object
    frozen: object = None
    gatherer: object = None
    loader: object = None  # engine.training_dataloader: zero's loader or the script's

    @property
    def global_rank(self) -> int:
        """Rank in the whole job (torch.distributed's rank; 0 without a process group)."""
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def stateful_loader(self):
        """The data loader when it has state_dict() and load_state_dict() (zero's own, or a
        torchdata StatefulDataLoader-like object), else None."""
        loader = self.loader
        stateful = all(
            callable(getattr(loader, m, None)) for m in ("state_dict", "load_state_dict")
        )
        return loader if stateful else None
