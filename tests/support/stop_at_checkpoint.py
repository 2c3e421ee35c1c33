"""Run ``pretrain.train`` so that every rank stops itself (SIGSTOP) right after a chosen checkpoint.

    python -m tests.support.stop_at_checkpoint --stop-after=iter_0000003 [hydra overrides]

A kill test must SIGKILL a run between one checkpoint and the next. Polling ``latest`` from the
test and killing when it names the checkpoint raced the run: on a busy machine the remaining steps
could finish before the poller looked. This launcher wraps ``checkpointing.state.save`` from
outside the pipeline: once a save of the named checkpoint has returned (files, manifest and
``latest`` written), the rank freezes, so the test's SIGKILL always lands between that checkpoint
and the next, whatever the load. The training code has no hook for it.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys

FLAG = "--stop-after="


def install(wanted: str) -> None:
    from checkpointing import state

    save = state.save

    def save_then_stop(*args, **kwargs):
        path = save(*args, **kwargs)
        if os.path.basename(os.path.normpath(str(path))) == wanted:
            os.kill(os.getpid(), signal.SIGSTOP)  # the test kills the frozen run
        return path

    state.save = save_then_stop


def main() -> None:
    if len(sys.argv) < 2 or not sys.argv[1].startswith(FLAG):
        raise SystemExit(f"usage: python -m {__name__} {FLAG}iter_<step:07d> [hydra overrides]")
    install(sys.argv[1][len(FLAG):])
    del sys.argv[1]  # the rest is Hydra's
    runpy.run_module("pretrain.train", run_name="__main__")


if __name__ == "__main__":
    main()
