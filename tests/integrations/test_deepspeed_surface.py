"""DeepSpeed 0.19.8's whole public surface under zero-as-deepspeed: every module path and name
of engine/integrations/deepspeed_catalog.json resolves (implemented or a placeholder), and
tools/deepspeed_catalog.py reads a package's source as documented.

Programs run in subprocesses under the zero-as-deepspeed command, so this process's finder and
sys.modules stay untouched."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from zero.integrations import deepspeed as doorway
from zero.integrations.placeholder import Placeholder, is_placeholder

DOORWAY = [sys.executable, "-m", "zero.integrations.doorway_cli"]
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GENERATOR = os.path.join(REPO, "tools", "deepspeed_catalog.py")


def run_under_doorway(code: str, cwd=None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "PYTHONPATH")}
    result = subprocess.run(
        [*DOORWAY, sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.splitlines()[-1])


def test_catalog_is_deepspeed_0_19_8():
    with open(doorway.CATALOG_FILE) as handle:
        data = json.load(handle)
    assert data["deepspeed_version"] == doorway.DEEPSPEED_API_VERSION
    modules = doorway.catalog()
    assert len(modules) > 700  # every module of the release, not a selection
    for path in (
        "deepspeed.moe.utils",
        "deepspeed.pipe",
        "deepspeed.runtime.zero.partition_parameters",
        "deepspeed.runtime.zero.parameter_offload",
        "deepspeed.runtime.zero.stage3",
        "deepspeed.profiling.flops_profiler",
        "deepspeed.utils.logging",
    ):
        assert path in modules, path
    assert "unwrap_model_for_generation" in modules["deepspeed.runtime.zero"].names()
    assert modules["deepspeed.runtime.zero.config"].constants["ZERO_OPTIMIZATION"] == (
        "zero_optimization"
    )


def test_every_path_imports_and_every_name_resolves():
    # One walk over the whole catalog: each path imports as one module object; each name is a
    # zero object, a constant with DeepSpeed's value, or a placeholder that fails when called.
    code = """
        import importlib, json
        from zero.integrations.deepspeed import catalog, canonical_path, MIGRATION_DOC
        from zero.integrations.placeholder import is_placeholder
        record = {"paths": 0, "names": 0, "placeholders": 0, "bad": []}
        for path, entry in catalog().items():
            module = importlib.import_module(path)
            if module is not importlib.import_module(canonical_path(path)):
                record["bad"].append(f"{path}: two module objects")
            record["paths"] += 1
            for name in sorted(entry.names()):
                try:
                    value = getattr(module, name)
                except Exception as error:
                    record["bad"].append(f"{path}.{name}: {type(error).__name__}: {error}")
                    continue
                record["names"] += 1
                if name in entry.constants and value != entry.constants[name]:
                    record["bad"].append(f"{path}.{name}: {value!r}")
                if is_placeholder(value):
                    record["placeholders"] += 1
                    try:
                        value()
                        record["bad"].append(f"{path}.{name}: a placeholder call returned")
                    except NotImplementedError as error:
                        named = "DeepSpeed's deepspeed." in str(error)
                        if not named or MIGRATION_DOC not in str(error):
                            record["bad"].append(f"{path}.{name}: {error}")
            exec(f"from {path} import *")  # __all__ lists only names that resolve
        print(json.dumps(record))
    """
    record = run_under_doorway(code)
    assert record["bad"] == []
    total = sum(len(entry.names()) for entry in doorway.catalog().values())
    assert record["paths"] == len(doorway.catalog()) and record["names"] == total
    assert 0 < record["placeholders"] < total


def test_what_programs_touch():
    code = """
        import json, logging
        record = {}
        import deepspeed
        import deepspeed.moe.utils  # cifar10_deepspeed.py: imported, never used
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
        import deepspeed.pipe
        from deepspeed.pipe import PipelineModule
        from deepspeed.utils import logger
        import deepspeed.utils.logging
        deepspeed.utils.logging.logger.setLevel(logging.WARNING)  # Lightning
        record["logger"] = deepspeed.utils.logging.logger is logger is logging.getLogger("zero")
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig, ZERO_OPTIMIZATION
        from deepspeed.runtime.zero.offload_config import DeepSpeedZeroOffloadParamConfig
        import zero
        record["zero_config"] = DeepSpeedZeroConfig(stage=3).stage == 3
        record["zero_key"] = ZERO_OPTIMIZATION
        from deepspeed.runtime.zero.partition_parameters import GatheredParameters, Init
        from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
        from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
        from deepspeed.runtime.zero import unwrap_model_for_generation
        import deepspeed.runtime.zero.stage3 as stage3
        from zero.integrations.placeholder import is_placeholder
        record["unwrap"] = not is_placeholder(unwrap_model_for_generation) and (
            unwrap_model_for_generation is stage3.unwrap_model_for_generation
        )
        from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
        from deepspeed.utils.torch import required_torch_version
        record["torch_ok"] = required_torch_version(min_version="2.0")
        from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
        from deepspeed.ops.adam.cpu_adam import DeepSpeedCPUAdam as by_module
        record["one_adam"] = by_module is DeepSpeedCPUAdam is zero.ops.adam.CPUAdam
        from deepspeed.accelerator import get_accelerator
        from deepspeed.accelerator.real_accelerator import get_accelerator as by_real
        record["one_accelerator"] = by_real is get_accelerator
        from deepspeed.profiling.flops_profiler import FlopsProfiler, get_model_profile
        record["profiler"] = not is_placeholder(FlopsProfiler)  # zero's own
        from deepspeed.moe.layer import MoE
        import deepspeed.comm as dist
        record["comm"] = dist.get_rank is zero.comm.get_rank
        record["placeholders_used_as_classes"] = [
            isinstance(object(), PipelineModule),
            issubclass(int, DeepSpeedZeroOptimizer_Stage3),
            isinstance(3, (int, MoE)),
        ]
        errors = {}
        for label, use in (
            ("call", lambda: PipelineModule(layers=[])),
            ("attribute", lambda: MoE.set_deepspeed_parallelism),
            ("subclass", lambda: exec("class X(PipelineModule): pass")),
        ):
            try:
                use()
            except Exception as error:
                errors[label] = [type(error).__name__, "deepspeed.runtime.pipe.module" in str(error)
                                 or "deepspeed.moe.layer.MoE" in str(error)]
        record["errors"] = errors
        record["hasattr"] = hasattr(MoE, "set_deepspeed_parallelism")
        missing = {}
        for statement in (
            "from deepspeed import NotADeepSpeedName",
            "import deepspeed.not_a_module",
            "deepspeed.utils.not_a_name",
        ):
            try:
                exec(statement)
            except Exception as error:
                missing[statement] = [type(error).__name__, "zero" in str(error)]
        record["missing"] = missing
        print(json.dumps(record))
    """
    record = run_under_doorway(code)
    assert record["logger"] and record["zero_config"] and record["torch_ok"] and record["unwrap"]
    assert record["profiler"]
    assert record["zero_key"] == "zero_optimization"
    assert record["one_adam"] and record["one_accelerator"] and record["comm"]
    assert record["placeholders_used_as_classes"] == [False, False, True]
    assert record["errors"] == {
        "call": ["NotImplementedError", True],
        "attribute": ["AttributeError", True],
        "subclass": ["TypeError", True],
    }
    assert record["hasattr"] is False
    # Names DeepSpeed 0.19.8 does not have: Python's own errors, as on DeepSpeed.
    assert record["missing"] == {
        "from deepspeed import NotADeepSpeedName": ["ImportError", False],
        "import deepspeed.not_a_module": ["ModuleNotFoundError", False],
        "deepspeed.utils.not_a_name": ["AttributeError", False],
    }


def test_placeholder_is_inert_until_used():
    thing = Placeholder("deepspeed.x.Y", "zero does not implement DeepSpeed's deepspeed.x.Y")
    assert is_placeholder(thing) and not isinstance(3, thing) and not issubclass(int, thing)
    assert "deepspeed.x.Y" in repr(thing) and hash(thing) == hash(thing)
    assert (thing | None).__args__ == (thing, type(None))
    with pytest.raises(NotImplementedError, match=r"deepspeed\.x\.Y"):
        thing(1, key=2)
    with pytest.raises(AttributeError, match=r"deepspeed\.x\.Y.*reading \.step"):
        thing.step  # noqa: B018
    with pytest.raises(AttributeError, match="setting .step"):
        thing.step = 1
    with pytest.raises(TypeError, match="cannot derive"):

        class _Derived(thing):  # type: ignore[misc, valid-type]
            pass


def write_package(root, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_generator_reads_names_imports_and_constants(tmp_path):
    write_package(
        tmp_path / "src",
        {
            "deepspeed/__init__.py": """
                from .runtime import zero
                from .utils import logger, log_dist as log
                from .ops import *
                import torch
                from torch import nn
                __version__ = "1.0"
                def __getattr__(name): ...
            """,
            "deepspeed/git_version_info_installed.py": "version = '0.19.8 '\n",
            "deepspeed/utils/__init__.py": "from .logging import logger, log_dist\n",
            "deepspeed/utils/logging.py": """
                KEY = "zero_optimization"
                SIZE = 5e8
                MESSAGE = "a long message" * 20
                logger = make()
                try:
                    import fast
                except ImportError:
                    fast = None
                def log_dist(): ...
                class _Private: ...
            """,
            "deepspeed/runtime/__init__.py": "",
            "deepspeed/runtime/zero/__init__.py": "from .stage3 import unwrap\n",
            "deepspeed/runtime/zero/stage3.py": """
                from typing import TYPE_CHECKING
                if TYPE_CHECKING:
                    from deepspeed.runtime.engine import DeepSpeedEngine
                def unwrap(model): ...
                if __name__ == "__main__":
                    parser = make()
            """,
            "deepspeed/ops/__init__.py": "__all__ = ['adam_op']\nadam_op = 1\nother = 2\n",
            "deepspeed/ops/csrc/kernel.py": "x = 1\n",  # no __init__.py: not a module path
        },
    )
    out = tmp_path / "catalog.json"
    result = subprocess.run(
        [sys.executable, GENERATOR, str(tmp_path / "src"), "--output", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    assert data["deepspeed_version"] == "0.19.8"
    modules = data["modules"]
    assert sorted(modules) == [
        "deepspeed",
        "deepspeed.git_version_info_installed",
        "deepspeed.ops",
        "deepspeed.runtime",
        "deepspeed.runtime.zero",
        "deepspeed.runtime.zero.stage3",
        "deepspeed.utils",
        "deepspeed.utils.logging",
    ]
    top = modules["deepspeed"]
    assert top["package"] and top["constants"] == {"__version__": "1.0"}
    assert top["imports"] == {
        "zero": "deepspeed.runtime.zero",
        "logger": "deepspeed.utils:logger",
        "log": "deepspeed.utils:log_dist",
        "adam_op": "deepspeed.ops:adam_op",  # a star import takes __all__ only
    }
    assert top["defined"] == []  # torch, nn and __getattr__ are not DeepSpeed's names
    logging = modules["deepspeed.utils.logging"]
    assert logging["constants"] == {"KEY": "zero_optimization", "SIZE": 5e8}
    assert logging["defined"] == ["MESSAGE", "fast", "log_dist", "logger"]
    assert not logging["package"]
    assert modules["deepspeed.runtime.zero"]["imports"] == {
        "unwrap": "deepspeed.runtime.zero.stage3:unwrap"
    }
    stage3 = modules["deepspeed.runtime.zero.stage3"]
    assert stage3["defined"] == ["unwrap"] and stage3["imports"] == {}


@pytest.mark.skipif(
    not os.environ.get("DEEPSPEED_SDIST"),
    reason="set DEEPSPEED_SDIST to DeepSpeed 0.19.8's sdist (pip download deepspeed==0.19.8 "
    "--no-deps) to check that the checked-in catalog is what the generator makes of it",
)
def test_checked_in_catalog_is_what_the_generator_makes(tmp_path):
    out = tmp_path / "catalog.json"
    subprocess.run(
        [sys.executable, GENERATOR, os.environ["DEEPSPEED_SDIST"], "--output", str(out)],
        check=True,
        timeout=300,
    )
    with open(doorway.CATALOG_FILE) as handle:
        assert out.read_text() == handle.read()


def test_doorway_accepts_configs_deepspeed_accepts_and_zero_keeps_its_strictness():
    # TRL's reference-model config (top-level keys whose names hold dots) and Lightning's aio
    # block: DeepSpeed 0.19.8 ignores those keys. Under the doorway they are dropped with one
    # warning each; `import zero` programs still get the ConfigError.
    code = """
        import json, os, warnings
        import torch
        CONFIG = {
            "train_micro_batch_size_per_gpu": 2,
            "zero_optimization": {"stage": 2},
            "zero_optimization.reduce_bucket_size": 1024,
            "zero_optimization.stage3_param_persistence_threshold": 320,
            "aio": {"thread_count": 1, "block_size": 1048576},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        }
        record = {}
        if os.environ.get("ZERO_AS_DEEPSPEED") == "1":  # set by zero-as-deepspeed
            import deepspeed as api
        else:
            import zero as api
        model = torch.nn.Linear(4, 2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                engine, *_ = api.initialize(model=model, config=CONFIG)
                api.initialize(model=torch.nn.Linear(4, 2), config=CONFIG)  # a second engine
                loss = engine(torch.ones(2, 4)).sum()
                engine.backward(loss)
                engine.step()
                record["trained"] = True
            except ValueError as error:
                record["error"] = str(error)
        record["warned"] = sorted(
            str(w.message).split("'")[1] for w in caught if "is not a key" in str(w.message)
        )
        print(json.dumps(record))
    """
    under = run_under_doorway(code)
    assert under == {
        "trained": True,
        "warned": [
            "aio.thread_count",
            "zero_optimization.reduce_bucket_size",
            "zero_optimization.stage3_param_persistence_threshold",
        ],
    }
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "PYTHONPATH")}
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    plain = json.loads(result.stdout.splitlines()[-1])
    assert "unknown key" in plain["error"] and plain["warned"] == []


def test_unwrap_model_for_generation_gathers_every_parameter_for_its_body():
    import torch

    import zero

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    engine, *_ = zero.initialize(model=model, config=config)
    x = torch.randn(2, 8)
    expected = engine(x).detach()
    assert all(p.numel() == 0 for p in engine.module.parameters())  # partitioned
    with doorway.unwrap_model_for_generation(engine) as unwrapped:
        assert unwrapped is engine
        for name, param in engine.module.named_parameters():
            assert torch.equal(param.detach(), full[name])
        assert torch.equal(unwrapped(x).detach(), expected)
    assert all(p.numel() == 0 for p in engine.module.parameters())
