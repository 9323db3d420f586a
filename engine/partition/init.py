"""zero.Init: partition parameters while the model is built (paper, 5.3; DeepSpeed's
deepspeed.zero.Init).

    with zero.Init(config="zero3.json"):
        model = GPT(cfg)          # each rank now holds 1/N of every parameter
    engine, *_ = zero.initialize(model=model, config="zero3.json")

[Note: construction]
Inside the context every nn.Module class's __init__ is wrapped. When the outermost __init__ call
of a module returns, its own (direct) parameters are partitioned: rank 0's values are broadcast,
each rank keeps its zero-padded 1/N slice of every parameter (InitShard), and the Parameter
object keeps its identity, dtype and requires_grad but holds 0 elements. Children finish before
their parent, so a rank never holds much more than one module's full parameters.

[Note: touching a partitioned parameter]
Construction code often re-initializes children from the parent (GPT-2 style
`self.apply(self._init_weights)` at the end of __init__), ties weights, or reads shapes. A
TorchFunctionMode active inside the context catches every torch operation on a partitioned
parameter: the parameter is all-gathered (its full value, on the device it was built on) just
before the operation, and stays gathered while it is among the KEEP_GATHERED (4) parameters
touched most recently, until a module finishes __init__, or until the context ends; then it is
re-partitioned (broadcast from rank 0, slice kept). Aliases taken through `.data` or views
(`b.weight.data.copy_(a.weight.data)`) are written through while their parameter is gathered;
a write through an alias kept across more than four other parameters' operations is lost.
So values equal an ordinary construction on rank 0 with the same seed, random draws included.
Gathering is collective: every rank must build the same modules and touch the same parameters
in the same order, which construction code does unless it branches on the rank.

After the context, zero.initialize gathers each parameter once more, one bucket at a time, to lay
it out (stages.py); until then `param.numel()` is 0 and full_shape(param) gives the shape.

[Note: meta parameters and loaded values]
A parameter built on the meta device (inside `torch.device("meta")`, which transformers 5's
from_pretrained opens around the model's construction) has a shape but no values, so there is
nothing to partition: it stays on the meta device with an empty InitShard (InitShard.empty) that
records its shape, and the torch operations that construction code runs on it are not caught.
Values arrive later, one parameter at a time, in one of two ways:
- assigned: a Parameter that replaces a zero.Init parameter on its module (`module.weight =
  Parameter(value)`, as transformers' loader sets each checkpoint tensor, a tie, a re-assignment)
  is partitioned at once while the context is open, from this rank's own value and without
  communication, because the assignments of a checkpoint load need not come in the same order on
  every rank (transformers iterates over a set for the keys it does not load). Ranks must assign
  equal values, as loading the same files does: each value's CRC-32 is kept until the parameter
  is next gathered and released (which broadcasts rank 0's value: transformers re-initializes the
  keys the checkpoint lacks that way), and the context's exit checks that the ranks' sums agree,
  raising on every rank otherwise. An assigned Parameter on the meta device becomes empty again.
- loaded: zero.load_pretrained(model, path) reads each rank's slice of every parameter straight
  from safetensors files into its InitShard (checkpoint/hf.py), empty or not, after the context too.
zero.initialize refuses a model with parameters or buffers still on the meta device.
transformers 5 materializes checkpoint tensors on 4 threads ahead of assigning them. Uncast, a
tensor is a view of the mapped file (no private memory); cast (from_pretrained(dtype=...)) each
is a private copy, and the read-ahead held about a third of a bf16 model per rank in
benchmarks/load_pretrained_rss.py. So while the context is open it sets transformers' own switch
HF_DEACTIVATE_ASYNC_LOAD=1 (unless the environment sets it), which makes it materialize each
tensor when it assigns it: one full tensor at a time. A transformers without that switch only
reads ahead again; nothing else depends on it.
"""

import contextlib
import functools
import os
import zlib

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from ..accelerator import detect_accelerator
from ..comm import Communicator, data_parallel_comm, init_process_group, read_launch_env

_ACTIVE = None  # the Init context in force (contexts do not nest: an inner one does nothing)
# transformers' switch for materializing checkpoint tensors one at a time ([Note: meta ...]).
_SEQUENTIAL_LOAD = "HF_DEACTIVATE_ASYNC_LOAD"
# Parameters kept gathered inside the context after their last touch (see [Note: touching a
# partitioned parameter]); enough for code that aliases a few parameters at once.
KEEP_GATHERED = 4


class InitShard:
    """This rank's slice of a parameter built under zero.Init.

    shape: the full shape. data: (ceil(numel / N),) the rank's slice, zero-padded, in the
    parameter's dtype, on `device` (page-locked when `pin` and CUDA exists). comm: the
    data-parallel Communicator it is partitioned over, whose collectives run on `comm_device`.
    home: the device the parameter was built on (its placeholder's). gathered: the parameter
    holds its full value right now.
    """

    def __init__(self, home, comm: Communicator, comm_device, device, pin):
        self.home, self.comm, self.comm_device = home, comm, comm_device
        self.device, self.pin = device, pin
        self.gathered = True  # until release_in_place() keeps the slice
        self.shape = self.data = None

    @property
    def empty(self) -> bool:
        """Built on the meta device: the shape is known, the values are not (see [Note: meta
        parameters and loaded values])."""
        return self.data is None and not self.gathered

    def owned_range(self) -> tuple[int, int]:
        """[begin, end) in elements of the flattened full parameter that this rank's slice
        holds; the slice has ceil(numel / N) elements, zero padding after end - begin."""
        part = -(-self.numel // self.comm.world_size)
        begin = min(self.comm.rank * part, self.numel)
        return begin, min(begin + part, self.numel)

    def keep(self, full: torch.Tensor) -> None:
        """Keep this rank's slice of `full`."""
        self.shape = full.shape
        begin, end = self.owned_range()
        self.keep_owned(full.reshape(-1)[begin:end], full.dtype)

    def keep_owned(self, owned: torch.Tensor, dtype: torch.dtype) -> None:
        """Keep `owned` (1-D: the elements owned_range() names, any dtype) as this rank's slice,
        in `dtype`."""
        data = torch.zeros(-(-self.numel // self.comm.world_size), dtype=dtype, device=self.device)
        data[: owned.numel()].copy_(owned)
        if self.pin and torch.cuda.is_available() and data.device.type == "cpu":
            data = data.pin_memory()
        self.data = data

    @property
    def numel(self) -> int:
        return self.shape.numel()


def guard_load_state_dict(module: torch.nn.Module) -> None:
    """Make module.load_state_dict() raise, naming the key, instead of failing on (or silently
    skipping) a size mismatch when a full value meets a partitioned parameter's 0-element
    placeholder (stage 3 engines and zero.Init models). Registers once per module."""
    if getattr(module, "_zero_load_guard", False):
        return
    module._zero_load_guard = True
    module.register_load_state_dict_pre_hook(_refuse_load_into_placeholder)


def _refuse_load_into_placeholder(module, state_dict, prefix, *args) -> None:
    for name, param in module.named_parameters(recurse=False):
        value = state_dict.get(prefix + name)
        if torch.is_tensor(value) and param.numel() == 0 and value.numel() > 0:
            raise RuntimeError(
                f"load_state_dict: '{prefix + name}' is partitioned (ZeRO stage 3 or zero.Init: "
                "outside its module's forward it is a 0-element placeholder), so the full value "
                "cannot be copied into it. Load inside `with zero.GatheredParameters("
                "list(model.parameters()), modifier_rank=0):` (rank 0's values reach every "
                "rank's shard on exit), or resume a zero checkpoint with engine.load_checkpoint"
            )


def is_partitioned(tensor) -> bool:
    """True for a parameter built under zero.Init and not yet laid out by an engine."""
    return isinstance(getattr(tensor, "zero_shard", None), InitShard)


def name_full_size(param, shape) -> None:
    """DeepSpeed's attributes for a partitioned parameter's full size, which libraries read
    (peft sizes LoRA layers from `ds_shape`; scripts count `ds_numel`)."""
    param.ds_shape, param.ds_numel = torch.Size(shape), torch.Size(shape).numel()


def full_shape(param) -> torch.Size:
    """The parameter's full shape, also while zero.Init or a stage-3 engine (its `ds_shape`,
    DeepSpeed's name) holds it partitioned."""
    if is_partitioned(param):
        return param.zero_shard.shape
    return getattr(param, "ds_shape", param.shape)


def full_numel(param) -> int:
    """The parameter's full number of elements, also while zero.Init holds it partitioned."""
    return full_shape(param).numel()


def gather_full(param) -> torch.Tensor:
    """The full value of a zero.Init parameter: (full_shape,) on the collectives' device.
    Collective over the group it is partitioned over. Raises ValueError for a parameter built on
    the meta device that has no values yet."""
    shard = param.zero_shard
    if shard.empty:
        raise ValueError(
            f"rank {shard.comm.rank}: a parameter of shape {tuple(shard.shape)} was built on the "
            "meta device under zero.Init and holds no values yet; load them first: "
            "from_pretrained inside the zero.Init context, or zero.load_pretrained(model, path) "
            "on every rank"
        )
    if shard.gathered:
        return param.data.to(shard.comm_device)
    data = shard.data.to(shard.comm_device)
    out = torch.empty(data.numel() * shard.comm.world_size, dtype=data.dtype, device=data.device)
    shard.comm.all_gather(out, data)
    return out[: shard.numel].view(shard.shape)


def take_full(param) -> torch.Tensor:
    """gather_full(), then forget the zero.Init shard (the engine lays the parameter out from
    the returned value). The parameter keeps its 0-element placeholder. Collective."""
    value = gather_full(param)
    del param.zero_shard
    return value


def gather_in_place(param) -> None:
    """Give a zero.Init parameter its full value (on the device it was built on). Collective."""
    shard = param.zero_shard
    if not shard.gathered:
        with torch.no_grad():
            param.data = gather_full(param).to(shard.home, copy=True)
        shard.gathered = True


def release_in_place(param, src: int = 0) -> None:
    """Partition a gathered zero.Init parameter again from rank `src`'s (possibly modified)
    full value. Collective."""
    shard = param.zero_shard
    if _ACTIVE is not None:
        _ACTIVE.assigned.pop(id(param), None)  # rank src's value now: equal everywhere
    with torch.no_grad():
        full = param.data.to(shard.comm_device, copy=True).contiguous()
        shard.comm.broadcast(full, src=src)
        shard.keep(full)
        param.data = torch.empty(0, dtype=param.dtype, device=shard.home)
    shard.gathered = False


class Init:
    """Context manager: parameters of modules built inside are partitioned over the
    data-parallel ranks as each module's __init__ ends.

    Args (DeepSpeed's deepspeed.zero.Init; the ones not listed are accepted and ignored):
        config, config_dict_or_path: the engine's config (path, dict or zero.Config); validated
            here. zero_optimization.offload_param.device "cpu" keeps the shards in host memory.
        data_parallel_group: a torch.distributed group to partition over (default: all ranks).
        mpu: a model-parallel unit; its data-parallel group is used.
        remote_device: "cpu" to keep shards in host memory, else the accelerator.
        enabled: False makes the context do nothing.

    torch.distributed is initialized from the launcher's environment (RANK, WORLD_SIZE, ...)
    when it is set and no process group exists; without either, there is one rank and a shard is
    the whole parameter. Collective: every rank enters the context and builds the same modules.
    Raises ConfigError (a ValueError) for a bad config, before anything is built.
    """

    def __init__(
        self,
        module=None,
        data_parallel_group=None,
        mem_efficient_linear=True,
        remote_device=None,
        pin_memory=False,
        config_dict_or_path=None,
        config=None,
        enabled=True,
        dtype=None,
        mpu=None,
        **ignored,
    ):
        from ..config import load_config

        source = config if config is not None else config_dict_or_path
        self.enabled = enabled
        launch = read_launch_env()
        cfg = None
        if source is not None and mpu is None:
            # Validate before touching torch.distributed, so a bad config costs nothing.
            world = dist.get_world_size() if dist.is_initialized() else None
            cfg = load_config(source, world_size=world or (launch.world_size if launch else 1))
        accelerator = detect_accelerator(launch.local_rank if launch else 0)
        if launch is not None and not dist.is_initialized():
            init_process_group(accelerator.backend, launch)
        self.comm = data_parallel_comm(mpu, data_parallel_group)
        if source is not None and mpu is not None:
            cfg = load_config(source, world_size=self.comm.world_size)
        # The offload_param block when shards are made in host memory ("cpu"; "nvme": the
        # engine moves them to files at initialize).
        offload = cfg.zero.offload_param if cfg is not None else None
        if offload is not None and offload.device not in ("cpu", "nvme"):
            offload = None
        self.comm_device = accelerator.device  # where collectives run
        host = remote_device == "cpu" or offload is not None
        self.device = torch.device("cpu") if host else accelerator.device  # where shards live
        self.pin_memory = pin_memory or bool(offload and offload.pin_memory)
        self._gathered: dict[int, torch.nn.Parameter] = {}  # in order of last touch
        # id(param) -> (param, CRC-32 of the value assigned to it), until it is next released
        # (see [Note: meta parameters and loaded values])
        self.assigned: dict[int, tuple] = {}
        self._patched: dict[type, tuple] = {}  # class -> (its own __init__, zero's wrapper)
        self._subclass_hook = None
        self._register_hook = None
        self._set_env = False  # this context set HF_DEACTIVATE_ASYNC_LOAD
        self._mode = None
        self._busy = False
        if module is not None and enabled:
            self._partition_tree(module)

    # ----- the context ----------------------------------------------------------------------
    def __enter__(self):
        global _ACTIVE
        if not self.enabled or _ACTIVE is not None:
            self.enabled = False
            return self
        _ACTIVE = self
        for cls in _module_classes():
            self._wrap_init(cls)
        self._subclass_hook = torch.nn.Module.__dict__.get("__init_subclass__")
        torch.nn.Module.__init_subclass__ = classmethod(_wrap_subclass_init)
        self._register_hook = torch.nn.modules.module.register_module_parameter_registration_hook(
            self._on_register
        )
        self._set_env = _SEQUENTIAL_LOAD not in os.environ
        os.environ.setdefault(_SEQUENTIAL_LOAD, "1")
        self._mode = _Catch(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        global _ACTIVE
        if not self.enabled:
            return False
        self._mode.__exit__(*exc)
        self._register_hook.remove()
        if self._set_env:
            os.environ.pop(_SEQUENTIAL_LOAD, None)
        for cls, (original, wrapper) in self._patched.items():
            # A class defined inside the context whose __init__ a class decorator replaced
            # after __init_subclass__ wrapped it (transformers' use_experts_implementation on
            # Mixtral's experts, imported lazily by from_pretrained) keeps the decorator's
            # __init__: restoring `original` would drop it; zero's wrapper inside it only
            # passes the call through once no context is open.
            if cls.__dict__.get("__init__") is wrapper:
                cls.__init__ = original
        self._patched.clear()
        if self._subclass_hook is None:
            del torch.nn.Module.__init_subclass__
        else:
            torch.nn.Module.__init_subclass__ = self._subclass_hook
        try:
            if exc[0] is None:
                self._release_all()
                self._check_assigned()
        finally:
            self.assigned.clear()
            _ACTIVE = None
        return False

    def _wrap_init(self, cls) -> None:
        if "__init__" in cls.__dict__ and cls not in self._patched:
            original = cls.__dict__["__init__"]
            cls.__init__ = _wrapped_init(original)
            self._patched[cls] = (original, cls.__init__)

    # ----- partitioning ---------------------------------------------------------------------
    def _module_built(self, module) -> None:
        """The outermost __init__ of `module` returned: partition its own parameters."""
        self._release_all()
        self._partition_params(module.parameters(recurse=False))
        guard_load_state_dict(module)

    def _partition_tree(self, module) -> None:
        self._partition_params(module.parameters())

    def _partition_params(self, params) -> None:
        for param in params:
            if is_partitioned(param) or param.numel() == 0:
                continue
            if param.is_meta:
                self._defer(param)
            else:
                self._partition(param)

    def _new_shard(self, home) -> InitShard:
        return InitShard(home, self.comm, self.comm_device, self.device, self.pin_memory)

    def _partition(self, param) -> None:
        """Broadcast rank 0's value, keep this rank's slice. Collective."""
        name_full_size(param, param.shape)
        param.zero_shard = self._new_shard(param.device)
        with self._own_ops():
            release_in_place(param)

    def _defer(self, param) -> None:
        """A parameter on the meta device: record its shape; it stays on the meta device until
        a value is assigned or loaded. Its slice will live on the host until then."""
        shard = self._new_shard(torch.device("cpu"))
        shard.shape, shard.gathered = param.shape, False
        name_full_size(param, param.shape)
        param.zero_shard = shard

    def _on_register(self, module, name, param):
        """torch's parameter registration hook while the context is open: a Parameter that
        replaces a zero.Init parameter is partitioned at once (see [Note: meta parameters and
        loaded values]). Returns None (the Parameter itself is changed)."""
        if param is None or self._busy or is_partitioned(param):
            return None
        old = module._parameters.get(name)
        if old is None or not is_partitioned(old) or param.numel() == 0:
            return None
        if param.is_meta:
            self._defer(param)
            return None
        shard = self._new_shard(param.device)
        name_full_size(param, param.shape)
        with torch.no_grad(), self._own_ops():
            self.assigned[id(param)] = (param, _crc32(param.data))
            shard.keep(param.data)
            param.data = torch.empty(0, dtype=param.dtype, device=shard.home)
        shard.gathered = False
        param.zero_shard = shard
        return None

    def _check_assigned(self) -> None:
        """Raise on every rank unless the values assigned to zero.Init parameters (and not
        released since) are equal on every rank, as far as the sum of their CRC-32s tells.
        Collective: one all-reduce of two integers."""
        if self.comm.world_size == 1:
            return
        total = sum(crc for _, crc in self.assigned.values()) % (1 << 62)
        extremes = torch.tensor([total, -total], dtype=torch.int64, device=self.comm_device)
        with self._own_ops():
            self.comm.all_reduce(extremes, op="max")
        if int(extremes[0]) != total or -int(extremes[1]) != total:
            raise ValueError(
                f"rank {self.comm.rank}: the values assigned to zero.Init parameters after their "
                f"module was built ({len(self.assigned)} on this rank, such as checkpoint tensors "
                "set by from_pretrained) differ between ranks: each rank keeps its slice of its "
                "own value, so every rank must assign the same values (load the same files on "
                "every node; draw random values with the same seed)"
            )

    def _release_all(self, keep: int = 0) -> None:
        """Partition again all but the `keep` most recently touched gathered parameters."""
        while len(self._gathered) > keep:
            param = self._gathered.pop(next(iter(self._gathered)))
            with self._own_ops():
                release_in_place(param)

    def _own_ops(self):
        return _Busy(self)

    def touch(self, params) -> None:
        """Before an operation on `params` (partitioned parameters): gather them; of the other
        gathered parameters the most recently touched stay gathered (KEEP_GATHERED in all), so
        `a.data.copy_(b.data)` and similar aliases across a few parameters work."""
        for param in params:
            self._gathered.pop(id(param), None)
            with self._own_ops():
                gather_in_place(param)
            self._gathered[id(param)] = param  # most recent last
        self._release_all(keep=max(KEEP_GATHERED, len(params)))


class _Busy:
    def __init__(self, init: Init):
        self.init = init

    def __enter__(self):
        self.previous, self.init._busy = self.init._busy, True

    def __exit__(self, *exc):
        self.init._busy = self.previous


class _Catch(TorchFunctionMode):
    """Gathers partitioned parameters that a torch operation touches (see [Note: touching a
    partitioned parameter])."""

    def __init__(self, init: Init):
        super().__init__()
        self.init = init

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.init._busy:
            params = [t for t in tensors_in((args, kwargs)) if _has_values(t)]
            if params:
                self.init.touch(list({id(p): p for p in params}.values()))
        return func(*args, **kwargs)


def own_ops():
    """A context in which torch operations on zero.Init parameters are zero's own (an open
    zero.Init context does not gather what they touch)."""
    return _ACTIVE._own_ops() if _ACTIVE is not None else contextlib.nullcontext()


def refuse_meta(module: torch.nn.Module, rank: int) -> None:
    """Raise ValueError naming the parameters and buffers of `module` that are still on the
    meta device (they have no values)."""
    names = [n for n, t in (*module.named_parameters(), *module.named_buffers()) if t.is_meta]
    if names:
        raise ValueError(
            f"rank {rank}: {len(names)} parameters or buffers of the model are on the meta "
            f"device and have no values, such as {names[:5]}: load them first with "
            "zero.load_pretrained(model, path) on every rank (or from_pretrained inside "
            "zero.Init), or build the model outside torch.device('meta')"
        )


def _has_values(tensor) -> bool:
    """A zero.Init parameter that holds values (not an empty one, on the meta device)."""
    return is_partitioned(tensor) and not tensor.zero_shard.empty


def _crc32(tensor: torch.Tensor) -> int:
    """CRC-32 of the tensor's bytes (read through a host copy when it is on a device)."""
    flat = tensor.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return zlib.crc32(flat.contiguous().view(torch.uint8).numpy())


def tensors_in(value):
    """The tensors in `value`, searching lists, tuples and dict values recursively."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item)


def _module_classes() -> set:
    seen, stack = set(), [torch.nn.Module]
    while stack:
        for sub in stack.pop().__subclasses__():
            if sub not in seen:
                seen.add(sub)
                stack.append(sub)
    return seen


def _wrapped_init(init):
    @functools.wraps(init)
    def wrapper(module, *args, **kwargs):
        ctx = _ACTIVE
        if ctx is None:
            return init(module, *args, **kwargs)
        depth = module.__dict__.get("_zero_init_depth", 0)
        object.__setattr__(module, "_zero_init_depth", depth + 1)
        try:
            init(module, *args, **kwargs)
        finally:
            if depth == 0:
                del module.__dict__["_zero_init_depth"]
            else:
                object.__setattr__(module, "_zero_init_depth", depth)
        if depth == 0:
            ctx._module_built(module)

    return wrapper


def _wrap_subclass_init(cls, **kwargs):
    """nn.Module.__init_subclass__ while a context is open: classes defined inside it are
    wrapped too."""
    super(torch.nn.Module, cls).__init_subclass__(**kwargs)
    if _ACTIVE is not None and "__init__" in cls.__dict__:
        _ACTIVE._wrap_init(cls)
