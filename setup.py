from setuptools import setup

setup(
    name="zero",
    version="0.1.0",
    description="Config-driven ZeRO distributed training engine for PyTorch",
    python_requires=">=3.10",
    packages=["zero", "zero.launcher", "zero.ops"],
    package_dir={"zero": "engine", "zero.launcher": "launcher", "zero.ops": "ops"},
    install_requires=[
        # Pinned so a machine without a GPU takes the local CPU wheel; see README for other builds.
        "torch==2.13.0",
        "pydantic>=2.5",
        "hjson>=3.1",
        "PyYAML>=6.0",
        "psutil>=5.9",
        "ninja>=1.11",
        "py-cpuinfo>=9.0",
        "safetensors>=0.4",
        "tqdm>=4.66",
    ],
    extras_require={"test": ["pytest>=8", "pytest-timeout>=2.3", "ruff>=0.6"]},
    entry_points={"console_scripts": ["zrun=zero.launcher:main"]},
    scripts=[],
)
