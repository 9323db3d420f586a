"""Hostfile parsing, resource selection, world layout and the commands built from them."""

import os
import socket

import pytest

from zero.launcher import agent, main
from zero.launcher.hostfile import parse_host_filter, parse_hostfile, select_resources
from zero.launcher.runner import JobSpec, agent_command
from zero.launcher.world import build_layout, is_local_host


def write_hostfile(tmp_path, text):
    path = tmp_path / "hosts"
    path.write_text(text)
    return str(path)


def test_parse_good_hostfile_keeps_order_and_skips_comments(tmp_path):
    path = write_hostfile(
        tmp_path,
        "# whole-line comment\n\nworker-1 slots=4\n   \nworker-0 slots=2  # trailing comment\n"
        "10.0.0.3\tslots=8\n",
    )
    hosts = parse_hostfile(path)
    assert list(hosts.items()) == [("worker-1", 4), ("worker-0", 2), ("10.0.0.3", 8)]


@pytest.mark.parametrize(
    "bad_line, reason",
    [
        ("worker-1", "expected 'hostname slots=N'"),
        ("worker-1 gpus=2", "missing 'slots=N'"),
        ("worker-1 slots=", "missing 'slots=N'"),
        ("worker-1 slots=two", "slots must be an integer"),
        ("worker-1 slots=1.5", "slots must be an integer"),
        ("worker-1 slots=2_0", "slots must be an integer in decimal digits, got '2_0'"),
        ("worker-1 slots=+2", "slots must be an integer"),
        ("WORKER-0 slots=1", "listed twice (as 'worker-0'; host names ignore case)"),
        ("worker-1 slots=0", "slots must be > 0"),
        ("worker-1 slots=-2", "slots must be > 0"),
        ("worker-1 slots=2 extra", "expected 'hostname slots=N'"),
        ("worker-0 slots=1", "listed twice (lines 2 and 3)"),
        ("worker-1 lots=2", "did you mean 'slots=2' instead of 'lots=2'?"),
        ("worker-1 slot=2", "did you mean 'slots=2'"),
        ("-oProxyCommand=x slots=2", "starts with '-'"),
        ("alice@worker-1 slots=2", "contains '@': give the host only"),
        ("worker-1,worker-2 slots=2", "may contain only letters, digits"),
        ("worker-1:0 slots=2", "may contain only letters, digits"),
        ("worker-1 slots=4097", "slots must be <= 4096 (slots per host), got 4097"),
        ("worker-1 slots=99999999999999999999", "slots must be <= 4096"),
    ],
)
def test_bad_line_names_file_line_number_and_line(tmp_path, bad_line, reason):
    path = write_hostfile(tmp_path, f"# header\nworker-0 slots=2\n{bad_line}  # note\n")
    with pytest.raises(ValueError) as info:
        parse_hostfile(path)
    message = str(info.value)
    assert f"'{path}'" in message
    assert "line 3" in message
    assert reason in message
    assert bad_line in message


def test_missing_hostfile_names_the_file(tmp_path):
    path = str(tmp_path / "no-such-hosts")
    with pytest.raises(FileNotFoundError, match="no-such-hosts"):
        parse_hostfile(path)


def test_hostfile_that_is_a_directory_says_so(tmp_path):
    with pytest.raises(ValueError, match="is a directory"):
        parse_hostfile(str(tmp_path))


@pytest.mark.parametrize(
    "text, argv, message",
    [
        ("localhost slots=99999999999999999999\n", [], "line 1: slots must be <= 4096"),
        ("localhost slots=2\n", ["--num_gpus", "99999999999999999999"], "--num_gpus must be <="),
        (None, [], "is a directory"),
    ],
)
def test_zrun_reports_absurd_slots_and_directories_in_one_line(
    tmp_path, capsys, text, argv, message
):
    hostfile = write_hostfile(tmp_path, text) if text is not None else str(tmp_path)
    assert main(["--hostfile", hostfile, *argv, "train.py"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zrun: error: ")
    assert message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_hostfile_without_hosts_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="lists no host"):
        parse_hostfile(write_hostfile(tmp_path, "# only a comment\n\n"))


POOL = {"a": [0, 1, 2, 3], "b": [0, 1, 2, 3], "c": [0, 1]}


def test_include_hosts_and_slots():
    assert parse_host_filter("a:0,2@c", "--include") == {"a": [0, 2], "c": None}
    assert select_resources(POOL, include="c@a:2,0") == {"a": [0, 2], "c": [0, 1]}
    # Host names ignore case; the hostfile's spelling is kept.
    assert select_resources(POOL, include="C@A:2,0") == {"a": [0, 2], "c": [0, 1]}
    assert select_resources(POOL, exclude="B@A") == {"c": [0, 1]}


def test_exclude_hosts_and_slots():
    assert select_resources(POOL, exclude="b@a:1") == {"a": [0, 2, 3], "c": [0, 1]}
    assert select_resources(POOL, exclude="c:0,1") == {"a": [0, 1, 2, 3], "b": [0, 1, 2, 3]}


def test_num_nodes_and_num_gpus_take_the_first():
    assert select_resources(POOL, num_nodes=2, num_gpus=2) == {"a": [0, 1], "b": [0, 1]}


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"include": "a", "exclude": "b"}, "mutually exclusive"),
        ({"include": "a", "num_gpus": 1}, "cannot be combined"),
        ({"include": "z"}, "host 'z' is not in the hostfile"),
        ({"exclude": "a:7"}, "has no slot"),
        ({"include": "a:x"}, "must be integers"),
        ({"include": "a:1_0"}, "must be integers"),
        ({"include": "a@A"}, "host 'A' appears twice"),
        ({"num_nodes": 4}, "--num_nodes must be in 1..3"),
        ({"num_gpus": 3}, "exceeds the 2 slots of host 'c'"),
        ({"exclude": "a@b@c"}, "no host left"),
        ({"include": "a:"}, "no slot ids after 'a:'"),
        ({"exclude": "b@a: "}, "no slot ids after 'a:'"),
    ],
)
def test_bad_selection(kwargs, match):
    with pytest.raises(ValueError, match=match):
        select_resources(POOL, **kwargs)


def test_layout_ranks_and_master_defaults():
    layout = build_layout({"localhost": [0, 1], "127.0.0.1": [0, 1, 2]}, None, 0)
    assert layout.world_size == 5
    assert layout.num_nodes == 2
    assert [layout.first_rank(n) for n in layout.nodes] == [0, 2]
    assert layout.master_addr == "127.0.0.1"
    assert 0 < layout.master_port <= 65535


def test_layout_rejects_bad_port():
    with pytest.raises(ValueError, match="65535"):
        build_layout({"localhost": [0]}, None, 70000)


def test_local_host_detection():
    assert is_local_host("localhost")
    assert is_local_host("127.0.0.2")
    assert is_local_host(socket.gethostname())
    assert not is_local_host("no-such-node.invalid")


def test_agent_command_passes_layout_and_script_args():
    layout = build_layout({"localhost": [1, 3]}, None, 29501)
    job = JobSpec(script="train.py", script_args=("--config", "z.json"), run_id="r1")
    command = agent_command(layout, layout.nodes[0], job)
    assert command[-3:] == ["train.py", "--config", "z.json"]
    assert command[command.index("--device_ids") + 1] == "1,3"
    assert command[command.index("--master_port") + 1] == "29501"
    contiguous = build_layout({"localhost": [0, 1]}, None, 29501)
    assert "--device_ids" not in agent_command(contiguous, contiguous.nodes[0], job)


def test_rank_command_variants():
    parse = agent.build_parser().parse_args
    args = parse(["train.py", "--lr", "1"])
    assert agent.rank_command(args, "${local_rank}")[1:] == [
        "-u", "train.py", "--local_rank=${local_rank}", "--lr", "1"
    ]  # fmt: skip
    args = parse(["--module", "--no_local_rank", "pkg.train", "x"])
    assert agent.rank_command(args, "0")[1:] == ["-u", "-m", "pkg.train", "x"]
    args = parse(["--no_python", "--log_dir", "/logs", "./run.sh"])
    command = agent.rank_command(args, "0")
    assert command[:2] == ["/bin/sh", "-c"]
    assert command[3:] == ["/logs", "./run.sh", "--local_rank=0"]


def test_omp_num_threads_splits_cores():
    num_cores = len(os.sched_getaffinity(0))
    assert agent.omp_num_threads(1) == num_cores
    assert agent.omp_num_threads(10_000) == 1


def test_empty_include_or_exclude_is_an_error():
    from zero.launcher.hostfile import select_resources

    for kwargs in ({"include": ""}, {"exclude": "  "}):
        with pytest.raises(ValueError, match="is empty"):
            select_resources({"localhost": [0, 1]}, **kwargs)


def test_non_utf8_hostfile_names_the_file_and_line(tmp_path):
    path = tmp_path / "hosts"
    path.write_bytes("worker-0 slots=2\nw\u00f6rker-1 slots=2\n".encode("latin-1"))
    with pytest.raises(ValueError) as info:
        parse_hostfile(str(path))
    assert str(info.value) == (
        f"hostfile '{path}' line 2 is not UTF-8 text (byte 0xf6 at column 2); save the file "
        "as UTF-8"
    )


def test_include_without_a_hostfile_says_what_was_selected(tmp_path, monkeypatch, capsys):
    """No hostfile: the pool is this machine, and the message says so (not "the hostfile")."""
    monkeypatch.chdir(tmp_path)
    code = main(["--num_gpus", "2", "--include", "worker-0", "train.py"])
    err = capsys.readouterr().err
    assert code != 0
    assert (
        "--include: host 'worker-0' is not in this machine (no hostfile given: 'localhost' "
        "with 2 slot(s)): hosts ['localhost']" in err
    )


def test_hostfile_with_a_byte_order_mark(tmp_path):
    path = tmp_path / "hosts"
    path.write_bytes("\ufeffworker-0 slots=2\r\nworker-1 slots=1\r\n".encode("utf-8"))
    assert parse_hostfile(str(path)) == {"worker-0": 2, "worker-1": 1}
