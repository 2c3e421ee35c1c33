"""A training launch run inside the test process, and what it leaves there put back: for the
tests of launches that stop before training (``tests/unit/run/``)."""

from __future__ import annotations

import contextlib
import os
import signal


def tree(root) -> dict:
    """Every path under ``root`` -> (bytes, mtime_ns) (folders: None, mtime)."""
    out = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            st = os.stat(path)
            out[os.path.relpath(path, root)] = (None if name in dirs else st.st_size, st.st_mtime_ns)
    return out


@contextlib.contextmanager
def leftovers_put_back():
    """Around launches in this process: afterwards their log routing is closed, the SIGTERM and
    SIGUSR1 handlers are the ones from before, and a process group they started is gone."""
    import torch.distributed as dist

    from pretrain.reporting import logs

    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        yield
    finally:
        if logs._active is not None:
            logs._active.close()
        for s, h in handlers.items():
            signal.signal(s, h)
        if dist.is_initialized():
            from parallel.initialize import destroy_model_parallel_groups

            destroy_model_parallel_groups()
            dist.destroy_process_group()
