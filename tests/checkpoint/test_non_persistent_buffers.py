"""Non-persistent buffers (a rotary embedding's inv_freq) are in no checkpoint, as in torch's
state_dict(): zero-to-fp32's output loads with strict=True, and the checkpoint loads back into
the model, which keeps its own values for them."""

import torch

from zero.checkpoint import consolidate


class Rotary(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.register_buffer("inv_freq", torch.arange(2.0), persistent=False)
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x):
        return self.proj(x) * self.scale + self.inv_freq.sum()


def test_non_persistent_buffers_stay_out_of_checkpoints(tmp_path):
    import zero

    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 2},
    }
    torch.manual_seed(0)
    engine, *_ = zero.initialize(model=Rotary(), config=config)
    engine.backward(engine(torch.ones(2, 4)).square().mean())
    engine.step()
    engine.save_checkpoint(tmp_path, tag="t")
    state = consolidate(str(tmp_path / "t"))
    plain = Rotary()
    plain.load_state_dict(state, strict=True)  # no inv_freq in it
    assert torch.equal(plain.proj.weight, engine.module.proj.weight)
    engine.load_checkpoint(tmp_path, tag="t")  # strict: the buffer is not looked for
    engine.close()
