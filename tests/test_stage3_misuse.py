"""Stage 3 refuses what it cannot do instead of losing data: an in-place write to a parameter
during forward, and load_state_dict() of full values into partitioned parameters (single
process: the same gather and release code paths as N ranks)."""

import pytest
import torch
import torch.nn.functional as F

import zero

CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(10, 8, max_norm=1.0), torch.nn.Flatten(), torch.nn.Linear(32, 3)
    )


def test_in_place_write_during_forward_is_refused():
    # nn.Embedding(max_norm) renormalizes the rows it looks up in place during forward.
    engine, _, _, _ = zero.initialize(model=_model(), config=CONFIG)
    x = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]])
    with pytest.raises(
        RuntimeError, match=r"parameter '0.weight' of unit '<root>' was modified in place"
    ):
        engine(x)
    # Without max_norm the same model trains.
    model = _model()
    model[0].max_norm = None
    engine, _, _, _ = zero.initialize(model=model, config=CONFIG)
    engine.backward(F.cross_entropy(engine(x), torch.tensor([0, 1])))
    engine.step()


def test_load_state_dict_into_partitioned_parameters():
    full = {k: v.clone() + 1 for k, v in _model().state_dict().items()}
    engine, _, _, _ = zero.initialize(model=_model(), config=CONFIG)
    with pytest.raises(RuntimeError, match=r"load_state_dict: '0.weight' is partitioned"):
        engine.module.load_state_dict(full)
    with zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=0):
        engine.module.load_state_dict(full)
    with zero.GatheredParameters(list(engine.module.parameters())):
        for name, param in engine.module.named_parameters():
            assert torch.equal(param, full[name]), name

    with zero.Init(config=CONFIG):  # before initialize too
        model = _model()
    with pytest.raises(RuntimeError, match=r"load_state_dict: '0.weight' is partitioned"):
        model.load_state_dict(full)
