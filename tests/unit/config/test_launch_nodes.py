"""What a launch decides before its process group (issue 38): whether it spans several nodes
(``parallel.initialize.spans_nodes``, from torchrun's or Slurm's variables: a launch over several
nodes only checks its data, one node builds what is missing), and ``parallel.timeout_minutes``,
the timeout ``init_process_group`` and every collective get -- validated with the field named."""

from __future__ import annotations

import math
from datetime import timedelta

import pytest

from parallel import initialize
from parallel.config import ParallelConfig
from parallel.initialize import DistEnv, process_group_timeout, spans_nodes
from pretrain.config.errors import ConfigError


@pytest.mark.parametrize("env, several", [
    ({}, False),  # one process
    ({"RANK": "0", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}, False),  # torchrun, one node
    ({"RANK": "3", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}, True),  # torchrun --nnodes 2
    ({"RANK": "0", "WORLD_SIZE": "16", "GROUP_WORLD_SIZE": "2"}, True),  # torchrun without LOCAL_WORLD_SIZE
    ({"RANK": "0", "WORLD_SIZE": "8", "GROUP_WORLD_SIZE": "1"}, False),
    ({"RANK": "0", "WORLD_SIZE": "1"}, False),
    ({"RANK": "0", "WORLD_SIZE": "4"}, True),  # a launcher that does not say where its ranks are
    # torchrun inside a multi-node Slurm job: torchrun's variables win, as in dist_env
    ({"RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8", "SLURM_PROCID": "0", "SLURM_NTASKS": "2",
      "SLURM_NNODES": "2"}, False),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_NODES": "1", "SLURM_NNODES": "4"}, False),
    ({"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_STEP_NUM_NODES": "2"}, True),
    ({"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_JOB_NUM_NODES": "2"}, True),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_NNODES": "1"}, False),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}, True),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, False),
    ({"SLURM_NNODES": "4"}, False),  # a job's batch shell, not one of its tasks: one process
])
def test_spans_nodes(env, several):
    assert spans_nodes(env) is several


def test_the_timeout_reaches_init_process_group(monkeypatch):
    seen = {}
    monkeypatch.setattr(initialize.megatron_compat, "install", lambda: None)
    monkeypatch.setattr(initialize.cpu_emulation, "install", lambda strict: None)
    monkeypatch.setattr(initialize.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(initialize.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(initialize.dist, "init_process_group", lambda **kw: seen.update(kw))
    initialize.start_process_group(DistEnv.one_process(), 45)
    assert seen["timeout"] == timedelta(minutes=45) and seen["backend"] == "gloo"
    initialize.start_process_group(DistEnv.one_process())
    assert seen["timeout"] == timedelta(minutes=30) == timedelta(minutes=ParallelConfig().timeout_minutes)

    # megatron's groups start it from the stage's parallel config
    called = {}

    def start(env, timeout_minutes, cpu_emulation_mode):
        called.update(timeout_minutes=timeout_minutes)
        raise RuntimeError("stop here")

    monkeypatch.setattr(initialize, "start_process_group", start)
    with pytest.raises(RuntimeError, match="stop here"):
        initialize.initialize(ParallelConfig(timeout_minutes=2.5), 1, DistEnv.one_process())
    assert called == {"timeout_minutes": 2.5}


def test_process_group_timeout():
    assert process_group_timeout(30) == timedelta(minutes=30)
    assert process_group_timeout(0.5) == timedelta(seconds=30)
    for bad in (0, -1, math.nan):
        with pytest.raises(ValueError, match="parallel.timeout_minutes"):
            process_group_timeout(bad)


def _validate(*overrides: str):
    from pretrain.config.validation import plan_run
    from pretrain.config.command_line import resolve
    from pretrain.config.schema import compose

    rc, _, changes = resolve(compose(list(overrides)), list(overrides))
    return rc, plan_run(rc, 1, changes, check_paths=False)


@pytest.mark.parametrize("value, shown", [("0", "0.0"), ("-5", "-5.0"), ("nan", "nan"), ("inf", "inf")])
def test_a_bad_timeout_is_refused_naming_the_field(value, shown):
    with pytest.raises(ConfigError) as e:
        _validate(f"parallel.timeout_minutes={value}", "curriculum=none")
    assert e.value.problems == [f"parallel.timeout_minutes={shown} must be a finite number of minutes > 0"]


def test_the_timeout_is_the_run_s_not_a_stage_s():
    rc, stages = _validate("parallel.timeout_minutes=90")
    assert rc.parallel.timeout_minutes == 90 and {st.rc.parallel.timeout_minutes for st in stages} == {90}
    with pytest.raises(ConfigError) as e:
        _validate("+parallel.stages.extend_256={timeout_minutes: 5}")
    assert e.value.problems == ["parallel.stages.extend_256.timeout_minutes: one timeout serves the whole run "
                                "(set parallel.timeout_minutes)"]
