"""A real one-node Slurm cluster on this machine, for the Slurm end-to-end tests.

When a working Slurm is already reachable (``sinfo`` answers), it is used as it is. Otherwise
``slurm-wlm`` and ``munge`` are installed with apt (if missing) and a private cluster is started
under a scratch folder: ``munged`` on its own socket and key (so it never meets a system munge),
``slurmctld -D`` and ``slurmd -D`` with a generated ``slurm.conf`` (one node at 127.0.0.1 named
after this host, so ``scontrol show hostnames`` gives a resolvable master address). Every client
command finds it through ``SLURM_CONF`` in :attr:`SlurmCluster.env`. Teardown cancels our jobs
first (slurmd must outlive them) and then stops the daemons by the PIDs we started.

Everything is time-bounded; any failure raises :class:`SlurmSetupError` with the daemon logs.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from typing import Optional

from parallel.initialize import free_port

PACKAGES = ["slurm-wlm", "munge"]
DAEMONS = ["slurmctld", "slurmd", "munged"]
CLIENTS = ["sbatch", "srun", "scontrol", "squeue", "scancel", "sinfo"]


class SlurmSetupError(RuntimeError):
    """The cluster could not be brought up; the message says which step and why."""


class SlurmUnavailable(RuntimeError):
    """This platform cannot have Slurm (no apt); the tests skip with this reason."""


def _run(cmd: list[str], timeout: float, env: Optional[dict] = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def install_packages(timeout: float = 900) -> None:
    """apt-get install slurm-wlm munge when a daemon binary is missing."""
    if all(shutil.which(d) for d in DAEMONS + CLIENTS):
        return
    if shutil.which("apt-get") is None:
        raise SlurmUnavailable("Slurm is not installed and this platform has no apt-get to install it")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", *PACKAGES]):
        try:
            proc = _run(cmd, timeout, env)
        except subprocess.TimeoutExpired:
            raise SlurmSetupError(f"`{' '.join(cmd)}` did not finish in {timeout:.0f} s")
        if proc.returncode != 0:
            raise SlurmSetupError(f"`{' '.join(cmd)}` failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    missing = [d for d in DAEMONS + CLIENTS if shutil.which(d) is None]
    if missing:
        raise SlurmSetupError(f"{PACKAGES} installed but {missing} are still not on PATH")


def _existing_cluster_env() -> Optional[dict]:
    """os.environ when a configured Slurm answers ``sinfo`` within a few seconds."""
    if shutil.which("sinfo") is None or shutil.which("sbatch") is None:
        return None
    try:
        ok = _run(["sinfo", "-h", "-o", "%T"], timeout=10).returncode == 0
    except subprocess.TimeoutExpired:
        return None
    return dict(os.environ) if ok else None


SLURM_CONF = """\
ClusterName=glm5test
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket},cred_expire=10
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
SchedulerType=sched/backfill
MpiDefault=none
JobRequeue=1
ReturnToService=2
MinJobAge=3600
MailProg=/bin/true
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


class SlurmCluster:
    """Client side of a Slurm cluster: ``env`` for every command, ``sbatch``, job polling."""

    def __init__(self, env: dict, root: Optional[str] = None, procs: Optional[dict] = None):
        self.env = env
        self.root = root
        self.procs = procs or {}  #: daemon name -> Popen (only for a cluster we started)
        self.socket_dir = None

    # --- set-up and teardown ------------------------------------------------------------------

    @classmethod
    def start(cls, root: str, cpus: int = 4, timeout: float = 60) -> "SlurmCluster":
        """Use a running Slurm, or install and start a private one under ``root``."""
        env = _existing_cluster_env()
        if env is not None:
            return cls(env)
        install_packages()
        os.makedirs(root, exist_ok=True)
        host = socket.gethostname()
        # munged wants every folder above its socket searchable by all (pytest's tmp is 0700)
        socket_dir = tempfile.mkdtemp(prefix="glm5-munge-")
        os.chmod(socket_dir, 0o755)
        munge_socket = os.path.join(socket_dir, "munge.socket")
        conf = os.path.join(root, "slurm.conf")
        for sub in ("state", "spool"):
            os.makedirs(os.path.join(root, sub), exist_ok=True)
        with open(conf, "w") as f:
            f.write(SLURM_CONF.format(host=host, root=root, cpus=cpus, munge_socket=munge_socket,
                                      ctld_port=free_port(), slurmd_port=free_port()))
        env = {**os.environ, "SLURM_CONF": conf}
        cluster = cls(env, root, {})
        cluster.socket_dir = socket_dir
        try:
            cluster._start_munge(munge_socket)
            cluster._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", conf])
            cluster._spawn("slurmd", ["slurmd", "-D", "-N", host, "-f", conf])
            cluster._wait_idle(timeout)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _start_munge(self, munge_socket: str) -> None:
        key = os.path.join(self.root, "munge.key")
        if not os.path.exists(key):
            with open(key, "wb") as f:
                f.write(os.urandom(1024))
            os.chmod(key, 0o400)
        self._spawn("munged", ["munged", "-F", f"--socket={munge_socket}", f"--key-file={key}",
                               f"--pid-file={self.root}/munged.pid", f"--seed-file={self.root}/munged.seed",
                               f"--log-file={self.root}/munged.log"])
        deadline = time.time() + 15
        while not os.path.exists(munge_socket):
            if time.time() > deadline or self.procs["munged"].poll() is not None:
                raise SlurmSetupError("munged did not create its socket:\n" + self.logs())
            time.sleep(0.1)

    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(os.path.join(self.root, f"{name}.out"), "w")
        self.procs[name] = subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)

    def _wait_idle(self, timeout: float) -> None:
        deadline = time.time() + timeout
        state = ""
        while time.time() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise SlurmSetupError(f"{name} exited with {proc.returncode}:\n" + self.logs())
            try:
                out = _run(["sinfo", "-h", "-o", "%T"], timeout=10, env=self.env)
                state = out.stdout.strip() or out.stderr.strip()
            except subprocess.TimeoutExpired:
                state = "sinfo timed out"
            if state == "idle":
                return
            time.sleep(0.5)
        raise SlurmSetupError(f"node not idle after {timeout:.0f} s (last state {state!r}):\n" + self.logs())

    def logs(self) -> str:
        if not self.root:
            return ""
        parts = []
        for name in ("munged.out", "munged.log", "slurmctld.out", "slurmctld.log", "slurmd.out", "slurmd.log"):
            path = os.path.join(self.root, name)
            if os.path.exists(path):
                with open(path, errors="replace") as f:
                    parts.append(f"--- {name}\n{f.read()[-2000:]}")
        return "\n".join(parts)

    def stop(self) -> None:
        """Cancel our jobs, then stop slurmd, slurmctld and munged by PID (only ours)."""
        if not self.procs:
            return
        if self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None:
            try:
                _run(["scancel", "--full", "--user", "root"], timeout=15, env=self.env)
                self._wait_no_jobs(30)
            except subprocess.TimeoutExpired:
                pass
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        self.procs = {}
        if self.socket_dir:
            shutil.rmtree(self.socket_dir, ignore_errors=True)

    def _wait_no_jobs(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            out = _run(["squeue", "-h", "-o", "%i"], timeout=10, env=self.env)
            if out.returncode == 0 and not out.stdout.strip():
                return
            time.sleep(0.5)

    # --- jobs -----------------------------------------------------------------------------------

    def sbatch(self, args: list[str], env: Optional[dict] = None, cwd: Optional[str] = None) -> str:
        """Submit; returns the job id."""
        proc = subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True,
                              timeout=30, cwd=cwd, env={**self.env, **(env or {})})
        if proc.returncode != 0:
            raise AssertionError(f"sbatch failed ({proc.returncode}): {proc.stderr}")
        return proc.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict:
        """``scontrol show job`` as a dict (JobState, Restarts, ExitCode, ...). Retries for up
        to 60 s: on a loaded machine slurmctld sometimes drops an RPC."""
        deadline = time.time() + 60
        while True:
            try:
                out = _run(["scontrol", "show", "job", "-o", job_id], timeout=15, env=self.env)
                if out.returncode == 0 and "JobState=" in out.stdout:
                    return dict(re.findall(r"(\w+)=(\S*)", out.stdout))
                why = f"exit {out.returncode}: {out.stderr.strip()}"
            except subprocess.TimeoutExpired:
                why = "timed out"
            if time.time() > deadline:
                raise AssertionError(f"scontrol show job {job_id} failed ({why})")
            time.sleep(1)

    def wait(self, job_id: str, timeout: float, until=("COMPLETED", "FAILED", "CANCELLED",
                                                       "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")) -> dict:
        """Poll until the job reaches one of ``until``; returns its last record."""
        deadline = time.time() + timeout
        info = {}
        while time.time() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in until:
                return info
            time.sleep(0.5)
        raise AssertionError(f"job {job_id} not in {until} after {timeout:.0f} s: {info}")

    def signal_batch(self, job_id: str, sig: str = "USR1") -> None:
        proc = _run(["scancel", f"--signal={sig}", "--batch", job_id], timeout=15, env=self.env)
        if proc.returncode != 0:
            raise AssertionError(f"scancel --signal={sig} --batch {job_id} failed: {proc.stderr}")
