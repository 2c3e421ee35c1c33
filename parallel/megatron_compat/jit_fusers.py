"""megatron-core's ``jit_fuser`` decorator made a plain one on machines without CUDA, before
megatron's modules apply it.

megatron decorates ~40 functions (SwiGLU, the router's expert-bias update, the dispatcher's
helpers, the fused cross-entropy pieces) with ``torch.compile`` as they are imported; the first
decoration imports dynamo and inductor, ~1.8 s of every CPU process's start (a tiny training
run's import goes from ~5 s to ~3 s). On CPU ranks those functions run eagerly anyway
(``cpu_emulation``'s ``force_eager`` stance: their fusion is a GPU optimisation), so the plain
decorator changes no result, only the start. With CUDA, megatron's ``torch.compile`` stays.

The decorator is bound when ``megatron.core.jit`` is first imported, so :func:`install` has to run
before megatron's first import: ``parallel.megatron_compat`` calls it on import, and each package
whose modules import megatron imports ``parallel.megatron_compat`` first. Where megatron came in
earlier, nothing changes (the stance still keeps the functions eager).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

MODULE = "megatron.core.jit"


class _PlainJitFuserFinder(importlib.abc.MetaPathFinder):
    """Finds ``megatron.core.jit`` as the normal import system does, and switches its decorator
    off right after the module has run (before any module imports the name from it)."""

    def find_spec(self, name, path, target=None):
        if name != MODULE:
            return None
        sys.meta_path.remove(self)  # once: megatron.core.jit is imported once per process
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            _plain_without_cuda(module)

        spec.loader.exec_module = exec_module
        return spec


def _plain_without_cuda(jit) -> None:
    import torch

    from parallel.megatron_compat.version import MEGATRON_CORE_VERSION, installed_release

    # another release may bind the decorator differently: leave it (cpu_emulation refuses it)
    if not torch.cuda.is_available() and installed_release() == MEGATRON_CORE_VERSION:
        jit.disable_jit_fuser()


def install() -> bool:
    """Make megatron's ``jit_fuser`` plain when ``megatron.core.jit`` is imported, on a machine
    without CUDA. Returns False when it is too late (megatron already imported) or done already."""
    if MODULE in sys.modules or any(isinstance(f, _PlainJitFuserFinder) for f in sys.meta_path):
        return False
    sys.meta_path.insert(0, _PlainJitFuserFinder())
    return True
