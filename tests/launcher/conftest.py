"""A throwaway sshd on loopback (127.0.0.1 and 127.0.0.2) for the multi-node launcher tests.

The fixture generates a client key and a host key into a temporary directory, starts sshd in
the foreground on a free port and stops it at the end of the session. Tests that need it skip,
with the reason, when sshd or ssh-keygen is missing or sshd does not accept a login.
"""

import os
import shutil
import subprocess
import time
from dataclasses import dataclass

import pytest
from zrun_helpers import write

from zero.launcher.world import find_free_port

SSHD_CONFIG = """\
ListenAddress 127.0.0.1
ListenAddress 127.0.0.2
Port {port}
HostKey {dir}/host_key
AuthorizedKeysFile {dir}/client_key.pub
PidFile none
UsePAM no
StrictModes no
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
"""
SSH_CONFIG = """\
Host *
  IdentityFile {dir}/client_key
  IdentitiesOnly yes
  StrictHostKeyChecking no
  UserKnownHostsFile /dev/null
  LogLevel ERROR
  BatchMode yes
"""


@dataclass(frozen=True)
class LoopbackSshd:
    port: int
    ssh_config: str

    def ssh_args(self) -> list[str]:
        """zrun flags that reach this sshd."""
        return ["--ssh_port", str(self.port), "--launcher_args", f"-F {self.ssh_config}"]

    def ssh(self, host: str, command: str, **kwargs) -> subprocess.CompletedProcess:
        ssh = ["ssh", "-F", self.ssh_config, "-p", str(self.port), host, command]
        return subprocess.run(ssh, capture_output=True, timeout=30, **kwargs)


def _missing_tools() -> str | None:
    for tool in ("ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"'{tool}' is not installed (apt-get install openssh-client)"
    if _sshd_path() is None:
        return "sshd is not installed (apt-get install openssh-server; .ci/run does)"
    return None


def _sshd_path() -> str | None:
    found = shutil.which("sshd")
    return found or ("/usr/sbin/sshd" if os.path.exists("/usr/sbin/sshd") else None)


def _wait_for_login(sshd: LoopbackSshd, proc: subprocess.Popen, log: str) -> str | None:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            with open(log) as f:
                return f"sshd exited with code {proc.returncode}: {f.read().strip()}"
        result = sshd.ssh("127.0.0.2", "true", text=True)
        if result.returncode == 0:
            return None
        time.sleep(0.2)
    return f"no ssh login to the loopback sshd: {result.stderr.strip()}"


@pytest.fixture(scope="session")
def loopback_sshd(tmp_path_factory):
    reason = _missing_tools()
    if reason:
        pytest.skip(f"multi-node tests need a loopback sshd: {reason}")
    directory = tmp_path_factory.mktemp("sshd")
    for key in ("client_key", "host_key"):
        keygen = ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(directory / key)]
        subprocess.run(keygen, check=True, capture_output=True, timeout=30)
    port = find_free_port()
    config = write(directory, "sshd_config", SSHD_CONFIG.format(port=port, dir=directory))
    client = write(directory, "ssh_config", SSH_CONFIG.format(dir=directory))
    if os.geteuid() == 0:
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege separation dir
    log = str(directory / "sshd.log")
    proc = subprocess.Popen([_sshd_path(), "-D", "-E", log, "-f", config])
    sshd = LoopbackSshd(port, client)
    reason = _wait_for_login(sshd, proc, log)
    if reason:
        proc.kill()
        proc.wait()
        pytest.skip(f"multi-node tests need a loopback sshd: {reason}")
    yield sshd
    proc.terminate()
    proc.wait(timeout=10)
