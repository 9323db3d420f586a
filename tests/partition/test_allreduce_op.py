"""gradient_allreduce_op (DeepSpeed's key): "sum" steps on the sum of the ranks' gradients,
"mean" on their average, at every stage; 2 gloo ranks."""

import torch
from distributed import run_ranks
from parity_model import Net, batches, config, param_groups


def grad_norms_and_grads(stages):
    import torch.distributed as dist

    import zero

    rank = dist.get_rank() if dist.is_initialized() else 0
    data = batches(2, gas=1, steps=1, same_modules=True)[0][0]
    out = {}
    for stage in stages:
        for op in ("mean", "sum"):
            cfg = config(stage, gas=1, clip=0.0, world_size=2)
            cfg["gradient_allreduce_op"] = op
            torch.manual_seed(0)
            model = Net()
            opt = torch.optim.SGD(param_groups(model), lr=1.0)
            engine, *_ = zero.initialize(model=model, optimizer=opt, config=cfg)
            x, y, extra = data[rank]
            engine.backward(engine(x, y, extra))
            grad = zero.utils.safe_get_full_grad(engine.module.proj.weight)
            engine.step()
            out[(stage, op)] = (engine.get_global_grad_norm(), grad)
    return out


def test_sum_is_world_size_times_mean_at_every_stage():
    stages = (0, 1, 2, 3)
    results = run_ranks(grad_norms_and_grads, 2, stages)
    for per_rank in results:
        for stage in stages:
            mean_norm, mean_grad = per_rank[(stage, "mean")]
            sum_norm, sum_grad = per_rank[(stage, "sum")]
            assert abs(sum_norm - 2 * mean_norm) <= 1e-6 * sum_norm, (stage, sum_norm, mean_norm)
            torch.testing.assert_close(sum_grad, 2 * mean_grad, rtol=1e-6, atol=0)
