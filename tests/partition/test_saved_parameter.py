"""A custom autograd Function that saves a parameter for backward at ZeRO stage 3 (TRL's fused
LM-head loss: called in the model's forward on `lm_head.weight`, not through lm_head), on 2 ranks
in one spawned group:

- backward gets the Parameter itself from ctx.saved_tensors, with DeepSpeed's ds_* attributes
  (TRL reads `weight.ds_status` there and gathers it with GatheredParameters when it is not
  AVAILABLE); before, zero's saved-tensor hooks handed back a plain tensor;
- the loss and every gradient equal a single process's on the same global batch, whether the
  model is one fetch unit (the head gathered with it) or several (the program gathers the head
  with GatheredParameters in forward, and again in backward, as TRL does).
"""

import os

import torch
from distributed import run_ranks

DIM, VOCAB = 8, 12


class _FusedHead(torch.autograd.Function):
    """log-softmax cross entropy of hidden @ weight.T, computed chunk-free for brevity; backward
    reads the saved weight's ds_status and gathers it as TRL's does."""

    seen: list = []

    @staticmethod
    def forward(ctx, hidden, weight, targets):
        logits = hidden @ weight.t()
        ctx.save_for_backward(hidden, weight, targets)
        return torch.nn.functional.cross_entropy(logits, targets, reduction="sum")

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, targets = ctx.saved_tensors
        status = getattr(weight, "ds_status", None)
        _FusedHead.seen.append((type(weight).__name__, None if status is None else status.name))
        gather = _gathered(weight) if status is not None and status.name != "AVAILABLE" else None
        with gather or torch.enable_grad():
            logits = hidden @ weight.t()
            probs = torch.softmax(logits, dim=-1)
            probs[torch.arange(len(targets)), targets] -= 1
            probs *= grad
            return probs @ weight, probs.t() @ hidden, None


def _gathered(weight):
    import zero

    return zero.GatheredParameters([weight])


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.body = torch.nn.Linear(DIM, DIM)
        self.lm_head = torch.nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids, targets):
        hidden = torch.tanh(self.body(self.embed(ids)))
        weight = self.lm_head.weight
        status = getattr(weight, "ds_status", None)
        if status is not None and status.name != "AVAILABLE":  # TRL's maybe_gather_lm_head_ctx
            with _gathered(weight):
                return _FusedHead.apply(hidden, weight, targets)
        return _FusedHead.apply(hidden, weight, targets)


def _config(units: int) -> dict:
    zero_optimization = {"stage": 3, "stage3_param_persistence_threshold": 0}
    if units > 1:
        zero_optimization["stage3_module_granularity_threshold"] = 50  # a unit per layer
    return {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": zero_optimization,
    }


def _batch(rank: int):
    g = torch.Generator().manual_seed(rank)
    return torch.randint(0, VOCAB, (4,), generator=g), torch.randint(0, VOCAB, (4,), generator=g)


def saved_parameter_group():
    import zero

    rank = int(os.environ["RANK"])
    out = {}
    for units in (1, 3):
        reference = Net()
        loss = sum(reference(*_batch(r)) for r in range(2)) / 2
        loss.backward()
        want = {n: p.grad.clone() for n, p in reference.named_parameters()}
        engine, _, _, _ = zero.initialize(model=Net(), config=_config(units))
        _FusedHead.seen.clear()
        got_loss = engine(*_batch(rank))
        engine.backward(got_loss)
        grads = {}
        for name, param in engine.module.named_parameters():
            grads[name] = zero.utils.safe_get_full_grad(param).clone()
        out[units] = {
            "seen": list(_FusedHead.seen),
            "loss": got_loss.item(),
            "want_loss": reference(*_batch(rank)).item(),
            "grads": grads,
            "want": want,
        }
    return out


def test_custom_function_gets_the_parameter_and_trains_as_one_process():
    per_rank = run_ranks(saved_parameter_group, 2, timeout=180)
    for rank, out in enumerate(per_rank):
        for case, res in out.items():
            assert res["seen"] and all(kind == "Parameter" for kind, _ in res["seen"]), (case, res)
            assert all(status is not None for _, status in res["seen"]), (case, res["seen"])
            assert abs(res["loss"] - res["want_loss"]) < 1e-5, (rank, case)
            for name, want in res["want"].items():
                # engine.backward scales by 1/world size: the mean over ranks, as the reference
                torch.testing.assert_close(res["grads"][name], want, rtol=1e-5, atol=1e-6)
