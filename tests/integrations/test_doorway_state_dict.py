"""Stage-3 module.state_dict() under the doorway, on 2 ranks in one spawned group:

- a program that imports zero keeps zero's strictness: state_dict() of a partitioned model
  raises, naming stage3_gather_16bit_weights_on_model_save;
- once `import deepspeed` gave zero (the doorway), an engine built after it returns DeepSpeed's
  0-element placeholders from state_dict() (stage3_gather_16bit_weights_on_model_save set or
  not), to rank 0 calling it alone (no collective, no wait), with one warning that says so;
- zero's own save still gathers there: save_16bit_model writes every parameter whole;
- save_16bit_model inside zero.GatheredParameters over one parameter, where state_dict()
  would hand it the others' placeholders, refuses instead of writing an empty file.
"""

import logging
import os
import sys

import pytest
import torch
from distributed import run_ranks

CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    "agreement_timeout": 20,
    "zero_optimization": {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "stage3_module_granularity_threshold": 10,  # a unit per layer
    },
}


GATHER = "stage3_gather_16bit_weights_on_model_save"


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def state_dict_group(directory):
    import zero

    rank = int(os.environ["RANK"])
    out = {}
    strict, _, _, _ = zero.initialize(model=_model(), config=CONFIG)
    try:
        strict.module.state_dict()
        out["strict"] = None
    except RuntimeError as error:
        out["strict"] = str(error)

    doorway = os.path.join(os.path.dirname(zero.__file__), "integrations", "doorway")
    sys.path.insert(0, doorway)
    import deepspeed

    records = _Records()
    logging.getLogger("zero").addHandler(records)
    # With the gather flag set too: DeepSpeed's module.state_dict() never gathers.
    zero_optimization = {**CONFIG["zero_optimization"], GATHER: True}
    config = {**CONFIG, "zero_optimization": zero_optimization}
    engine, _, _, _ = deepspeed.initialize(model=_model(), config=config)
    if rank == 0:  # alone, as DeepSpeed-Chat's save_hf_format
        state = engine.module.state_dict()
        state = engine.module.state_dict()  # the warning is said once
        out["placeholders"] = {k: tuple(v.shape) for k, v in state.items()}
    out["warnings"] = [m for m in records.messages if "placeholders" in m]
    path = engine.save_16bit_model(directory, f"rank{rank}.safetensors")
    out["saved"] = path
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        out["full"] = {k: v.clone() for k, v in engine.module.state_dict().items()}
    with deepspeed.zero.GatheredParameters(engine.module[0].weight):
        try:
            engine.save_16bit_model(directory, "partial.safetensors")
            out["partial"] = None
        except RuntimeError as error:
            out["partial"] = str(error)
    return out


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("save"))
    return run_ranks(state_dict_group, 2, directory, timeout=180)


def test_import_zero_keeps_state_dict_strict(per_rank):
    for out in per_rank:
        assert "stage3_gather_16bit_weights_on_model_save" in out["strict"], out["strict"]


def test_doorway_state_dict_gives_placeholders_once_said(per_rank):
    shapes = per_rank[0]["placeholders"]
    assert set(shapes) == {"0.weight", "0.bias", "2.weight", "2.bias"}, shapes
    assert all(shape == (0,) for shape in shapes.values()), shapes
    assert len(per_rank[0]["warnings"]) == 1, per_rank[0]["warnings"]
    assert "save_16bit_model" in per_rank[0]["warnings"][0]
    assert per_rank[1]["warnings"] == []  # rank 1 never called it


def test_zero_saves_gather_and_refuse_placeholders(per_rank):
    from safetensors.torch import load_file

    saved = load_file(per_rank[0]["saved"])
    assert per_rank[1]["saved"] is None
    full = per_rank[0]["full"]
    assert saved.keys() == full.keys()
    for key, value in full.items():
        assert value.numel() > 0 and torch.equal(saved[key], value), key
    for out in per_rank:
        assert "0-element placeholder" in out["partial"], out["partial"]
