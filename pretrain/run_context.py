"""What every stage of one run shares: the process's distributed environment, the run dir and
its resolved config, the layer backend, the metrics sink, and the run's signal and fault state."""

from __future__ import annotations

import os
from dataclasses import dataclass

from parallel.initialize import DistEnv
from pretrain.reliability.faults import NonFinitePolicy, PreemptionSignal
from pretrain.reporting.metrics import MetricsSink


@dataclass
class RunContext:
    env: DistEnv
    run_dir: str
    config_yaml: str
    backend: str  #: model layer backend (local | te)
    sink: MetricsSink
    preemption: PreemptionSignal
    nonfinite: NonFinitePolicy
    preempted: bool = False  #: a signal stopped the run (after a checkpoint of the current step)

    @property
    def ckpt_dir(self) -> str:
        return os.path.join(self.run_dir, "checkpoints")
