"""Pure construction of the multi-node commands (ssh, pdsh, srun, mpirun), the environment
rules, SLURM node lists, the agent's node resolution, and the rank layout zero reads from
SLURM and Open MPI variables. srun and mpirun are not run here: their command lines are."""

import os
import shlex
import sys

import pytest
from zrun_helpers import write

import zero.launcher as zero_launcher
from zero.comm import read_launch_env
from zero.launcher import agent, build_parser, plan_launches
from zero.launcher import remote as remote_module
from zero.launcher.environment import exported_variables, job_environment, read_env_file
from zero.launcher.nodelist import expand_nodelist, first_host
from zero.launcher.remote import (
    PDSH_NODE_RANK,
    RemoteOptions,
    mpirun_command,
    pdsh_command,
    pdsh_environment,
    remote_agent_argv,
    remote_launches,
    remote_shell_command,
    srun_command,
    ssh_command,
)
from zero.launcher.runner import JobSpec
from zero.launcher.world import build_layout, format_nodes, master_address, parse_nodes

JOB = JobSpec(script="train.py", script_args=("--config", "a b.json"), run_id="r1")
LAYOUT = build_layout({"w0": [0, 1], "w1": [0, 2]}, "10.0.0.1", 29500)
ENV = {"ZERO_A": "x y", "ZERO_B": "$(id) 'q' 50%"}


def test_remote_shell_command_is_one_word_per_value():
    argv = [sys.executable, "-u", "script; rm -rf /", "a b", "$HOME"]
    text = remote_shell_command("/data/my dir", ENV, argv)
    words = shlex.split(text)  # what a POSIX shell makes of it
    assert words[:5] == ["cd", "/data/my dir", "&&", "exec", "env"]
    assert words[5:] == ["ZERO_A=x y", "ZERO_B=$(id) 'q' 50%", *argv]


def test_pdsh_command_escapes_percent_except_node_rank():
    text = remote_shell_command("/d", ENV, ["python", "--node_rank", PDSH_NODE_RANK, "100%"])
    assert "--node_rank %n " in text
    assert "50%%" in text and "100%%" in text
    options = RemoteOptions("pdsh", 2222, ("-u", "30"))
    assert pdsh_command(["w0", "w1"], text, options) == [
        "pdsh", "-S", "-f", "1024", "-R", "ssh", "-w", "w0,w1", "-u", "30", text,
    ]  # fmt: skip
    env = pdsh_environment({"PDSH_SSH_ARGS_APPEND": "-F cfg"}, options)
    assert env["PDSH_SSH_ARGS_APPEND"] == "-F cfg -p 2222"


def test_ssh_command_carries_port_and_user_options():
    options = RemoteOptions("ssh", 2222, ("-F", "my config", "-o", "ProxyJump=bastion"))
    assert ssh_command("w1", "CMD", options) == [
        "ssh", "-p", "2222", "-F", "my config", "-o", "ProxyJump=bastion", "w1", "CMD",
    ]  # fmt: skip
    assert ssh_command("w1", "CMD", RemoteOptions()) == ["ssh", "w1", "CMD"]


def test_ssh_launches_one_agent_per_node(monkeypatch):
    checked = []
    monkeypatch.setattr(remote_module, "check_ssh_reachable", lambda h, o: checked.extend(h))
    launches = remote_launches(LAYOUT, JOB, RemoteOptions("ssh", 2200))
    assert checked == ["w0", "w1"]
    assert [launch.name for launch in launches] == ["node 0 'w0'", "node 1 'w1'"]
    assert all(launch.stdin_channel for launch in launches)
    words = shlex.split(launches[1].command[-1])
    assert words[words.index("--node_rank") + 1] == "1"
    assert words[words.index("--nodes") + 1] == "w0:0,1@w1:0,2"
    assert "--exit_on_stdin_eof" in words and "--exit_on_hangup" in words
    assert words[-3:] == ["train.py", "--config", "a b.json"]


def test_srun_command():
    argv = remote_agent_argv(LAYOUT, JOB, ["--node_name_env", "SLURMD_NODENAME"], [])
    command = srun_command(
        LAYOUT, ENV, argv, RemoteOptions("slurm", None, ("--cpus-per-task", "8"))
    )
    assert command[: command.index("env")] == [
        "srun", "--nodes", "2", "--ntasks", "2", "--ntasks-per-node", "1",
        "--nodelist", "w0,w1", "--kill-on-bad-exit=1", "--cpus-per-task", "8",
    ]  # fmt: skip
    rest = command[command.index("env") + 1 :]
    assert rest[:2] == ["ZERO_A=x y", "ZERO_B=$(id) 'q' 50%"]  # argv, no shell: unquoted
    assert rest[2:] == argv


def test_mpirun_command():
    argv = ["python", "-m", "zero.launcher.agent"]
    command = mpirun_command(LAYOUT, {"ZERO_A": "1"}, argv, RemoteOptions("openmpi", 2222))
    assert command == [
        "mpirun", "-np", "2", "--host", "w0:1,w1:1", "--map-by", "ppr:1:node",
        "--bind-to", "none", "--mca", "plm_rsh_args", "-p 2222", "env", "ZERO_A=1", *argv,
    ]  # fmt: skip


def test_slurm_and_openmpi_agents_find_their_node_rank():
    launches = remote_launches(LAYOUT, JOB, RemoteOptions("slurm"))
    assert launches[0].command[0] == "srun" and "SLURMD_NODENAME" in launches[0].command
    launches = remote_launches(LAYOUT, JOB, RemoteOptions("openmpi"))
    assert launches[0].command[0] == "mpirun" and "OMPI_COMM_WORLD_RANK" in launches[0].command


def _parse_zrun(*argv):
    return build_parser().parse_args([*argv, "train.py"])


def test_plan_local_unless_forced(tmp_path):
    hostfile = write(tmp_path, "hosts", "localhost slots=1\n127.0.0.2 slots=1\n")
    args = _parse_zrun("--hostfile", hostfile)
    layout = build_layout({"localhost": [0], "127.0.0.2": [0]}, None, 29500)
    launches, remote = plan_launches(args, layout, JOB)
    assert not remote and len(launches) == 2
    assert launches[1].command[launches[1].command.index("--node_rank") + 1] == "1"
    args = _parse_zrun("--launcher", "openmpi")
    assert plan_launches(args, layout, JOB)[0][0].command[0] == "mpirun"


def test_plan_no_ssh_starts_only_the_given_node():
    args = _parse_zrun("--no_ssh", "--node_rank", "1", "--num_nodes", "2", "--num_gpus", "3")
    layout = build_layout({"node0": [0, 1, 2], "node1": [0, 1, 2]}, "10.0.0.1", 29500)
    [launch], remote = plan_launches(args, layout, JOB)
    command = launch.command
    assert not remote
    for flag, value in [("--node_rank", "1"), ("--num_nodes", "2"), ("--nproc_per_node", "3")]:
        assert command[command.index(flag) + 1] == value
    assert command[command.index("--master_addr") + 1] == "10.0.0.1"
    # Nodes started by hand must agree on the rendezvous id without talking to each other.
    assert zero_launcher._run_id(args) == "zrun-no_ssh-29500"
    with pytest.raises(ValueError, match="only used with --no_ssh"):
        plan_launches(_parse_zrun("--node_rank", "1"), layout, JOB)


def test_env_file_splits_on_first_equals(tmp_path):
    path = write(tmp_path, ".zero_env", '# comment\n\nA=b=c \nJSON={"k": "v=1"}\nEMPTY=\n')
    assert read_env_file(path) == {"A": "b=c ", "JSON": '{"k": "v=1"}', "EMPTY": ""}
    bad = write(tmp_path, "bad_env", "A=1\nno equals here\n")
    with pytest.raises(ValueError, match="line 2: expected KEY=VALUE"):
        read_env_file(bad)


def test_environment_precedence_and_prefixes(tmp_path):
    environ = {"NCCL_DEBUG": "INFO", "PYTHONPATH": "/p", "HOME": "/h", "GLOO_X": "1", "A": "0"}
    assert exported_variables(environ) == {"NCCL_DEBUG": "INFO", "PYTHONPATH": "/p", "GLOO_X": "1"}
    first = write(tmp_path, "home_env", "A=1\nB=1\n")
    second = write(tmp_path, "cwd_env", "B=2\nNCCL_DEBUG=WARN\n")
    env = job_environment(environ, [first, second], ["A=3", "C=x=y"])
    assert env == {
        "NCCL_DEBUG": "WARN", "PYTHONPATH": "/p", "GLOO_X": "1", "A": "3", "B": "2", "C": "x=y",
    }  # fmt: skip
    with pytest.raises(ValueError, match="--env: invalid variable name '1A'"):
        job_environment({}, [], ["1A=2"])


def test_expand_nodelist():
    assert expand_nodelist("node[01-03,07],gpu-a") == [
        "node01",
        "node02",
        "node03",
        "node07",
        "gpu-a",
    ]
    assert expand_nodelist("r[1-2]n[9-10]") == ["r1n9", "r1n10", "r2n9", "r2n10"]
    assert expand_nodelist("single") == ["single"]
    for bad in ("node[1-", "node[3-1]", "node[a]"):
        with pytest.raises(ValueError, match="node list"):
            expand_nodelist(bad)


def test_nodes_round_trip_and_agent_resolution(monkeypatch):
    spec = format_nodes(build_layout({"a": [0, 1], "::1": [1, 3]}, "127.0.0.1", 1).nodes)
    assert [(n.host, n.slot_ids) for n in parse_nodes(spec)] == [("a", (0, 1)), ("::1", (1, 3))]
    parse = agent.build_parser().parse_args
    monkeypatch.setenv("SLURMD_NODENAME", "::1")
    args = parse(["--nodes", spec, "--node_name_env", "SLURMD_NODENAME", "train.py"])
    agent.resolve_node(args)
    assert (args.node_rank, args.num_nodes, args.nproc_per_node) == (1, 2, 2)
    assert (args.device_ids, args.node_name) == ("1,3", "::1")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    args = parse(["--nodes", spec, "--node_rank_env", "OMPI_COMM_WORLD_RANK", "train.py"])
    agent.resolve_node(args)
    assert (args.node_rank, args.node_name, args.device_ids) == (0, "a", None)
    monkeypatch.setenv("SLURMD_NODENAME", "elsewhere")
    with pytest.raises(ValueError, match="'elsewhere' is not one of the nodes"):
        agent.resolve_node(parse(["--nodes", spec, "--node_name_env", "SLURMD_NODENAME", "t"]))


def test_master_address_defaults():
    assert master_address(["localhost", "127.0.0.2"]) == "127.0.0.1"
    assert master_address(["no-such-node.invalid", "localhost"]) == "no-such-node.invalid"
    address = master_address(["127.0.0.1", "no-such-node.invalid"])
    assert not address.startswith("127.") and address != "localhost"


_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def clean_launch_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith(("SLURM_", "OMPI_COMM_WORLD_")):
            monkeypatch.delenv(name)
    for name in _LAUNCH_VARS:
        # Set, then delete: monkeypatch then also removes what read_launch_env writes into
        # os.environ (MASTER_ADDR, MASTER_PORT), which would reach later tests' jobs.
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    return monkeypatch


def test_read_launch_env_from_slurm(clean_launch_env):
    for name, value in [("SLURM_PROCID", "5"), ("SLURM_NTASKS", "8"), ("SLURM_LOCALID", "1")]:
        clean_launch_env.setenv(name, value)
    clean_launch_env.setenv("SLURM_JOB_NODELIST", "gpu[07-08]")
    launch = read_launch_env()
    assert (launch.rank, launch.local_rank, launch.world_size) == (5, 1, 8)
    if not os.path.exists("/usr/bin/scontrol"):
        assert os.environ["MASTER_ADDR"] == "gpu07"
    assert os.environ["MASTER_PORT"] == "29500"
    assert first_host("gpu[07-08]") in ("gpu07", os.environ["MASTER_ADDR"])


def test_read_launch_env_from_openmpi_and_precedence(clean_launch_env):
    for name, value in [("OMPI_COMM_WORLD_RANK", "2"), ("OMPI_COMM_WORLD_SIZE", "4")]:
        clean_launch_env.setenv(name, value)
    clean_launch_env.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "0")
    clean_launch_env.setenv("MASTER_ADDR", "head")
    launch = read_launch_env()
    assert (launch.rank, launch.local_rank, launch.world_size) == (2, 0, 4)
    assert os.environ["MASTER_ADDR"] == "head"
    clean_launch_env.setenv("RANK", "1")  # zrun/torchrun variables win
    clean_launch_env.setenv("WORLD_SIZE", "2")
    assert read_launch_env().rank == 1
    clean_launch_env.setenv("RANK", "9")
    with pytest.raises(ValueError, match="RANK=9 is outside 0..WORLD_SIZE-1=1"):
        read_launch_env()
