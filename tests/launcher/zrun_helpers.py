"""Helpers for the end-to-end launcher tests: write a rank script, start zrun, find leftovers.

Every process a job starts carries the test's tmp_path in its command line, so "nothing left
behind" is checked by scanning the process table for it.
"""

import os
import shutil
import subprocess
import sys
import textwrap
import time

import psutil

from zero.launcher.world import find_free_port

# A rank script may start a grandchild that sleeps; it carries the marker in its argv.
GRANDCHILD = "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)', MARKER])"


def zrun_command() -> list[str]:
    zrun = shutil.which("zrun")
    if zrun is not None:
        return [zrun]
    return [sys.executable, "-c", "import sys; from zero.launcher import main; sys.exit(main())"]


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def write_script(tmp_path, body):
    header = "import json, os, subprocess, sys, time\n"
    header += f"MARKER = {str(tmp_path)!r}\nOUT = {str(tmp_path)!r}\n"
    return write(tmp_path, "script.py", header + textwrap.dedent(body))


def start_zrun(tmp_path, hosts, script, *args):
    hostfile = write(tmp_path, "hosts", hosts)
    command = [*zrun_command(), "--hostfile", hostfile, "--master_port", str(find_free_port())]
    command += [*args, script]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def job_processes(marker):
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if proc.pid != os.getpid() and any(marker in part for part in cmdline):
            found.append(proc)
    return found


def assert_nothing_left(marker, timeout_s=3.0):
    deadline = time.monotonic() + timeout_s
    while job_processes(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [(p.pid, p.info["cmdline"]) for p in job_processes(marker)]
    assert not left, f"processes left behind: {left}"


def wait_for_files(paths, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while not all(os.path.exists(p) for p in paths):
        assert time.monotonic() < deadline, f"ranks did not start: {paths}"
        time.sleep(0.05)
