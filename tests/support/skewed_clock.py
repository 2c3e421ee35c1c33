"""Run ``pretrain.train`` with one rank's stage clock running 10^9 times faster than the others'.

    python -m tests.support.skewed_clock --rank=1 [hydra overrides]

``checkpoint.save_every_minutes`` is decided by the clock of the stage loop
(``pretrain.stage_loop.time.monotonic``). Here the given rank's clock passes an hour every 3.6 microseconds,
so by its own clock a save is due after every step; the others' clocks are untouched. The training code has no hook for it.
"""

from __future__ import annotations

from parallel.megatron_compat import bootstrap

bootstrap()  # before megatron-core's first import

import os
import runpy
import sys
import time
from types import SimpleNamespace

FLAG = "--rank="
FASTER = 1e9


def main() -> None:
    if len(sys.argv) < 2 or not sys.argv[1].startswith(FLAG):
        raise SystemExit(f"usage: python -m {__name__} {FLAG}N [hydra overrides]")
    rank = int(sys.argv[1][len(FLAG):])
    del sys.argv[1]  # the rest is Hydra's
    if int(os.environ.get("RANK", "0")) == rank:
        from pretrain import stage_loop

        stage_loop.time = SimpleNamespace(monotonic=lambda: time.monotonic() * FASTER,
                                          perf_counter=time.perf_counter)
    runpy.run_module("pretrain.train", run_name="__main__")


if __name__ == "__main__":
    main()
