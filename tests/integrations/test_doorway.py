"""zero-as-deepspeed: the `deepspeed` doorway (engine/integrations/).

Programs run in subprocesses under `python -m zero.integrations.doorway_cli` (the
zero-as-deepspeed command), so the finder and sys.modules of this process stay untouched."""

import collections
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from packaging.version import Version

import zero
from zero.integrations import deepspeed as doorway
from zero.integrations import deepspeed_launcher
from zero.launcher import remote as remote_module
from zero.launcher.remote import RemoteOptions, remote_launches
from zero.launcher.runner import JobSpec
from zero.launcher.world import build_layout, find_free_port

DOORWAY = [sys.executable, "-m", "zero.integrations.doorway_cli"]


def clean_env(**extra) -> dict:
    """This environment without launcher variables or a doorway already on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "PYTHONPATH")}
    env.update(extra)
    return env


def run(command, code, env=None, cwd=None, timeout=120) -> subprocess.CompletedProcess:
    argv = [*command, sys.executable, "-c", textwrap.dedent(code)]
    result = subprocess.run(
        argv, env=env or clean_env(), cwd=cwd, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, result.stderr
    return result


def test_version_is_deepspeeds_api_with_zeros_as_local_label():
    version = f"0.19.8+zero.{zero.__version__}"
    assert doorway.doorway_version() == version
    infos = [d for d in os.listdir(doorway.DOORWAY_DIR) if d.endswith(".dist-info")]
    assert infos == [f"deepspeed-{version}.dist-info"], "rename the doorway's dist-info"
    with open(os.path.join(doorway.DOORWAY_DIR, infos[0], "METADATA")) as handle:
        fields = dict(line.split(": ", 1) for line in handle.read().splitlines() if ": " in line)
    assert fields["Name"] == "deepspeed" and fields["Version"] == version
    assert "zero" in fields["Summary"] and "not DeepSpeed" in fields["Summary"]
    assert Version(version) >= Version("0.9.3")  # transformers' and accelerate's minimum


def test_import_deepspeed_only_under_the_doorway():
    probe = """
        import importlib.metadata, importlib.util, json, sys
        try:
            version = importlib.metadata.version("deepspeed")
        except importlib.metadata.PackageNotFoundError:
            version = None
        record = {"spec": importlib.util.find_spec("deepspeed") is not None, "version": version}
        if record["spec"]:
            import deepspeed
            record["torch"] = "torch" in sys.modules  # import deepspeed is cheap
            record["__version__"] = deepspeed.__version__
            record["file"] = deepspeed.__file__
            record["env"] = sys.modules["os"].environ.get("ZERO_AS_DEEPSPEED")
            import deepspeed.runtime.engine as by_import
            from deepspeed.runtime import engine as by_from
            from deepspeed import DeepSpeedEngine
            import zero
            record["one_module"] = by_import is by_from is deepspeed.runtime.engine
            record["engine"] = DeepSpeedEngine is zero.Engine is by_import.DeepSpeedEngine
            record["zero_alias"] = deepspeed.zero is sys.modules["deepspeed.runtime.zero"]
            import deepspeed.zero.partition_parameters as by_alias
            import deepspeed.runtime.zero.partition_parameters as by_path
            record["zero_alias"] &= by_alias is by_path
            record["sub_spec"] = importlib.util.find_spec("deepspeed.ops.adam").name
        print(json.dumps(record))
    """
    without = json.loads(run([], probe).stdout)
    assert without == {"spec": False, "version": None}
    under = json.loads(run(DOORWAY, probe).stdout)
    version = doorway.doorway_version()
    assert under["spec"] and under["version"] == under["__version__"] == version
    assert under["torch"] is False
    assert under["file"] == os.path.join(doorway.DOORWAY_DIR, "deepspeed", "__init__.py")
    assert under["env"] == "1"
    assert under["one_module"] and under["engine"] and under["zero_alias"]
    assert under["sub_spec"] == "deepspeed.ops.adam"


def test_transformers_and_accelerate_find_deepspeed():
    code = """
        import accelerate.utils
        import transformers.integrations.deepspeed as hf
        from transformers.utils.versions import require_version
        require_version("deepspeed>=0.9.3")
        print(hf.is_deepspeed_available(), accelerate.utils.is_deepspeed_available())
    """
    assert run(DOORWAY, code).stdout.split() == ["True", "True"]


def test_every_table_entry_resolves():
    code = """
        import importlib, json, sys
        from zero.integrations.deepspeed import TABLE, listed_names
        from zero.integrations.placeholder import is_placeholder
        record = {"resolved": [], "bad": []}
        for path, entry in TABLE.items():
            module = importlib.import_module(path)
            if module is not sys.modules[entry.same_as or path]:
                record["bad"].append(f"{path}: two module objects")
            for name in sorted(entry.names):
                value = getattr(module, name)
                (record["bad"] if is_placeholder(value) else record["resolved"]).append(
                    f"{path}.{name}"
                )
        import deepspeed
        if hasattr(deepspeed, "PipelineModuleX") or getattr(deepspeed, "x", 7) != 7:
            record["bad"].append("hasattr / getattr with a default raise or find a name")
        print(json.dumps(record))
    """
    record = json.loads(run(DOORWAY, code).stdout)
    assert record["bad"] == []
    for name in (
        "deepspeed.initialize",
        "deepspeed.DeepSpeedEngine",
        "deepspeed.runtime.zero.Init",
        "deepspeed.checkpoint.utils.clone_tensors_for_torch_save",
        "deepspeed.launcher.runner.DEEPSPEED_ENVIRONMENT_NAME",
        "deepspeed.utils.logging.logger",
        "deepspeed.utils.torch.required_torch_version",
    ):
        assert name in record["resolved"]


def fake_deepspeed(tmp_path) -> str:
    """A directory holding a 'real' DeepSpeed 0.14.0 (a package and its dist-info)."""
    site = tmp_path / "site"
    (site / "deepspeed").mkdir(parents=True)
    (site / "deepspeed" / "__init__.py").write_text("__version__ = '0.14.0'\n")
    (site / "deepspeed-0.14.0.dist-info").mkdir()
    (site / "deepspeed-0.14.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: deepspeed\nVersion: 0.14.0\n"
    )
    return str(site)


def test_a_real_deepspeed_is_never_shadowed_silently(tmp_path):
    site = fake_deepspeed(tmp_path)
    code = "import deepspeed; print(deepspeed.__file__)"
    said = f"runs in place of DeepSpeed 0.14.0 at {os.path.join(site, 'deepspeed')}"
    quiet = run(DOORWAY, code)
    assert said not in quiet.stderr and "runs in place" not in quiet.stderr
    # The command says it once; the doorway package logs it once on rank 0.
    shadowing = run(DOORWAY, code, env=clean_env(PYTHONPATH=site))
    assert shadowing.stdout.strip().startswith(doorway.DOORWAY_DIR)
    assert shadowing.stderr.count(said) == 2, shadowing.stderr
    assert f"zero-as-deepspeed: zero {zero.__version__} {said}" in shadowing.stderr
    assert "run the command without zero-as-deepspeed" in shadowing.stderr
    other_rank = run(DOORWAY, code, env=clean_env(PYTHONPATH=site, RANK="1"))
    assert other_rank.stderr.count(said) == 1
    # PYTHONPATH set by hand (zero-as-deepspeed --print-path): the package still says it.
    path = subprocess.run([*DOORWAY, "--print-path"], capture_output=True, text=True).stdout
    assert path.strip() == doorway.DOORWAY_DIR
    by_hand = run([], code, env=clean_env(PYTHONPATH=os.pathsep.join([path.strip(), site])))
    assert by_hand.stderr.count(said) == 1


def test_command_line_errors():
    assert subprocess.run(DOORWAY, capture_output=True).returncode == 2
    assert subprocess.run([*DOORWAY, "--bogus"], capture_output=True).returncode == 2
    missing = subprocess.run([*DOORWAY, "no-such-command-zero"], capture_output=True, text=True)
    assert missing.returncode == 127 and "no-such-command-zero" in missing.stderr


def deepspeed_args(*argv):
    return deepspeed_launcher.build_parser().parse_args([*argv, "train.py", "--lr", "1"])


def test_deepspeed_flags_map_onto_zrun(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(deepspeed_launcher, "DEEPSPEED_ENVIRONMENT_PATHS", (str(tmp_path),))
    (tmp_path / ".deepspeed_env").write_text("NCCL_IB_DISABLE=1\nWANDB_MODE=off line\n")
    single = deepspeed_args("--num_gpus", "2", "--master_port", "1234", "--no_local_rank")
    assert deepspeed_launcher.zrun_argv(single) == [
        "--master_port", "1234", "--num_gpus", "2", "--no_local_rank", "train.py", "--lr", "1",
    ]  # fmt: skip
    (tmp_path / "hosts").write_text("w0 slots=2\nw1 slots=2\n")
    multi = deepspeed_args("-H", "hosts", "--num_accelerators", "1", "--no_ssh_check")
    argv = deepspeed_launcher.zrun_argv(multi)
    assert argv[argv.index("--launcher") + 1] == "pdsh"  # DeepSpeed's default runner
    assert argv[argv.index("--num_gpus") + 1] == "1" and "--no_ssh_check" in argv
    envs = [argv[i + 1] for i, word in enumerate(argv) if word == "--env"]
    assert envs == ["NCCL_IB_DISABLE=1", "WANDB_MODE=off line"]
    one_host = deepspeed_launcher.zrun_argv(deepspeed_args("-H", "hosts", "--include", "w0"))
    assert "--launcher" not in one_host and "--env" not in one_host  # a single-node run
    nossh = deepspeed_launcher.zrun_argv(deepspeed_args("--no_ssh", "--node_rank", "1"))
    assert nossh[nossh.index("--node_rank") + 1] == "1"
    with pytest.raises(ValueError, match="--node_rank"):
        deepspeed_launcher.zrun_argv(deepspeed_args("--no_ssh"))
    logs = deepspeed_launcher.zrun_argv(deepspeed_args("--enable_each_rank_log", "logs"))
    assert logs[logs.index("--log_dir") + 1] == "logs"
    tuned = deepspeed_launcher.zrun_argv(deepspeed_args("--autotuning", "run"))
    assert tuned[tuned.index("--autotuning") + 1] == "run"  # zrun's tuner (docs/tuning.md)
    for refused in (
        ["--elastic_training"],
        ["--bind_cores_to_rank"],
        ["--venv_script", "env.sh"],
        ["-H", "hosts", "--launcher", "MVAPICH"],
    ):
        with pytest.raises(NotImplementedError, match=refused[-1].lstrip("-")):
            deepspeed_launcher.zrun_argv(deepspeed_args(*refused))
    assert deepspeed_launcher.main(["--bind_cores_to_rank", "train.py"]) == 2


def test_zrun_no_ssh_check_skips_the_ssh_check(monkeypatch):
    def unreachable(hosts, options):
        raise ValueError("cannot reach host over ssh")

    monkeypatch.setattr(remote_module, "check_ssh_reachable", unreachable)
    layout = build_layout({"w0": [0], "w1": [0]}, "10.0.0.1", 29500)
    job = JobSpec(script="train.py", script_args=(), run_id="r1")
    with pytest.raises(ValueError, match="ssh"):
        remote_launches(layout, job, RemoteOptions("pdsh"))
    launches = remote_launches(layout, job, RemoteOptions("pdsh", ssh_check=False))
    assert launches[0].command[0] == "pdsh"


def test_deepspeed_command_runs_ranks_with_zrun(tmp_path):
    script = tmp_path / "main.py"
    script.write_text(
        textwrap.dedent("""
        import json, os, sys
        import deepspeed
        record = {"argv": sys.argv[1:], "file": deepspeed.__file__}
        out = os.path.join(os.path.dirname(__file__), f"rank{os.environ['RANK']}.json")
        with open(out, "w") as f:
            json.dump(record, f)
        """)
    )
    port = str(find_free_port())
    command = [*DOORWAY, "deepspeed", "--num_gpus", "2", "--master_port", port, str(script)]
    result = subprocess.run(
        [*command, "--deepspeed_config", "ds.json"],
        env=clean_env(HOME=str(tmp_path)),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert record["argv"] == [f"--local_rank={rank}", "--deepspeed_config", "ds.json"]
        assert record["file"].startswith(doorway.DOORWAY_DIR)


def test_deepspeed_helpers():
    base = torch.arange(12.0)
    state = collections.OrderedDict(w=base[:4], nested=[(base[4:6],)], n=3)
    state["d"] = collections.defaultdict(list, {"g": base[6:]})
    cloned = doorway.clone_tensors_for_torch_save(state)
    assert type(cloned) is collections.OrderedDict and list(cloned) == list(state)
    assert isinstance(cloned["d"], collections.defaultdict) and cloned["d"].default_factory is list
    assert isinstance(cloned["nested"], list) and isinstance(cloned["nested"][0], tuple)
    for copy, original in ((cloned["w"], state["w"]), (cloned["d"]["g"], state["d"]["g"])):
        assert torch.equal(copy, original) and copy.untyped_storage().size() == copy.nbytes
        assert copy.data_ptr() != original.data_ptr()
    assert cloned["n"] == 3
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.ReLU()))
    assert doorway.recursive_getattr(model, "1.0") is model[1][0]
    replacement = torch.nn.Tanh()
    doorway.recursive_setattr(model, "1.0", replacement)
    assert model[1][0] is replacement
    with pytest.raises(AttributeError):
        doorway.recursive_getattr(model, "0.missing")


def test_a_real_deepspeed_behind_an_editable_install_finder_is_found(tmp_path, monkeypatch):
    """`pip install -e DeepSpeed` puts a finder on sys.meta_path, not a path entry: the doorway
    must still see it and say that it runs in its place."""
    import importlib.abc
    import importlib.util

    package = tmp_path / "src" / "deepspeed"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("__version__ = '0.16.4'\n")

    class EditableFinder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name != "deepspeed":
                return None
            init = str(package / "__init__.py")
            return importlib.util.spec_from_file_location(
                name, init, submodule_search_locations=[str(package)]
            )

    monkeypatch.setattr(sys, "meta_path", [*sys.meta_path, EditableFinder()])
    real = doorway.find_real_deepspeed(doorway.DOORWAY_DIR, [doorway.DOORWAY_DIR])
    assert real is not None and real.location == str(package)
    assert "runs in place of DeepSpeed" in doorway.shadow_message(real, doorway.DOORWAY_DIR)


def test_enabled_blocks_that_change_training_are_refused_under_the_doorway():
    """A DeepSpeed program asking for apex AMP (or elasticity, ...) must not train in fp32: the
    doorway loads configs through zero's Config, which refuses them ([Note: enabled blocks zero
    does not implement] in config/subsystems.py); a block that only observes still warns."""
    code = """
        import json, warnings, torch, deepspeed
        config = {"train_micro_batch_size_per_gpu": 1,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
        record = {}
        for block in ("amp", "elasticity", "hybrid_engine"):
            try:
                with warnings.catch_warnings(record=True) as seen:
                    warnings.simplefilter("always")
                    deepspeed.initialize(model=torch.nn.Linear(2, 2),
                                         config={**config, block: {"enabled": True}})
                said = [str(w.message) for w in seen if block in str(w.message)]
                record[block] = ["warned", said]
            except NotImplementedError as error:
                record[block] = [type(error).__name__, str(error)]
        print(json.dumps(record))
    """
    record = json.loads(run(DOORWAY, code).stdout.splitlines()[-1])
    for block in ("amp", "elasticity"):
        kind, message = record[block]
        assert kind == "ConfigNotImplementedError" and f"{block}.enabled = true" in message
    assert record["hybrid_engine"][0] == "warned" and len(record["hybrid_engine"][1]) == 1
