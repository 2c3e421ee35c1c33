"""Run ``pretrain.train`` with its sample-index build held, so a test can signal it mid-build.

    python -m tests.support.hold_data_build --marker=PATH [hydra overrides]

The index build that a one-node launch does before its ranks start (``data_pipeline.build``'s
``_build_mixture``, inside the run dir's ``.locks/`` file lock) first creates ``PATH``, then
sleeps for :data:`HOLD_S` before building as usual: the test sends its signal once ``PATH``
exists, so the signal always lands inside the build however busy the machine. The training code
has no hook for this.
"""

from __future__ import annotations

from parallel.megatron_compat import bootstrap

bootstrap()  # before megatron-core's first import

import runpy
import sys
import time

FLAG = "--marker="
HOLD_S = 90.0  #: a run that ignores the signal builds, trains and ends after this


def install(marker: str) -> None:
    import torch.distributed as dist

    from data_pipeline import build

    real = build._build_mixture

    def held(*args, **kwargs):
        if not dist.is_initialized():  # the build before the ranks start
            open(marker, "w").close()
            time.sleep(HOLD_S)
        return real(*args, **kwargs)

    build._build_mixture = held


def main() -> None:
    if len(sys.argv) < 2 or not sys.argv[1].startswith(FLAG):
        raise SystemExit(f"usage: python -m {__name__} {FLAG}PATH [hydra overrides]")
    install(sys.argv[1][len(FLAG):])
    del sys.argv[1]  # the rest is Hydra's
    runpy.run_module("pretrain.train", run_name="__main__")


if __name__ == "__main__":
    main()
