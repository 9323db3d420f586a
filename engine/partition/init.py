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

[Note: held parameters]
zero.GatheredParameters inside the context (transformers gathers a weight in __init__ or
_init_weights: distilbert's sinusoidal table written on rank 0 alone, the weight_norm of
wav2vec2's positional conv) holds its parameters: hold() gathers them and counts the hold on the
shard (InitShard.holds); a held parameter is not among the recently touched ones, so neither a
torch operation on it (which may run on one rank only) nor a module finishing __init__ gathers
or releases it, and aliases of it stay valid for the whole block. The last unhold() releases it:
rank `source`'s full value is broadcast and each rank keeps its slice, where `source` is the
modifier_rank of the last block to exit that set one (rank 0 when none did). Blocks nested in an
outer one on the same parameters communicate nothing, neither on entry nor on exit, so code
that runs on rank 0 alone may open them (transformers initializes weights on rank 0 alone inside
GatheredParameters(params, modifier_rank=0), and _init_weights opens its own blocks); their
modifications reach the other ranks when the outermost block exits. One owner per gathered
state: a parameter is released only while gathered, exactly once.

[Note: construction memory]
A rank holds its slices (1/N of the model) plus, at any moment, the parameters gathered for
operations (see above) and one parameter being partitioned: gathering writes the full value into
one new buffer; releasing broadcasts from rank `src`'s own value, uncopied, while the other
ranks drop theirs before receiving, and the slice is written over, so one full value and one
slice coexist (1.5 times the parameter on 2 ranks). On 2 ranks the construction of a Llama
(benchmarks/load_pretrained_rss.py) peaks at half the model plus 1.5 times its largest tensor.

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
Uncast, every page of the mapped file ends in every rank's resident set (the CRC-32 of each
assigned value reads it whole): 1.5 times the model per rank in VmRSS on 2 ranks, although
private memory held half. transformers opens the files with safetensors' safe_open(...,
backend="mmap"); while the context is open, zero has its calls (transformers.modeling_utils.
safe_open) use safetensors' "pread" backend instead, which reads each tensor into private
memory when it is materialized, so it is freed once partitioned. A call without a backend
argument (an older transformers) is left as it is.
"""

import contextlib
import functools
import os
import sys
import zlib
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

# get_accelerator: DeepSpeed's partition_parameters imports deepspeed.accelerator's, and
# transformers calls it through that module (zero-as-deepspeed maps it onto this one).
from ..accelerator import detect_accelerator
from ..accelerator import get_accelerator as get_accelerator
from ..comm import Communicator, data_parallel_comm, init_process_group, read_launch_env
from .ds_params import ZeroParamStatus, describe, forget, set_status, set_tensor

_ACTIVE = None  # the Init context in force (contexts do not nest: an inner one does nothing)
# transformers' switch for materializing checkpoint tensors one at a time ([Note: meta ...]).
_SEQUENTIAL_LOAD = "HF_DEACTIVATE_ASYNC_LOAD"
# transformers' module that opens safetensors files ([Note: meta parameters and loaded values]).
_HF_LOADER = "transformers.modeling_utils"
# Parameters kept gathered inside the context after their last touch (see [Note: touching a
# partitioned parameter]); enough for code that aliases a few parameters at once.
KEEP_GATHERED = 4


def _read_checkpoints_with_pread():
    """Have transformers' safe_open read tensors with safetensors' "pread" backend instead of
    mapping the file ([Note: meta parameters and loaded values]). Returns the function replaced,
    to be restored on exit, or None when transformers' loader is not imported yet (it is imported
    with the first model class of transformers, before any checkpoint is opened: Init tries again
    as each module is built) or its safe_open was replaced already."""
    loader = sys.modules.get(_HF_LOADER)
    original = getattr(loader, "safe_open", None)
    if original is None or getattr(original, "zero_replaces", None) is not None:
        return None

    @functools.wraps(original)
    def safe_open(*args, **kwargs):
        if kwargs.get("backend") == "mmap":
            kwargs["backend"] = "pread"
        return original(*args, **kwargs)

    safe_open.zero_replaces = original
    loader.safe_open = safe_open
    return original


class InitShard:
    """This rank's slice of a parameter built under zero.Init.

    param: the parameter. shape: the full shape. data: (ceil(numel / N),) the rank's slice,
    zero-padded, in the parameter's dtype, on `device` (page-locked when `pin` and CUDA exists).
    comm: the data-parallel Communicator it is partitioned over, whose collectives run on
    `comm_device`. home: the device the parameter was built on (its placeholder's). gathered:
    the parameter holds its full value right now.

    The parameter's DeepSpeed attributes are views of this shard ([Note: attributes are views]
    in ds_params.py): `ds_tensor` is `data` (DeepSpeed's layout exactly: ceil(numel / N)
    elements, zero padding at the end of the last ranks' slices; None while a parameter built on
    the meta device has no values) and `ds_status` follows `gathered` (AVAILABLE or
    NOT_AVAILABLE; gathering here is synchronous, so never INFLIGHT). Both are written only by
    the `gathered` setter and keep_owned(). holds: open zero.GatheredParameters blocks that
    keep the parameter gathered, and source: the modifier_rank of the last of them to exit that
    set one, whose value the release broadcasts ([Note: held parameters]).
    """

    def __init__(self, param, home, comm: Communicator, comm_device, device, pin):
        # The shard refers to its parameter (which refers to the shard) to keep the parameter's
        # attributes in step; the cycle ends when an engine takes the shard (take_full), or is
        # collected with the model. Not a weak reference: swap_tensors refuses those.
        self.param = param
        self.home, self.comm, self.comm_device = home, comm, comm_device
        self.device, self.pin = device, pin
        self.shape = self.data = None
        set_tensor(param, None)
        self.gathered = True  # until release_in_place() keeps the slice
        self.holds, self.source = 0, None

    @property
    def gathered(self) -> bool:
        return self._gathered

    @gathered.setter
    def gathered(self, value: bool) -> None:
        self._gathered = value
        status = ZeroParamStatus.AVAILABLE if value else ZeroParamStatus.NOT_AVAILABLE
        set_status([self.param], status)

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
        in `dtype`. The slice held so far is written over when its size and dtype match (a
        release after a gather), so that no second slice is allocated."""
        size, data = -(-self.numel // self.comm.world_size), self.data
        if data is None or data.numel() != size or data.dtype != dtype:
            data = torch.zeros(size, dtype=dtype, device=self.device)
            if self.pin and torch.cuda.is_available() and data.device.type == "cpu":
                data = data.pin_memory()
        else:
            data[owned.numel() :].zero_()
        data[: owned.numel()].copy_(owned)
        self.data = data
        set_tensor(self.param, data)

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
    """DeepSpeed's attributes for a partitioned parameter's identity and full size, which
    libraries read (peft sizes LoRA layers from `ds_shape`; scripts count `ds_numel` and test
    `hasattr(p, "ds_id")`): ds_id (kept once given), ds_shape, ds_numel. See ds_params.py."""
    describe(param, shape)


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
    _refuse_empty(shard)
    if shard.gathered:
        return param.data.to(shard.comm_device)
    data = shard.data.to(shard.comm_device)
    out = torch.empty(data.numel() * shard.comm.world_size, dtype=data.dtype, device=data.device)
    shard.comm.all_gather(out, data)
    return out[: shard.numel].view(shard.shape)


def _refuse_empty(shard: InitShard) -> None:
    if shard.empty:
        raise ValueError(
            f"rank {shard.comm.rank}: a parameter of shape {tuple(shard.shape)} was built on the "
            "meta device under zero.Init and holds no values yet; load them first: "
            "from_pretrained inside the zero.Init context, or zero.load_pretrained(model, path) "
            "on every rank"
        )


def take_full(param) -> torch.Tensor:
    """gather_full(), then forget the zero.Init shard (the engine lays the parameter out from
    the returned value) and DeepSpeed's attributes with it (stages 0-2 hold the parameter
    whole; stage 3 describes it anew, same ds_id). The parameter keeps its 0-element
    placeholder. Collective."""
    value = gather_full(param)
    del param.zero_shard
    forget(param)
    return value


def gather_in_place(param) -> None:
    """Give a zero.Init parameter its full value (on the device it was built on). Collective."""
    shard = param.zero_shard
    if not shard.gathered:
        with torch.no_grad():
            param.data = gather_full(param).to(shard.home)  # gathered into a new buffer
        shard.gathered = True


def release_in_place(param, src: int = 0) -> None:
    """Partition a gathered zero.Init parameter again from rank `src`'s (possibly modified)
    full value. Collective."""
    shard = param.zero_shard
    # Released twice, the 0-element placeholder would become the "full value" (shape (0,)).
    assert shard.gathered, f"rank {shard.comm.rank}: release of a parameter not gathered"
    if _ACTIVE is not None:
        _ACTIVE.assigned.pop(id(param), None)  # rank src's value now: equal everywhere
    with torch.no_grad():
        if shard.comm.rank != src:
            # This rank's own value is replaced: drop it before receiving rank src's, so that
            # at most one full copy and the slice exist at once ([Note: construction memory]).
            shape = param.shape
            param.data = torch.empty(0, dtype=param.dtype, device=shard.home)
            full = torch.empty(shape, dtype=param.dtype, device=shard.comm_device)
        else:
            full = param.data.to(shard.comm_device).contiguous()  # sent as is: broadcast reads it
        shard.comm.broadcast(full, src=src)
        shard.keep(full)
        param.data = torch.empty(0, dtype=param.dtype, device=shard.home)
    shard.gathered = False


def hold(params) -> None:
    """Gather zero.Init parameters (each at most once in `params`) and keep them gathered until
    unhold(), whatever an open zero.Init context does meanwhile ([Note: held parameters]); for
    zero.GatheredParameters. Holds nest. Collective (in the same order on every rank) for the
    parameters not gathered yet; none for the others. Raises ValueError, before gathering any,
    for a parameter built on the meta device that has no values yet."""
    params = list(params)
    for param in params:
        _refuse_empty(param.zero_shard)
    for param in params:
        if _ACTIVE is not None:
            _ACTIVE.forget_touch(param)  # held now: the context no longer releases it
        with own_ops():
            gather_in_place(param)
        param.zero_shard.holds += 1


def unhold(params, modifier_rank: int | None = None) -> None:
    """End one hold() of each of `params`. A parameter no longer held is partitioned again from
    the full value of rank `modifier_rank`, or of the last inner block's modifier_rank when it
    is None, or of rank 0 ([Note: held parameters]): collective then. A parameter still held
    only records `modifier_rank`, without communication. Parameters an engine has taken since
    (zero.initialize inside the block) are skipped."""
    for param in params:
        if not is_partitioned(param):
            continue
        shard = param.zero_shard
        assert shard.holds > 0, f"rank {shard.comm.rank}: unhold of a parameter not held"
        shard.holds -= 1
        if modifier_rank is not None:
            shard.source = modifier_rank
        if shard.holds == 0:
            source, shard.source = shard.source, None
            with own_ops():
                release_in_place(param, src=source or 0)


# [Note: the keys Init reads]
# zero.Init is entered with the training config before the model exists, often a config that is
# not finished: transformers passes deepspeed_config(), whose "auto" batch sizes, scheduler values
# and bucket sizes are filled only once the model is built, and accelerate sets steps_per_print to
# float("inf"). Init uses only zero_optimization.offload_param (where shards live; checked with
# zero_optimization.stage, since parameter offload needs stage 3) and the compute dtype
# (fp16.enabled, bf16.enabled or its old name bfloat16.enabled). It reads those keys alone and
# validates them as zero.initialize does (an "auto" or a wrong value there is a ConfigError); the
# other keys are zero.initialize's to check. zero.Init casts nothing: a parameter keeps the dtype
# its construction gives until zero.initialize casts it to the compute dtype, so the fp32 master
# weights start from the values built (DeepSpeed builds parameters in the compute dtype, which
# rounds them first); Init.dtype says the dtype training will use.
_INIT_KEYS = {
    "zero_optimization": ("stage", "offload_param", "cpu_offload_param"),
    "fp16": ("enabled",),
    "bf16": ("enabled",),
    "bfloat16": ("enabled",),  # DeepSpeed's old name of bf16
}
_FILE_TYPES = (".json", ".hjson", ".yaml", ".yml")
_INIT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def read_init_config(source):
    """The config keys zero.Init reads ([Note: the keys Init reads]), validated, as a zero.Config
    (read its zero.stage, zero.offload_param and compute_dtype only); None when `source` is None.

    source: a path (.json, .hjson, .yaml, .yml), a mapping, or a zero.Config (returned as it
    is). Raises ConfigError (a ValueError) naming the key for a wrong value of a key it reads,
    and for a file that cannot be read or parsed. Not a collective.
    """
    from ..config import Config, ConfigError, load_config

    if source is None or isinstance(source, Config):
        return source
    where, data = _config_data(source)
    subset = {"train_micro_batch_size_per_gpu": 1}  # the batch sizes are not Init's: any valid
    for block, keys in _INIT_KEYS.items():
        if block in data:
            value = data[block]
            subset[block] = (
                {k: value[k] for k in keys if k in value} if isinstance(value, Mapping) else value
            )
    try:
        return load_config(subset)
    except ConfigError as error:
        message = str(error).removeprefix("config: ")
        raise ConfigError(f"zero.Init ({where}): {message}") from None


def _config_data(source) -> tuple[str, Mapping]:
    """(words for the source, its top-level mapping), unchecked: a path is parsed, nothing
    else of it is interpreted."""
    from ..config import ConfigError
    from ..config.parse import _parse, _read_text

    if isinstance(source, Mapping):
        return "the config dict", source
    if not isinstance(source, (str, os.PathLike)):
        raise ConfigError(
            f"zero.Init: config_dict_or_path must be a path, a dict or a zero.Config, not "
            f"{type(source).__name__}"
        )
    path = Path(source)
    where = f"config file '{path}': "
    if path.suffix.lower() not in _FILE_TYPES:
        raise ConfigError(
            f"{where}unknown file type '{path.suffix}'; use .json, .hjson, .yaml or .yml."
        )
    data = _parse(_read_text(path, where), path.suffix.lower(), where)
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"{where}the top level must be a mapping of keys, got {type(data).__name__}."
        )
    return where.removesuffix(": "), data


def _init_dtype(dtype, cfg) -> torch.dtype:
    """Init.dtype: `dtype` if given (one of float16, bfloat16, float32, and the config's compute
    dtype when there is a config), else the config's compute dtype, else float32."""
    if dtype is not None and dtype not in _INIT_DTYPES:
        raise ValueError(
            f"zero.Init: dtype={dtype!r}; use torch.float16, torch.bfloat16 or torch.float32"
        )
    if cfg is None:
        return dtype or torch.float32
    if dtype is not None and dtype != cfg.compute_dtype:
        raise ValueError(
            f"zero.Init: dtype={dtype} but the config trains in {cfg.compute_dtype} (fp16 / bf16 "
            "enabled): zero trains in the config's dtype; omit dtype or set the config's"
        )
    return cfg.compute_dtype


def _one_of(name: str, value, alias):
    """`value`, or DeepSpeed's other name for the same argument; ValueError when both differ."""
    if value is not None and alias is not None and value is not alias:
        raise ValueError(
            f"zero.Init: {name} is given twice, under two of DeepSpeed's names, with different "
            "values; pass one"
        )
    return value if value is not None else alias


def _refuse_zero_plus_plus(**given) -> None:
    """NotImplementedError for DeepSpeed's Init arguments zero does not implement, unless at
    their defaults (None or False)."""
    for name, value in given.items():
        if value is not None and value is not False:
            raise NotImplementedError(
                f"zero.Init: {name}={value!r} (ZeRO++ hierarchical partitioning and quantized "
                "weights, or DeepSpeed's own parameter swapper) is not implemented by zero; "
                "leave it at its default (parameter offload to nvme is "
                "zero_optimization.offload_param in the config)"
            )


# DeepSpeed's partition_parameters names that transformers' prevent_arange_dtype_change reads
# (deepspeed.runtime.zero.partition_parameters, mapped onto this module by zero-as-deepspeed).
_orig_torch_arange = torch.arange  # torch.arange as it was when zero was imported


def zero_wrapper_for_fp_tensor_constructor(fn, target_fp_dtype, target_device):
    """DeepSpeed's partition_parameters.zero_wrapper_for_fp_tensor_constructor: the tensor
    constructor `fn` (torch.arange, torch.zeros, ...) made to build on `target_device` when a
    call names no device, and to give floating-point results `target_fp_dtype` (None leaves
    either unchanged). DeepSpeed's Init wraps torch's constructors with it. zero.Init wraps no
    constructor and never calls it, so transformers' prevent_arange_dtype_change (which swaps
    this name for a version that spares torch.arange, then restores it) changes nothing under
    zero, which is what it wants: explicit dtypes of RoPE buffers stay."""

    @functools.wraps(fn)
    def build(*args, **kwargs):
        if target_device is not None and kwargs.get("device") is None:
            kwargs["device"] = target_device
        tensor = fn(*args, **kwargs)
        if target_fp_dtype is not None and tensor.is_floating_point():
            tensor.data = tensor.data.to(target_fp_dtype)
        return tensor

    return build


class Init:
    """Context manager: parameters of modules built inside are partitioned over the
    data-parallel ranks as each module's __init__ ends. DeepSpeed's deepspeed.zero.Init.

    Args (DeepSpeed's names and order):
        module: an already built model to partition now (DeepSpeed's `Init(module=model)`).
        data_parallel_group: a torch.distributed group to partition over (default: all ranks);
            `sequence_data_parallel_group`, DeepSpeed's deprecated name for it, is read too.
        mem_efficient_linear: accepted, no effect (zero's stage 3 needs no Linear of its own).
        remote_device: "cpu" to keep shards in host memory, else the accelerator.
        pin_memory: page-lock host shards.
        config_dict_or_path, config (DeepSpeed's deprecated name; give one): the engine's
            config, a path, dict or zero.Config. Only the keys Init uses are read ([Note: the
            keys Init reads]); zero_optimization.offload_param.device "cpu" keeps the shards in
            host memory.
        enabled: False makes the context do nothing.
        dtype: torch.float16, torch.bfloat16 or torch.float32, kept as `self.dtype` (default:
            the config's compute dtype). zero.Init does not cast parameters (see [Note: the
            keys Init reads]).
        mpu: a model-parallel unit; its data-parallel group is used.
        tensor_overrides: accepted; zero.Init does not wrap tensor constructors, so no tensor's
            dtype or device is overridden (see zero_wrapper_for_fp_tensor_constructor).
        zero_param_parallel_group, zero_quantized_weights, zero_quantized_nontrainable_weights,
        param_swapper: ZeRO++ and DeepSpeed's own swapper: NotImplementedError unless left at
            their defaults.

    torch.distributed is initialized from the launcher's environment (RANK, WORLD_SIZE, ...)
    when it is set and no process group exists; without either, there is one rank and a shard is
    the whole parameter. Collective: every rank enters the context and builds the same modules.
    Raises ConfigError (a ValueError) for a bad value of a key it reads, ValueError for
    arguments that contradict each other, before anything is built.
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
        zero_param_parallel_group=None,
        zero_quantized_weights=False,
        zero_quantized_nontrainable_weights=False,
        sequence_data_parallel_group=None,
        param_swapper=None,
        tensor_overrides=None,
    ):
        _refuse_zero_plus_plus(
            zero_param_parallel_group=zero_param_parallel_group,
            zero_quantized_weights=zero_quantized_weights,
            zero_quantized_nontrainable_weights=zero_quantized_nontrainable_weights,
            param_swapper=param_swapper,
        )
        group = _one_of("data_parallel_group", data_parallel_group, sequence_data_parallel_group)
        # Validate before touching torch.distributed, so a bad config costs nothing.
        cfg = read_init_config(_one_of("config_dict_or_path", config_dict_or_path, config))
        self.dtype = _init_dtype(dtype, cfg)
        self.enabled = enabled
        launch = read_launch_env()
        accelerator = detect_accelerator(launch.local_rank if launch else 0)
        if launch is not None and not dist.is_initialized():
            init_process_group(accelerator.backend, launch)
        self.comm = data_parallel_comm(mpu, group)
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
        self._hf_safe_open = None  # transformers' safe_open, while zero's replaces it
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
        self._read_checkpoints_with_pread()
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
        if self._hf_safe_open is not None:
            sys.modules[_HF_LOADER].safe_open = self._hf_safe_open
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
        self._read_checkpoints_with_pread()
        self._release_all()
        self._partition_params(module.parameters(recurse=False))
        guard_load_state_dict(module)

    def _read_checkpoints_with_pread(self) -> None:
        if self._hf_safe_open is None:
            self._hf_safe_open = _read_checkpoints_with_pread()

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

    def _new_shard(self, param, home) -> InitShard:
        name_full_size(param, param.shape)
        return InitShard(param, home, self.comm, self.comm_device, self.device, self.pin_memory)

    def _partition(self, param) -> None:
        """Broadcast rank 0's value, keep this rank's slice. Collective."""
        param.zero_shard = self._new_shard(param, param.device)
        with self._own_ops():
            release_in_place(param)

    def _defer(self, param) -> None:
        """A parameter on the meta device: record its shape; it stays on the meta device until
        a value is assigned or loaded. Its slice will live on the host until then."""
        shard = self._new_shard(param, torch.device("cpu"))
        shard.shape, shard.gathered = param.shape, False
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
        shard = self._new_shard(param, param.device)
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

    def forget_touch(self, param) -> None:
        """`param` is held from now on ([Note: held parameters]): drop it from the recently
        touched parameters, gathered or not, without releasing it."""
        self._gathered.pop(id(param), None)

    def touch(self, params) -> None:
        """Before an operation on `params` (partitioned parameters): gather them; of the other
        gathered parameters the most recently touched stay gathered (KEEP_GATHERED in all), so
        `a.data.copy_(b.data)` and similar aliases across a few parameters work. Held parameters
        are skipped: gathered already, they may be touched on one rank alone."""
        params = [p for p in params if p.zero_shard.holds == 0]
        if not params:
            return
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
