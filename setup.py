import os
import sys
from importlib.util import module_from_spec, spec_from_file_location

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py
from setuptools.command.develop import develop


def _prebuild_ops():
    """ZERO_BUILD_OPS=1: compile every compatible op into the cache now (see docs/ops.md).

    Loads ops/builder.py by path (zero is not importable yet). Needs torch in the build
    environment: install with `pip install --no-build-isolation`.
    """
    if os.environ.get("ZERO_BUILD_OPS") != "1":
        return
    try:
        import torch  # noqa: F401
    except ImportError:
        sys.exit("ZERO_BUILD_OPS=1 needs torch at build time: pip install --no-build-isolation")
    here = os.path.dirname(os.path.abspath(__file__))
    spec = spec_from_file_location("_zero_op_builder", os.path.join(here, "ops", "builder.py"))
    builder = module_from_spec(spec)
    sys.modules[spec.name] = builder
    spec.loader.exec_module(builder)
    for name, result in builder.build_all(verbose=True).items():
        print(f"zero: op {name}: {result}")


class BuildPyWithOps(build_py):
    def run(self):
        super().run()
        _prebuild_ops()


class DevelopWithOps(develop):
    def run(self):
        super().run()
        _prebuild_ops()


setup(
    name="zero",
    version="0.1.0",
    description="Config-driven ZeRO distributed training engine for PyTorch",
    python_requires=">=3.10",
    # engine/'s subpackages (zero.config, zero.comm, zero.partition, ...; docs/architecture.md)
    packages=[
        "zero",
        *(f"zero.{name}" for name in find_packages("engine")),
        "zero.launcher",
        "zero.launcher.autotuning",
        "zero.ops",
    ],
    package_dir={
        "zero": "engine",
        "zero.launcher": "launcher",
        "zero.launcher.autotuning": "launcher/autotuning",
        "zero.ops": "ops",
    },
    package_data={
        # The op sources compile on first use (JIT), so they ship with the package.
        "zero.ops": ["csrc/*.cpp", "csrc/*.cu", "csrc/*.h"],
        # zero-as-deepspeed's doorway (a directory, not a package): the thin `deepspeed`
        # package, its dist-info and bin/deepspeed (docs/migrating-from-deepspeed.md).
        "zero.integrations": [
            "deepspeed_catalog.json",
            "doorway/deepspeed/*.py",
            "doorway/deepspeed-*.dist-info/*",
            "doorway/bin/*",
        ],
    },
    install_requires=[
        # A range, never a pin: a user's own torch build (CUDA, ROCm, CPU) must stay. 2.6 is the
        # oldest torch with every API zero calls (group_src collectives); tested on 2.13.
        "torch>=2.6",
        "pydantic>=2.5",
        "hjson>=3.1",
        "PyYAML>=6.0",
        "psutil>=5.9",
        "ninja>=1.11",
        "py-cpuinfo>=9.0",
        "safetensors>=0.8",  # safe_open(backend="pread"): reader.py, partition/init.py
        "numpy",  # safetensors.torch.save_file converts through numpy
        "tqdm>=4.66",
    ],
    extras_require={
        # transformers, peft, accelerate: tests train tiny Hugging Face models built from a
        # config (no download), with LoRA adapters (docs/hf-models.md)
        "test": [
            "pytest>=8",
            "pytest-timeout>=2.3",
            "ruff==0.17.6",
            # lint-imports: the layers of engine/ (.importlinter, docs/architecture.md)
            "import-linter==2.17",
            "transformers>=4.46",
            "peft>=0.13",
            "accelerate>=1.0",
            # DeepSpeed programs run unchanged through the doorway (tests/integrations/)
            "trl>=1.0",
            "lightning>=2.4",
        ],
        # `pip install zero[hf]`: fine-tune Hugging Face models (docs/hf-models.md); tested with
        # transformers 5.24, peft 0.21, accelerate 1.15
        "hf": ["transformers>=4.46", "peft>=0.13", "accelerate>=1.0", "safetensors>=0.8"],
    },
    entry_points={
        "console_scripts": [
            "zrun=zero.launcher:main",
            "zero-report=zero.ops.report:main",
            "zero-to-fp32=zero.checkpoint.zero_to_fp32:main",
            "zero-estimate=zero.planning.estimator:main",
            "zero-as-deepspeed=zero.integrations.doorway_cli:main",
        ]
    },
    cmdclass={"build_py": BuildPyWithOps, "develop": DevelopWithOps},
)
