"""API misuse on 2 ranks, at every stage and dtype: state changed behind the engine's back.

Each row of CASES is a misuse, a function that commits it on every rank and returns what it got
(the error, "ok", or a result), and the outcome expected (a pattern, or a function of stage
and dtype). One spawned group of 2 ranks runs every case at stages 0-3 in fp32, bf16 and fp16
(two shared engines per stage and dtype, plus fresh ones where a case needs them); a new misuse
is a new row. Each case undoes its misuse after the error, and the shared engines must train on
once all have run: an error leaves the engine usable. Every rank must get the outcome, naming
its own rank.
"""

import functools
import os
import re

import pytest
import torch
import torch.nn.functional as F
from distributed import run_ranks

STAGES = (0, 1, 2, 3)
DTYPES = {
    "fp32": {},
    "bf16": {"bf16": {"enabled": True}},
    "fp16": {"fp16": {"enabled": True, "initial_scale_power": 4}},
}
COMPUTE = {"fp32": "torch.float32", "bf16": "torch.bfloat16", "fp16": "torch.float16"}


class Raise(torch.autograd.Function):
    """Identity whose backward raises while `armed`: an error part-way through backward (the
    gradients of `c` have arrived, those of `a` and `b` not)."""

    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if Raise.armed:
            raise ValueError("backward failed in a custom Function")
        return grad


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 8)
        self.b = torch.nn.Linear(8, 8)
        self.c = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.c(Raise.apply(torch.relu(self.b(torch.relu(self.a(x))))))


def config(stage, dtype):
    return {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 10**6,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.05, "weight_decay": 0.1}},
        # stage 3: every bias persistent (< 10 elements), every weight a unit of its own; a
        # bucket per parameter, so stage 2 reduces while backward runs
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 16,
            "stage3_param_persistence_threshold": 10,
        },
        **DTYPES[dtype],
    }


class Setting:
    """One stage and dtype on this rank: the shared engines (built on first use) and fresh
    ones."""

    def __init__(self, rank, stage, dtype):
        self.rank, self.stage, self.dtype = rank, stage, dtype

    def fresh(self, freeze=()):
        import zero

        torch.manual_seed(0)
        model = Net()
        for name in freeze:
            model.get_parameter(name).requires_grad_(False)
        return zero.initialize(model=model, config=config(self.stage, self.dtype))[0]

    @functools.cached_property
    def engine(self):
        """Shared: every parameter trains."""
        return self.fresh()

    @functools.cached_property
    def frozen(self):
        """Shared: b.weight frozen before zero.initialize."""
        return self.fresh(freeze=("b.weight",))

    def shared(self) -> list:
        """The shared engines built so far."""
        return [self.__dict__[name] for name in ("engine", "frozen") if name in self.__dict__]

    def loss(self, engine, step=0, module=False):
        generator = torch.Generator().manual_seed(100 * step + self.rank)
        x = torch.randn(2, 4, generator=generator).to(engine.config.compute_dtype)
        y = torch.randint(0, 2, (2,), generator=generator)
        return F.cross_entropy((engine.module(x) if module else engine(x)).float(), y)

    def train(self, engine, steps=1):
        for step in range(steps):
            engine.backward(self.loss(engine, step))
            engine.step()


def full(engine):
    import zero

    with zero.GatheredParameters(list(engine.module.parameters())):
        return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}


def outcome(fn, *args) -> str:
    """What fn returned ("ok" for None), or "Type: message" of what it raised."""
    try:
        result = fn(*args)
    except Exception as error:  # noqa: BLE001 - the outcome is what the test compares
        return f"{type(error).__name__}: {error}"
    return "ok" if result is None else str(result)


def failed_then_recovered(s: Setting, engine, misuse) -> str:
    """The outcome of `misuse` (a backward that raises), then of the next training call, then
    engine.zero_grad() (which must recover)."""
    got = [outcome(misuse), outcome(s.train, engine)]
    engine.zero_grad()
    return " | ".join(got)


# ----- the cases: each runs on every rank, returns its outcome, undoes its misuse ------------
def frozen_after_initialize(s: Setting) -> str:
    weight = s.engine.module.b.weight
    s.train(s.engine)  # Adam has momentum now: it would keep moving a frozen weight
    weight.requires_grad_(False)
    try:
        return outcome(s.train, s.engine)
    finally:
        weight.requires_grad_(True)


def unfrozen_after_initialize(s: Setting) -> str:
    weight = s.frozen.module.b.weight
    weight.requires_grad_(True)
    try:
        return outcome(s.train, s.frozen)
    finally:
        weight.requires_grad_(False)


def frozen_before_initialize(s: Setting) -> str:
    """The way to freeze: the frozen weight stays as it is, everything else trains."""
    before = full(s.frozen)
    s.train(s.frozen)
    after = full(s.frozen)
    return f"moved {sorted(n for n in before if not torch.equal(before[n], after[n]))}"


def replaced(s: Setting, change, module=False) -> str:
    """`change(engine)` rebinds parameters; the next training call (through engine.module when
    `module`) gets the outcome; after an error the parameters' tensors are put back."""
    params = list(s.engine.module.parameters())
    held = [p.data for p in params]
    change(s.engine)
    if module:  # as generate() runs the model: stage 3 refuses at the all-gather, stages 0-2
        # in engine.backward
        got = outcome(lambda: s.engine.backward(s.loss(s.engine, module=True)))
    else:
        got = outcome(s.train, s.engine)
    if got != "ok":
        for param, data in zip(params, held):
            param.data = data
    return got


def assign_data(engine):
    weight = engine.module.b.weight
    weight.data = torch.zeros(getattr(weight, "ds_shape", weight.shape), dtype=weight.dtype)


def stale_two_forwards(s: Setting) -> str:
    def misuse():
        first, second = s.loss(s.engine), s.loss(s.engine, 1)
        s.engine.backward(first)
        s.engine.step()
        s.engine.backward(second)

    return failed_then_recovered(s, s.engine, misuse)


def stale_retain_graph(s: Setting) -> str:
    def misuse():
        loss = s.loss(s.engine)
        s.engine.backward(loss, retain_graph=True)
        s.engine.step()
        s.engine.backward(loss)

    return failed_then_recovered(s, s.engine, misuse)


def stale_module_forward(s: Setting) -> str:
    def misuse():
        early = s.loss(s.engine, module=True)
        s.train(s.engine)
        s.engine.backward(early)

    return failed_then_recovered(s, s.engine, misuse)


def graph_across_a_step_without_update(s: Setting) -> str:
    """torch accepts a graph across a step() that changes no parameter (inside a gradient
    accumulation); so does zero."""
    steps = s.engine.global_steps
    s.engine.set_gradient_accumulation_boundary(False)
    early = s.loss(s.engine)
    s.train(s.engine)  # no update
    s.engine.set_gradient_accumulation_boundary(None)
    s.engine.backward(early)
    s.engine.step()
    return f"steps {s.engine.global_steps - steps}"


def failed_backward(s: Setting) -> str:
    """The backward raises part-way (stage 2 has reduced some buckets); the next training call
    names that failure; zero_grad() drops the step's gradients and the next step equals a clean
    engine's first step."""
    engine, clean = s.fresh(), s.fresh()
    Raise.armed = True
    try:
        got = [outcome(engine.backward, s.loss(engine, 5))]
    finally:
        Raise.armed = False
    got += [outcome(s.loss, engine), outcome(engine.step)]
    engine.zero_grad()
    s.train(engine)
    s.train(clean)
    same = all(torch.equal(a, b) for a, b in zip(full(engine).values(), full(clean).values()))
    return " | ".join([*got, f"same as a clean step: {same}"])


def second_initialize(s: Setting) -> str:
    import zero

    engine = s.fresh()
    got = outcome(lambda: zero.initialize(model=engine.module, config=config(s.stage, s.dtype)))
    engine.close()
    if s.stage < 3:  # closed, the model is free again (stage 3 leaves it partitioned)
        again = zero.initialize(model=engine.module, config=config(s.stage, s.dtype))[0]
        got += " | " + outcome(s.train, again)
    return got


def cast(bits):
    """The outcome of engine.module.half() / .double(): refused, but half() of an fp16 model
    changes nothing, so it trains on."""

    def expected(stage, dtype):
        if (dtype, bits) == ("fp16", 16):
            return "ok"
        return (
            rf"RuntimeError: rank {{rank}}: parameter '\w\.\w+' is torch.float{bits}, but "
            rf"zero.initialize laid it out in {COMPUTE[dtype]}: .*cast the model before "
            "zero.initialize.*"
        )

    return expected


def by_stage(at_3, below_3):
    return lambda stage, dtype: at_3 if stage == 3 else below_3


STALE = r"RuntimeError: rank {rank}: one of the variables needed for gradient computation has been modified by an inplace operation: .*compute the loss again after the step"  # noqa: E501
AFTER_FAILURE = r"RuntimeError: rank {rank}: engine\(...\) \(a training forward\) after an engine.backward\(\) that raised \({failure}.*\): .*Call engine.zero_grad\(\) on every rank.*"  # noqa: E501
REPLACED = r"RuntimeError: rank {rank}: parameter 'b.weight' no longer holds the tensor zero gave it: .*GatheredParameters\(params, modifier_rank=0\).*"  # noqa: E501
TRAINED = r"ValueError: rank {rank}: parameter 'a.weight' of Net is trained by a zero engine that was not closed: .*call its close\(\).*"  # noqa: E501

AFTER = "the shared engines train afterwards"

# (name, case, expected outcome): a pattern, or a function (stage, dtype) -> pattern; {rank}
# is filled in
CASES = [
    (
        "requires_grad_(False) after initialize",
        frozen_after_initialize,
        r"RuntimeError: rank {rank}: parameter 'b.weight' has requires_grad=False, but it was "
        r"trainable when zero.initialize laid it out.*Freeze parameters before zero.initialize.*",
    ),
    (
        "requires_grad_(True) after initialize",
        unfrozen_after_initialize,
        r"RuntimeError: rank {rank}: parameter 'b.weight' has requires_grad=True, but it was "
        r"frozen when zero.initialize laid it out.*",
    ),
    (
        "requires_grad_(False) before initialize",
        frozen_before_initialize,
        r"moved \['a.bias', 'a.weight', 'b.bias', 'c.bias', 'c.weight'\]",
    ),
    (
        "engine.module.double()",
        functools.partial(replaced, change=lambda e: e.module.double()),
        cast(64),
    ),
    (
        "engine.module.half()",
        functools.partial(replaced, change=lambda e: e.module.half()),
        cast(16),
    ),
    ("param.data = tensor", functools.partial(replaced, change=assign_data), REPLACED),
    (
        "param.data = tensor, then engine.module(...)",
        functools.partial(replaced, change=assign_data, module=True),
        REPLACED,
    ),
    (
        "stale graph: two forwards, a step between their backwards",
        stale_two_forwards,
        STALE + r" \| " + AFTER_FAILURE.replace("{failure}", "RuntimeError: rank {rank}: one of"),
    ),
    (
        "stale graph: retain_graph=True reused after a step",
        stale_retain_graph,
        STALE + r" \| " + AFTER_FAILURE.replace("{failure}", "RuntimeError: rank {rank}: one of"),
    ),
    (
        "stale graph: engine.module(...) before a step",
        stale_module_forward,
        STALE + r" \| " + AFTER_FAILURE.replace("{failure}", "RuntimeError: rank {rank}: one of"),
    ),
    ("a graph across a step without update", graph_across_a_step_without_update, "steps 1"),
    (
        "an exception inside backward",
        failed_backward,
        r"ValueError: backward failed in a custom Function \| "
        + AFTER_FAILURE.replace("{failure}", "ValueError: backward failed in a custom Function")
        + r".* \| RuntimeError: rank {rank}: engine.step\(\) after an engine.backward\(\) that "
        r"raised .* \| same as a clean step: True",
    ),
    (
        "a second zero.initialize on the same model",
        second_initialize,
        by_stage(TRAINED, TRAINED + r" \| ok"),
    ),
]


def sweep() -> dict:
    """(case, stage, dtype) -> outcome; (AFTER, stage, dtype) -> the outcomes of a training step
    of each shared engine once every case has run."""
    rank = int(os.environ["RANK"])
    got = {}
    for stage in STAGES:
        for dtype in DTYPES:
            setting = Setting(rank, stage, dtype)
            for name, case, _ in CASES:
                got[name, stage, dtype] = outcome(case, setting)
            got[AFTER, stage, dtype] = [outcome(setting.train, e) for e in setting.shared()]
    return got


@pytest.fixture(scope="module")
def per_rank():
    return run_ranks(sweep, 2)


def expected(pattern, stage, dtype, rank) -> str:
    pattern = pattern(stage, dtype) if callable(pattern) else pattern
    return pattern.replace("{rank}", str(rank))


@pytest.mark.parametrize("name,pattern", [c[::2] for c in CASES], ids=[c[0] for c in CASES])
def test_misuse_gets_torchs_result_or_an_error_on_every_rank(per_rank, name, pattern):
    for rank, got in enumerate(per_rank):
        for stage in STAGES:
            for dtype in DTYPES:
                text = got[name, stage, dtype]
                want = expected(pattern, stage, dtype, rank)
                assert re.fullmatch(want, text, re.S), (name, stage, dtype, rank, text)


def test_engines_train_on_after_the_errors(per_rank):
    """Each error left the engine as it was (the misuse undone, zero_grad() after a failed
    backward): the shared engines still train."""
    for rank, got in enumerate(per_rank):
        for stage in STAGES:
            for dtype in DTYPES:
                assert got[AFTER, stage, dtype] == ["ok", "ok"], (stage, dtype, rank)
