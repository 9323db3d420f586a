"""Real runners for the multi-node launcher tests: a throwaway sshd on loopback (127.0.0.1 and
127.0.0.2), Open MPI's mpirun, and a one-node SLURM cluster (munged, slurmctld, slurmd).

The sshd fixture generates a client key and a host key into a temporary directory, starts sshd in
the foreground on a free port and stops it at the end of the session. The SLURM fixture does the
same for munged (a generated key) and the two SLURM daemons, configured for this machine only.
Tests that need one skip, with the reason, when a tool is missing or does not start.
"""

import os
import shutil
import socket
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


_JOB_VARIABLES = ("SLURM_", "OMPI_", "PMIX_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_")


def runner_environment(**extra: str) -> dict[str, str]:
    """os.environ without the variables of a job pytest itself may run in (srun and mpirun would
    join it; zero would read its rank from it), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_JOB_VARIABLES)}
    return {**env, **extra}


@pytest.fixture(scope="session")
def openmpi_env():
    """The environment to run Open MPI's mpirun with (allowed to run as root, as in CI)."""
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun is not installed (apt-get install openmpi-bin; .ci/run does)")
    version = subprocess.run(["mpirun", "--version"], capture_output=True, text=True, timeout=30)
    if "Open MPI" not in version.stdout + version.stderr:
        pytest.skip(f"mpirun is not Open MPI's: {version.stdout.strip()[:80]!r}")
    # Open MPI refuses root unless both are set (or --allow-run-as-root is given).
    return runner_environment(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")


SLURM_CONFIG = """\
ClusterName=zerotest
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={dir}/munge.socket
SlurmUser=root
SlurmdUser=root
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
NodeName={node} NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""
_SLURM_TOOLS = ("munged", "mungekey", "slurmctld", "slurmd", "srun", "salloc", "sinfo")


@dataclass(frozen=True)
class SlurmCluster:
    node: str
    env: dict[str, str]  # SLURM_CONF points at this cluster


def _slurm_missing() -> str | None:
    for tool in _SLURM_TOOLS:
        if shutil.which(tool) is None and not os.path.exists(f"/usr/sbin/{tool}"):
            return f"'{tool}' is not installed (apt-get install slurm-wlm munge; .ci/run does)"
    if os.geteuid() != 0:
        return "slurmd must run as root to start job steps"
    return None


def _daemon(directory, name: str, command: list[str], env) -> subprocess.Popen:
    # In the foreground (-D, --foreground) each daemon logs to stderr: DIR/NAME.out.
    tool = shutil.which(command[0]) or f"/usr/sbin/{command[0]}"
    with open(directory / f"{name}.out", "w") as out:
        return subprocess.Popen([tool, *command[1:]], stdout=out, stderr=out, env=env)


def _wait_for_path(path, proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    # The SLURM daemons authenticate through munged's socket from their first message on.
    deadline = time.monotonic() + timeout_s
    while not path.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)


def _wait_for_idle_node(cluster: SlurmCluster, procs, directory) -> str | None:
    deadline = time.monotonic() + 30
    state = ""
    while time.monotonic() < deadline:
        for name, proc in procs.items():
            if proc.poll() is not None:
                text = (directory / f"{name}.out").read_text().strip()
                return f"{name} exited with code {proc.returncode}: {text[-500:]}"
        sinfo = ["sinfo", "-h", "-N", "-o", "%T", "-n", cluster.node]
        result = subprocess.run(sinfo, env=cluster.env, capture_output=True, text=True, timeout=10)
        state = (result.stdout + result.stderr).strip()
        if state == "idle":
            return None
        time.sleep(0.2)
    return f"node '{cluster.node}' is not idle after 30 s (sinfo: {state!r})"


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """munged, slurmctld and slurmd for a one-node cluster (this machine, 2 CPUs), each in the
    foreground with its files in a temporary directory; stopped at the end of the session."""
    reason = _slurm_missing()
    if reason:
        pytest.skip(f"SLURM tests need a one-node cluster: {reason}")
    directory = tmp_path_factory.mktemp("slurm")
    directory.chmod(0o700)  # munged refuses a socket directory others can write to
    for sub in ("state", "spool"):
        (directory / sub).mkdir()
    # slurmd finds its node by the short host name, and so does SLURMD_NODENAME.
    node = socket.gethostname().split(".")[0]
    ports = {"ctld_port": find_free_port(), "slurmd_port": find_free_port()}
    config = write(directory, "slurm.conf", SLURM_CONFIG.format(node=node, dir=directory, **ports))
    cluster = SlurmCluster(node, runner_environment(SLURM_CONF=config))
    key = str(directory / "munge.key")
    subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True, timeout=30)
    munged = ["munged", "--foreground", "--force", f"--key-file={key}"]
    munged += [f"--socket={directory}/munge.socket", f"--pid-file={directory}/munged.pid"]
    munged += [f"--log-file={directory}/munged.log", f"--seed-file={directory}/munged.seed"]
    procs = {"munged": _daemon(directory, "munged", munged, cluster.env)}
    _wait_for_path(directory / "munge.socket", procs["munged"])
    procs["slurmctld"] = _daemon(directory, "slurmctld", ["slurmctld", "-D", "-i"], cluster.env)
    procs["slurmd"] = _daemon(directory, "slurmd", ["slurmd", "-D", "-N", node], cluster.env)
    reason = _wait_for_idle_node(cluster, procs, directory)
    if not reason:
        yield cluster
    for proc in reversed(procs.values()):
        proc.terminate()
    for proc in procs.values():
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if reason:
        pytest.skip(f"SLURM tests need a one-node cluster: {reason}")
