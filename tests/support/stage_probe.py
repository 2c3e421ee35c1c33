"""``python -m tests.support.stage_probe [overrides]``: the training entry point with an
observer around each curriculum stage (from outside: the stage engine knows nothing of it).

At each stage's start it records, per rank, the process's native thread count, the number of
registered process groups and which of the previous stages' model chunks and optimizers are still
alive (weak references); after megatron's groups are (re)built, the name torch gave this
layout's tensor-parallel group. Written to ``<run_dir>/stage_probe.rank<r>.json``.
"""

from parallel.megatron_compat import bootstrap

bootstrap()  # before megatron-core's first import

import gc
import json
import os
import runpy
import sys
import weakref

import torch.distributed as dist

import model_providers.glm5.model.provider as provider
import parallel.initialize as initialize
import pretrain.optim as optim
import pretrain.stage as stage

_objects: list = []  # (stage name, kind, weak reference)
_records: list = []
_current = {"stage": None}


def _native_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _track(kind):
    def wrap(build):
        def tracked(*args, **kwargs):
            built = build(*args, **kwargs)
            for obj in built if isinstance(built, list) else [built]:
                _objects.append((_current["stage"], kind, weakref.ref(obj)))
            return built
        return tracked
    return wrap


def _observe_initialize(init):
    def observed(*args, **kwargs):
        env = init(*args, **kwargs)
        from megatron.core import parallel_state
        group = parallel_state.get_tensor_model_parallel_group()
        _records[-1]["tp_group"] = dist.distributed_c10d._world.pg_names[group]
        return env
    return observed


def _observe_stage(run_stage):
    def observed(st, *args, **kwargs):
        gc.collect()
        alive = sorted({f"{name}:{kind}" for name, kind, ref in _objects if ref() is not None})
        _records.append({"stage": st.name, "threads": _native_threads(),
                         "groups": len(dist.distributed_c10d._world.pg_map), "alive": alive})
        _current["stage"] = st.name
        return run_stage(st, *args, **kwargs)
    return observed


def main() -> None:
    provider.build_model_chunks = _track("model")(provider.build_model_chunks)
    optim.build_optimizer = _track("optimizer")(optim.build_optimizer)
    initialize.initialize = _observe_initialize(initialize.initialize)
    stage.run_stage = _observe_stage(stage.run_stage)
    run_dir = next(a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("trainer.run_dir="))
    try:
        runpy.run_module("pretrain.train", run_name="__main__")
    finally:
        rank = int(os.environ.get("RANK", 0))
        with open(os.path.join(run_dir, f"stage_probe.rank{rank}.json"), "w") as f:
            json.dump(_records, f)


if __name__ == "__main__":
    main()
