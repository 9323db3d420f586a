"""Every public path scripts and docs use still resolves (docs/architecture.md: the package is
grouped by concept, and the names users import do not move with it)."""

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import zero

ROOT = Path(__file__).resolve().parent.parent

# zero.X, zero.<module>.X: what README.md, docs/ and DeepSpeed-style scripts name.
PUBLIC = [
    "zero.initialize",
    "zero.add_config_arguments",
    "zero.is_compile_supported",
    "zero.init_distributed",
    "zero.Engine",
    "zero.Init",
    "zero.GatheredParameters",
    "zero.RankMismatchError",
    "zero.CheckpointError",
    "zero.Config",
    "zero.ConfigError",
    "zero.load_config",
    "zero.load_pretrained",
    "zero.__version__",
    "zero.config.load_config",
    "zero.config.ZeroConfig",
    "zero.config.settings_without_effect",
    "zero.config.DeepSpeedConfig",
    "zero.config.OffloadDeviceEnum",
    "zero.config.ConfigNotImplementedError",
    "zero.config.FP16Config",
    "zero.config.OffloadParamConfig",
    "zero.accelerator.get_accelerator",
    "zero.checkpoint.consolidate",
    "zero.checkpoint.save_consolidated",
    "zero.checkpoint.ConsolidatedReader",
    "zero.checkpoint.CheckpointError",
    "zero.checkpoint.file_crc32",
    "zero.checkpoint.safetensors_io.ShardedWriter",
    "zero.optim.build_optimizer",
    "zero.optim.resolve_optimizer",
    "zero.optim.supported_optimizer_types",
    "zero.lr_schedules.build_scheduler",
    "zero.lr_schedules.WarmupLR",
    "zero.lr_schedules.WarmupDecayLR",
    "zero.lr_schedules.OneCycle",
    "zero.init.full_shape",
    "zero.init.full_numel",
    "zero.hf.checkpoint_to_pretrained",
    "zero.hf.load_pretrained",
    "zero.estimator.main",
    "zero.footprint.TransformerShape",
    "zero.zero_to_fp32.main",
    "zero.progress.bar_enabled",
    "zero.progress.progress",
    "zero.progress.redirect_logs",
    "zero.checkpointing.checkpoint",
    "zero.checkpointing.non_reentrant_checkpoint",
    "zero.checkpointing.configure",
    "zero.checkpointing.model_parallel_manual_seed",
    "zero.checkpointing.memory_stats",
    "zero.mpu.initialize_model_parallel",
    "zero.tensor_parallel.ColumnParallelLinear",
    "zero.tensor_parallel.RowParallelLinear",
    "zero.tensor_parallel.partitioned_parameters",
    "zero.zero.Init",
    "zero.zero.GatheredParameters",
    "zero.zero.register_external_parameter",
    "zero.zero.unregister_external_parameter",
    "zero.zero.ZeroParamStatus",
    "zero.zero.TiledLinear",
    "zero.utils.set_z3_leaf_modules_by_name",
    "zero.utils.set_z3_leaf_modules_by_suffix",
    "zero.lr_schedules.VALID_LR_SCHEDULES",
    "zero.utils.logger",
    "zero.utils.log_dist",
    "zero.utils.set_z3_leaf_modules",
    "zero.utils.unset_z3_leaf_modules",
    "zero.utils.get_z3_leaf_modules",
    "zero.utils.z3_leaf_module",
    "zero.utils.safe_get_full_fp32_param",
    "zero.utils.safe_get_full_grad",
    "zero.utils.safe_get_full_optimizer_state",
    "zero.utils.safe_set_full_fp32_param",
    "zero.utils.safe_set_full_optimizer_state",
    "zero.utils.safe_get_local_fp32_param",
    "zero.utils.safe_get_local_grad",
    "zero.utils.safe_get_local_optimizer_state",
    "zero.utils.safe_set_local_fp32_param",
    "zero.utils.safe_set_local_optimizer_state",
    "zero.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint",
    "zero.utils.zero_to_fp32.load_state_dict_from_zero_checkpoint",
    "zero.utils.zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict",
    "zero.ops.CPUAdam",
    "zero.ops.FusedAdam",
    "zero.ops.AsyncFileIO",
    "zero.ops.aio.available_backends",
    "zero.ops.report.main",
    "zero.launcher.main",
]

# DeepSpeed's deepspeed.comm names (`from zero import comm as dist`).
COMM = [
    "ReduceOp", "is_available", "is_initialized", "get_rank", "get_world_size", "get_local_rank",
    "get_global_rank", "barrier", "all_reduce", "broadcast", "all_gather",
    "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor", "reduce", "gather",
    "scatter", "all_to_all_single", "all_gather_object", "broadcast_object_list", "send", "recv",
    "monitored_barrier", "get_backend", "destroy_process_group", "init_distributed",
]  # fmt: skip

# Module paths that moved into a subpackage and stay importable under their old name.
MOVED = {
    "zero.checkpointing": "zero.model_parallel.activation",
    "zero.mpu": "zero.model_parallel.mpu",
    "zero.tensor_parallel": "zero.model_parallel.tensor_parallel",
    "zero.lr_schedules": "zero.optim.lr_schedules",
    "zero.init": "zero.partition.init",
    "zero.hf": "zero.checkpoint.hf",
    "zero.estimator": "zero.planning.estimator",
    "zero.footprint": "zero.planning.footprint",
    "zero.zero_to_fp32": "zero.checkpoint.zero_to_fp32",
}


def resolve(path: str):
    """The object at dotted `path`, importing modules along the way as `from a.b import c`
    would."""
    parts = path.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=1):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            obj = importlib.import_module(".".join(parts[: i + 1]))
    return obj


@pytest.mark.parametrize("path", PUBLIC)
def test_public_name_resolves(path):
    assert resolve(path) is not None


def test_deepspeed_comm_names():
    from zero import comm as dist

    missing = [name for name in COMM if not hasattr(dist, name)]
    assert not missing, missing


@pytest.mark.parametrize("old, new", sorted(MOVED.items()))
def test_moved_module_is_the_same_module(old, new):
    module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert module.__name__ == new and module.__spec__.name == new  # pickles by its real name
    assert getattr(zero, old.split(".")[1]) is module
    exec(f"from {old} import *", {})  # noqa: S102  (the `from zero.hf import x` form)


def test_every_listed_name_is_in_dunder_all():
    assert set(zero.__all__) >= {p.split(".")[1] for p in PUBLIC if p.count(".") == 1}


def test_moved_module_runs_with_dash_m():
    result = subprocess.run(
        [sys.executable, "-m", "zero.estimator", "--paper"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert "Table 1" in result.stdout


def test_zero_imports_without_torch():
    """`zrun` starts from `import zero.launcher`; the package must not pull in torch first."""
    code = "import sys, zero, zero.launcher; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "False", result.stderr


PACKAGES = {"engine": "zero", "launcher": "zero.launcher", "ops": "zero.ops"}


def _zero_imports(folder: Path):
    """(file, line, module) for every import of a zero module in folder's Python files."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        package = ".".join([PACKAGES[folder.name], *path.relative_to(folder).parent.parts])
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolve against the module's own package
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                names = [base]
            else:
                continue
            found += [(path, node.lineno, n) for n in names if n == "zero" or n.startswith("zero.")]
    return found


# zrun --autotuning (launcher/autotuning/) asks the planner, which reads configs; zrun imports
# it only when tuning, so zrun itself still starts without torch (test above).
TUNER = (ROOT / "launcher" / "autotuning", ("zero.config", "zero.planning"))


@pytest.mark.parametrize("folder, own", [("launcher", "zero.launcher"), ("ops", "zero.ops")])
def test_launcher_and_ops_import_nothing_of_the_engine(folder, own):
    """zrun starts without torch and the ops build without the engine: launcher/ and ops/ import
    only themselves, but for the tuner's planner and config (lint-imports sees engine/ only;
    docs/architecture.md, Layers)."""
    outside = [
        f"{p}:{line} {m}"
        for p, line, m in _zero_imports(ROOT / folder)
        if not m.startswith(own) and not (p.is_relative_to(TUNER[0]) and m.startswith(TUNER[1]))
    ]
    assert not outside, outside


def test_engine_reaches_launcher_and_ops_only_where_the_layers_allow():
    """Of the launcher, the engine reads only the SLURM node-list parser (comm/launch.py); the
    ops are used from the offload layer up."""
    above_ops = ("zero.offload", "zero.partition", "zero.planning", "zero.checkpoint")
    top = (
        "zero.engine",
        "zero.api",
        "zero.utils",
        "zero.zero",
        "zero.monitor",
        "zero.integrations",
    )
    wrong = []
    for path, line, module in _zero_imports(ROOT / "engine"):
        importer = "zero." + ".".join(path.relative_to(ROOT / "engine").with_suffix("").parts)
        if importer.startswith("zero.integrations"):
            continue  # the top layer may import anything
        if module.startswith("zero.launcher") and module != "zero.launcher.nodelist":
            wrong.append(f"{path}:{line} {module}")
        if module.startswith("zero.ops") and not importer.startswith(above_ops + top):
            wrong.append(f"{path}:{line} {module}")
    assert not wrong, wrong
