"""``parallel.initialize.dist_env``: rank layout from torchrun, Slurm, or a single process; and
``first_slurm_host``'s node-list parsing. Independent of whether ``scontrol`` is installed."""

from __future__ import annotations

import socket
import subprocess

import pytest

from parallel import initialize
from parallel.initialize import DistEnv, dist_env, first_slurm_host


@pytest.fixture
def no_scontrol(monkeypatch):
    """Make ``scontrol`` look absent; record the calls that were attempted."""
    calls = []

    def run(cmd, *args, **kwargs):
        calls.append(cmd)
        raise FileNotFoundError(2, "No such file or directory", cmd[0])

    monkeypatch.setattr(initialize.subprocess, "run", run)
    return calls


# --- torchrun ---------------------------------------------------------------------------------


def test_torchrun_variables():
    env = dist_env(
        {
            "RANK": "5",
            "WORLD_SIZE": "8",
            "LOCAL_RANK": "1",
            "MASTER_ADDR": "10.0.0.7",
            "MASTER_PORT": "29611",
        }
    )
    assert env == DistEnv(
        rank=5, world_size=8, local_rank=1, master_addr="10.0.0.7", master_port=29611, launcher="torchrun"
    )


def test_torchrun_defaults_for_optional_variables():
    env = dist_env({"RANK": "0", "WORLD_SIZE": "2"})
    assert env == DistEnv(0, 2, 0, "127.0.0.1", 29500, "torchrun")


def test_torchrun_wins_over_slurm(no_scontrol):
    """torchrun started under srun: torchrun's per-process ranks are the real ones."""
    env = dist_env(
        {
            "RANK": "3",
            "WORLD_SIZE": "4",
            "LOCAL_RANK": "3",
            "MASTER_ADDR": "host-a",
            "MASTER_PORT": "1234",
            "SLURM_PROCID": "0",
            "SLURM_NTASKS": "1",
            "SLURM_LOCALID": "0",
            "SLURM_JOB_NODELIST": "node[001-002]",
            "SLURM_JOB_ID": "777",
        }
    )
    assert env == DistEnv(3, 4, 3, "host-a", 1234, "torchrun")
    assert no_scontrol == []


# --- Slurm -------------------------------------------------------------------------------------


SLURM = {
    "SLURM_PROCID": "9",
    "SLURM_NTASKS": "16",
    "SLURM_LOCALID": "1",
    "SLURM_JOB_NODELIST": "gpu[017-020,033]",
    "SLURM_JOB_ID": "123456",
}


def test_slurm_variables(no_scontrol):
    env = dist_env(dict(SLURM))
    assert env.rank == 9
    assert env.world_size == 16
    assert env.local_rank == 1
    assert env.master_addr == "gpu017"
    assert env.master_port == 20000 + 123456 % 20000 == 23456
    assert env.launcher == "slurm"


def test_slurm_port_is_the_same_on_every_rank_and_differs_between_jobs(no_scontrol):
    ports = {dist_env({**SLURM, "SLURM_PROCID": str(r)}).master_port for r in range(16)}
    assert ports == {23456}
    assert dist_env({**SLURM, "SLURM_JOB_ID": "123457"}).master_port == 23457
    for job in (0, 19999, 20000, 987654321):
        port = dist_env({**SLURM, "SLURM_JOB_ID": str(job)}).master_port
        assert 20000 <= port < 40000


def test_slurm_step_nodelist_wins_over_job_nodelist(no_scontrol):
    env = dist_env({**SLURM, "SLURM_STEP_NODELIST": "cpu[5-6]"})
    assert env.master_addr == "cpu5"


def test_slurm_explicit_master_addr_and_port(no_scontrol):
    env = dist_env({**SLURM, "MASTER_ADDR": "login1", "MASTER_PORT": "31000"})
    assert env.master_addr == "login1"
    assert env.master_port == 31000
    assert no_scontrol == [], "no node-list lookup when MASTER_ADDR is given"


def test_slurm_defaults_for_optional_variables(no_scontrol):
    env = dist_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"})
    assert env == DistEnv(0, 1, 0, "127.0.0.1", 20000, "slurm")


def test_slurm_uses_scontrol_when_present(monkeypatch):
    def run(cmd, *args, **kwargs):
        assert cmd == ["scontrol", "show", "hostnames", "gpu[017-020,033]"]
        return subprocess.CompletedProcess(cmd, 0, stdout="gpu017.cluster\ngpu018.cluster\n", stderr="")

    monkeypatch.setattr(initialize.subprocess, "run", run)
    assert dist_env(dict(SLURM)).master_addr == "gpu017.cluster"


# --- single process -----------------------------------------------------------------------------


def test_single_process_fallback():
    env = dist_env({})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.launcher) == (
        0,
        1,
        0,
        "127.0.0.1",
        "single",
    )
    with socket.socket() as s:  # a free port: nothing listens there, so we can bind it
        s.bind(("127.0.0.1", env.master_port))


def test_single_process_honours_master_port():
    assert dist_env({"MASTER_PORT": "29999"}).master_port == 29999


@pytest.mark.parametrize(
    "partial",
    [{"RANK": "1"}, {"WORLD_SIZE": "4"}, {"SLURM_PROCID": "2"}, {"SLURM_NTASKS": "4"}],
)
def test_partial_launcher_variables_fall_back_to_single(partial):
    env = dist_env({**partial, "MASTER_PORT": "29999"})
    assert env == DistEnv(0, 1, 0, "127.0.0.1", 29999, "single")


def test_reads_os_environ_by_default(monkeypatch):
    for var in ("SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29512")
    assert dist_env() == DistEnv(2, 3, 0, "127.0.0.1", 29512, "torchrun")


# --- first_slurm_host -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "nodelist, host",
    [
        ("node[003-010,012],other", "node003"),
        ("gpu-a17", "gpu-a17"),
        ("n[1,5]", "n1"),
        ("n[7-9]", "n7"),
        ("alpha,beta", "alpha"),
        ("rack2-node[0042]", "rack2-node0042"),
    ],
)
def test_first_slurm_host_parsing(no_scontrol, nodelist, host):
    assert first_slurm_host(nodelist) == host
    assert no_scontrol == [["scontrol", "show", "hostnames", nodelist]]


@pytest.mark.parametrize("nodelist", ["", "[1-3]", ",node1"])
def test_first_slurm_host_rejects_unparsable(no_scontrol, nodelist):
    with pytest.raises(ValueError, match="cannot parse SLURM node list"):
        first_slurm_host(nodelist)


def test_first_slurm_host_falls_back_when_scontrol_fails(monkeypatch):
    monkeypatch.setattr(
        initialize.subprocess,
        "run",
        lambda cmd, *a, **k: subprocess.CompletedProcess(cmd, 1, stdout="", stderr="error"),
    )
    assert first_slurm_host("node[003-010]") == "node003"


def test_first_slurm_host_falls_back_when_scontrol_times_out(monkeypatch):
    def run(cmd, *args, **kwargs):
        raise subprocess.TimeoutExpired(cmd, kwargs.get("timeout", 10))

    monkeypatch.setattr(initialize.subprocess, "run", run)
    assert first_slurm_host("node[003-010]") == "node003"


def test_first_slurm_host_prefers_scontrol(monkeypatch):
    monkeypatch.setattr(
        initialize.subprocess,
        "run",
        lambda cmd, *a, **k: subprocess.CompletedProcess(cmd, 0, stdout="real-host-1\nreal-host-2\n", stderr=""),
    )
    assert first_slurm_host("node[003-010]") == "real-host-1"
