"""DeepSpeed's parameter attributes (ds_id, ds_status, ds_tensor, ds_shape, ds_numel) on stage-3
and zero.Init parameters, the idioms scripts build on them (DeepSpeed-Chat's stage-3 save, TRL's
status filter, peft's size count), zero.Init(config_dict_or_path=...) with a Hugging Face style
config, and the error for a model that DeepSpeed's own zero.Init partitioned.

One group of 2 ranks is spawned; every multi-rank case runs inside it.
"""

import enum
import sys
import types

import pytest
import torch
from distributed import full_params, run_ranks
from torch import nn

DIM = 6
STEPS = 3


class Probe(torch.autograd.Function):
    """Identity whose backward records the parameters' DeepSpeed status (RECORD)."""

    @staticmethod
    def forward(ctx, h):
        return h.view_as(h)

    @staticmethod
    def backward(ctx, grad):
        if RECORD is not None:
            RECORD("backward")
        return grad


RECORD = None  # set by the sweep: RECORD(label) observes every parameter


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(DIM, DIM)
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.l2 = nn.Linear(DIM, DIM)
        self.l3 = nn.Linear(DIM, 1)
        self.scale = nn.Parameter(torch.ones(1))  # below the persistence threshold
        self.empty = nn.Parameter(torch.zeros(0))  # nothing to partition

    def forward(self, x):
        h = Probe.apply(torch.tanh(self.l1(x)))
        h = torch.tanh(self.l2(self.frozen(h)))
        return (self.l3(h) * self.scale).pow(2).mean()


def config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 40,
            "stage3_module_granularity_threshold": 50,
            "stage3_param_persistence_threshold": 2,
            "stage3_prefetch_bucket_size": 10_000,
            "stage3_max_reuse_distance": 0,
        },
    }


# A config as transformers' deepspeed_config() and accelerate hand it to zero.Init: "auto"
# values not filled yet, train_batch_size absent, steps_per_print infinite.
HF_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": float("inf"),
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}},
    "fp16": {"enabled": False, "loss_scale": "auto"},
    "bf16": {"enabled": False},
    "zero_optimization": {
        "stage": 3,
        "offload_param": {"device": "none"},
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_gather_16bit_weights_on_model_save": True,
    },
}


def _z3_params_to_fetch(param_list):
    """DeepSpeed-Chat's utils._z3_params_to_fetch, as written there."""
    from zero.zero import ZeroParamStatus

    return [
        p
        for p in param_list
        if hasattr(p, "ds_id") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE
    ]


def deepspeed_chat_save(model) -> dict:
    """DeepSpeed-Chat's save_zero_three_model loop (collective), on rank 0's dict."""
    import zero

    out = {}
    for k, v in model.named_parameters():
        if hasattr(v, "ds_id"):
            with zero.GatheredParameters(_z3_params_to_fetch([v]), enabled=True):
                v_p = v.data.cpu()
        else:
            v_p = v.cpu()
        out[k] = v_p.clone()
    return out


def trl_not_available(model) -> list:
    """TRL's filter: no hasattr, only `ds_status != AVAILABLE`."""
    from zero.zero import ZeroParamStatus

    return [n for n, p in model.named_parameters() if p.ds_status != ZeroParamStatus.AVAILABLE]


def peft_count(model) -> int:
    """peft's count of parameters (get_nb_trainable_parameters)."""
    total = 0
    for p in model.parameters():
        num = p.numel()
        if num == 0 and hasattr(p, "ds_numel"):
            num = p.ds_numel
        total += num
    return total


def _observer(engine, events):
    names = {id(p): n for n, p in engine.module.named_parameters()}

    def record(label):
        seen = {}
        # Without torch function modes: inside the model's forward, zero's usage guard would
        # gather a released parameter that p.numel() touches.
        with torch._C.DisableTorchFunction():
            for p in engine.module.parameters():
                unit = engine.gatherer.unit_of(p)
                state = unit.state.name if unit is not None else None
                seen[names[id(p)]] = (p.ds_status.name, p.numel(), p.ds_numel, state)
        events.append((label, seen))

    return record


def _consistent(events) -> list:
    """Observations where ds_status disagrees with the parameter's data and its unit's state."""
    wrong = []
    for label, seen in events:
        for name, (status, numel, ds_numel, state) in seen.items():
            if ds_numel == 0:
                ok = status == "AVAILABLE"
            elif status == "AVAILABLE":
                ok = numel == ds_numel
            elif status == "INFLIGHT":
                ok = numel == 0 and state == "GATHERING"
            else:
                ok = numel == 0 and state != "GATHERING"
            if not ok:
                wrong.append((label, name, status, numel, state))
    return wrong


def _gathered_ds_tensors(model, world: int) -> dict:
    """name -> the ranks' ds_tensors joined in rank order (collective)."""
    import torch.distributed as dist

    out = {}
    for name, p in model.named_parameters():
        parts = [None] * world
        dist.all_gather_object(parts, p.ds_tensor.detach().cpu().clone())
        out[name] = torch.cat(parts)
    return out


def stage3_case(out):
    """Status transitions across forward, backward and step; the idioms; ds_tensor."""
    global RECORD
    import torch.distributed as dist

    import zero
    from zero.partition.ds_params import partitioned_elsewhere

    torch.manual_seed(0)
    engine, *_ = zero.initialize(model=Net(), config=config(3))
    model, events = engine.module, []
    RECORD = _observer(engine, events)
    RECORD("initialize")
    model.l2.register_forward_pre_hook(lambda *args: RECORD("l2 forward"))
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x = torch.randn(2, 2, DIM, generator=g)[dist.get_rank()]
        loss = engine(x)
        RECORD("after forward")
        engine.backward(loss)
        RECORD("after backward")
        engine.step()
        RECORD("after step")
    with zero.GatheredParameters(list(model.parameters())):
        RECORD("gathered")
        out["trl_inside"] = trl_not_available(model)
    RECORD("after gathered")
    RECORD = None
    out["inconsistent"] = _consistent(events)
    out["events"] = events
    ids = [p.ds_id for p in model.parameters()]
    out["ids"] = ids
    out["ids_other_rank"] = [None, None]
    dist.all_gather_object(out["ids_other_rank"], ids)
    out["trl_rest"] = trl_not_available(model)
    out["peft"] = (peft_count(model), sum(p.ds_numel for p in model.parameters()))
    out["foreign"] = [n for n, p in model.named_parameters() if partitioned_elsewhere(p)]
    full = full_params(engine)
    out["chat_save"] = {
        k: torch.equal(v, full[k]) and v.shape == full[k].shape
        for k, v in deepspeed_chat_save(model).items()
    }
    joined = _gathered_ds_tensors(model, dist.get_world_size())
    out["ds_tensor"] = {k: torch.equal(joined[k], full[k].reshape(-1)) for k in full}
    # DeepSpeed's parameter methods: Lightning's model summary calls partition_numel()
    out["partition_numel"] = {
        n: p.partition_numel() == p.ds_tensor.numel()
        and p.ds_summary()["ds_shape"] == tuple(p.ds_shape)
        for n, p in model.named_parameters()
    }
    out["ds_shape"] = {
        n: tuple(p.ds_shape) == tuple(full[n].shape) for n, p in model.named_parameters()
    }


def init_case(out):
    """zero.Init with a Hugging Face style config; attributes of zero.Init parameters; ds_id
    kept by a stage-3 engine; none at stage 2."""
    import torch.distributed as dist

    import zero
    from zero.init import gather_full
    from zero.zero import ZeroParamStatus

    world = dist.get_world_size()
    torch.manual_seed(0)
    with zero.Init(config_dict_or_path=HF_CONFIG) as ctx:
        model = Net()
    out["init_dtype"] = ctx.dtype
    partitioned = [(n, p) for n, p in model.named_parameters() if n != "empty"]
    out["init_status"] = {n: p.ds_status.name for n, p in partitioned}
    out["init_ds_tensor"] = {}
    for n, p in partitioned:
        full = gather_full(p)
        parts = [None] * world
        dist.all_gather_object(parts, p.ds_tensor.cpu().clone())
        size = -(-p.ds_numel // world)
        out["init_ds_tensor"][n] = (
            all(part.numel() == size for part in parts)
            and torch.equal(torch.cat(parts)[: p.ds_numel], full.reshape(-1))
            and p.ds_tensor.ds_numel == size
        )
    with zero.GatheredParameters(model.l1.weight):
        out["init_gathered"] = (model.l1.weight.ds_status, model.l1.weight.numel())
    out["init_released"] = model.l1.weight.ds_status
    out["init_chat_save"] = {
        k: (v.shape, tuple(model.get_parameter(k).ds_shape))
        for k, v in deepspeed_chat_save(model).items()
        if k != "empty"
    }
    ids = {n: p.ds_id for n, p in partitioned}
    out["init_ids_unique"] = len(set(ids.values())) == len(ids)
    engine, *_ = zero.initialize(model=model, config=config(3))
    out["ids_kept"] = {n: p.ds_id for n, p in engine.module.named_parameters() if n in ids} == ids
    out["not_available"] = all(
        p.ds_status is ZeroParamStatus.NOT_AVAILABLE
        for n, p in engine.module.named_parameters()
        if n in ids and n not in ("scale", "l3.bias")
    )
    # stages 0-2 hold parameters whole: none of DeepSpeed's attributes, as DeepSpeed
    attrs = ("ds_id", "ds_status", "ds_tensor", "ds_shape", "ds_numel")
    for label, init in (("stage2_init", True), ("stage2_plain", False)):
        torch.manual_seed(0)
        if init:
            with zero.Init(config_dict_or_path=HF_CONFIG):
                model = Net()
        else:
            model = Net()
        engine, *_ = zero.initialize(model=model, config=config(2))
        out[label] = [
            (n, a) for n, p in engine.module.named_parameters() for a in attrs if hasattr(p, a)
        ]


def sweep():
    import torch.distributed as dist

    dist.init_process_group("gloo")
    out = {"rank": dist.get_rank()}
    stage3_case(out)
    init_case(out)
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(sweep, 2)


def _statuses(events, label, names):
    return [tuple(seen[n][0] for n in names) for lab, seen in events if lab == label]


def test_ds_status_follows_the_units_through_forward_backward_and_step(results):
    for res in results:
        assert res["inconsistent"] == []
        events = res["events"]
        seen = {status for _, s in events for status, *_ in s.values()}
        assert seen == {"AVAILABLE", "NOT_AVAILABLE", "INFLIGHT"}
        layers = ("l1.weight", "l2.weight", "l3.weight", "frozen.weight")
        at_rest = [("NOT_AVAILABLE",) * 4]
        for label in ("initialize", "after backward", "after step", "after gathered"):
            assert set(_statuses(events, label, layers)) == set(at_rest), label
        # persistent and empty parameters are always available
        for label, s in events:
            assert s["scale"][0] == s["empty"][0] == "AVAILABLE", label
        # l2's own parameters are gathered for its forward; l3 was prefetched in flight from
        # the second step on (the first step records the order)
        l2 = _statuses(events, "l2 forward", ("l2.weight", "l3.weight"))
        assert l2[0] == ("AVAILABLE", "NOT_AVAILABLE")
        assert l2[1:] == [("AVAILABLE", "INFLIGHT")] * (STEPS - 1)
        assert set(_statuses(events, "gathered", layers)) == {("AVAILABLE",) * 4}
        assert _statuses(events, "backward", ("l2.weight",))[0] == ("NOT_AVAILABLE",)


def test_ds_id_is_unique_per_parameter_and_equal_across_ranks(results):
    for res in results:
        assert len(set(res["ids"])) == len(res["ids"])
        assert res["ids_other_rank"][0] == res["ids_other_rank"][1]


def test_deepspeed_chat_save_gives_the_full_weights(results):
    for res in results:
        assert res["chat_save"] and all(res["chat_save"].values()), res["chat_save"]


def test_trl_and_peft_idioms(results):
    for res in results:
        # every partitioned parameter but the persistent ones (l3.bias, scale: 1 element)
        sharded = [n + s for n in ("l1", "frozen", "l2") for s in (".weight", ".bias")]
        assert sorted(res["trl_rest"]) == sorted([*sharded, "l3.weight"])
        assert res["trl_inside"] == []
        assert res["peft"][0] == res["peft"][1] == sum(p.numel() for p in Net().parameters())


def test_ds_tensor_is_this_ranks_part_of_the_shard(results):
    for res in results:
        assert all(res["ds_tensor"].values()), res["ds_tensor"]
        assert all(res["partition_numel"].values()), res["partition_numel"]
        assert all(res["ds_shape"].values())
        assert res["foreign"] == []  # zero's own attributes are not taken for DeepSpeed's


def test_init_with_a_hugging_face_config_and_its_attributes(results):
    from zero.zero import ZeroParamStatus

    for res in results:
        assert res["init_dtype"] == torch.float32
        assert set(res["init_status"].values()) == {"NOT_AVAILABLE"}
        assert all(res["init_ds_tensor"].values()), res["init_ds_tensor"]
        assert res["init_gathered"] == (ZeroParamStatus.AVAILABLE, DIM * DIM)
        assert res["init_released"] is ZeroParamStatus.NOT_AVAILABLE
        assert all(tuple(shape) == full for shape, full in res["init_chat_save"].values())
        assert res["init_ids_unique"] and res["ids_kept"] and res["not_available"]
        assert res["stage2_init"] == [] and res["stage2_plain"] == []


# ----- single process -----------------------------------------------------------------------
def test_init_still_checks_the_keys_it_reads():
    import zero
    from zero.config import ConfigError

    bad = [
        ({"zero_optimization": {"stage": "auto"}}, "zero_optimization.stage"),
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "bf16"),
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "disk"}}}, "device"),
    ]
    for cfg, key in bad:
        with pytest.raises(ConfigError, match=key):
            zero.Init(config_dict_or_path={**HF_CONFIG, **cfg})
    with pytest.raises(ValueError, match="dtype"):
        zero.Init(config_dict_or_path=HF_CONFIG, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="twice"):
        zero.Init(config_dict_or_path=HF_CONFIG, config={"zero_optimization": {"stage": 3}})
    with pytest.raises(NotImplementedError, match="zero_quantized_weights"):
        zero.Init(zero_quantized_weights=True)


class FakeStatus(enum.Enum):
    """Stands for DeepSpeed's own ZeroParamStatus (not zero's)."""

    AVAILABLE = 1
    NOT_AVAILABLE = 2


def test_a_model_partitioned_by_deepspeeds_init_is_refused():
    import zero

    model = Net()
    param = model.l2.weight
    # what DeepSpeed's zero.Init leaves on a parameter
    param.ds_id, param.ds_status = 7, FakeStatus.NOT_AVAILABLE
    param.ds_shape, param.ds_numel = param.shape, param.numel()
    param.ds_tensor = param.data.reshape(-1)[: param.numel() // 2].clone()
    param.data = torch.empty(0)
    with pytest.raises(ValueError) as error:
        zero.initialize(model=model, config=config(3))
    message = str(error.value)
    for part in ("rank 0", "'l2.weight'", "DeepSpeed's deepspeed.zero.Init", "zero-as-deepspeed"):
        assert part in message, message


def test_transformers_prevent_arange_dtype_change_with_zero(monkeypatch):
    """transformers reads partition_parameters.zero_wrapper_for_fp_tensor_constructor and
    _orig_torch_arange around zero.Init; with zero mapped there (as zero-as-deepspeed does) it
    works, and zero.Init leaves an explicit arange dtype alone."""
    from transformers.integrations.deepspeed import prevent_arange_dtype_change

    import zero
    from zero.partition import init as pp

    package = types.ModuleType("deepspeed.runtime.zero")
    package.partition_parameters = pp
    for name, module in (
        ("deepspeed", types.ModuleType("deepspeed")),
        ("deepspeed.runtime", types.ModuleType("deepspeed.runtime")),
        ("deepspeed.runtime.zero", package),
        ("deepspeed.runtime.zero.partition_parameters", pp),
    ):
        monkeypatch.setitem(sys.modules, name, module)

    original = pp.zero_wrapper_for_fp_tensor_constructor

    class Rope(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("inv", 1.0 / torch.arange(0, 8, 2, dtype=torch.int64).float())
            self.w = nn.Linear(4, 4)

    with prevent_arange_dtype_change(), zero.Init(config_dict_or_path=HF_CONFIG):
        rope = Rope()
    assert pp.zero_wrapper_for_fp_tensor_constructor is original
    assert rope.inv.dtype == torch.float32 and rope.w.weight.ds_numel == 16
    # DeepSpeed's meaning of the wrapper itself
    arange = pp.zero_wrapper_for_fp_tensor_constructor(
        pp._orig_torch_arange, torch.bfloat16, torch.device("cpu")
    )
    assert arange(4.0).dtype == torch.bfloat16 and arange(4).dtype == torch.int64
    assert pp.get_accelerator().device_name(0) in ("cpu", "cuda:0")
