"""megatron-core's ``jit_fuser`` decorator made a plain one on machines without CUDA, before
megatron's modules apply it.

megatron decorates ~40 functions (SwiGLU, the router's expert-bias update, the dispatcher's
helpers, the fused cross-entropy pieces) with ``torch.compile`` as they are imported; the first
decoration imports dynamo and inductor, ~1.8 s of every CPU process's start (a tiny training
run's import goes from ~5 s to ~3 s). On CPU ranks those functions run eagerly anyway
(``cpu_emulation``'s ``force_eager`` stance: their fusion is a GPU optimisation), so the plain
decorator changes no result, only the start. With CUDA, megatron's ``torch.compile`` stays.

The decorator is bound when ``megatron.core.jit`` is first imported, so :func:`install` has to run
before megatron's first import: ``parallel.megatron_compat.bootstrap``, which each entry point
calls before its other imports. Where megatron came in earlier, nothing changes (the stance still
keeps the functions eager).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

JIT = "megatron.core.jit"
#: megatron modules that apply a bare ``torch.compile`` at import (0.19's inference-only
#: ``InferenceTopKRouter._compiled_topk_routing``): on CPU it is applied as a plain decorator
COMPILING_AT_IMPORT = ("megatron.core.transformer.moe.router",)


class _PlainJitFuserFinder(importlib.abc.MetaPathFinder):
    """Finds ``megatron.core.jit`` and :data:`COMPILING_AT_IMPORT` as the normal import system
    does, and runs them without ``torch.compile``: ``jit``'s decorator is switched off right after
    the module has run (before any module imports the name from it), the others run with
    ``torch.compile`` a plain decorator."""

    def __init__(self):
        self.pending = {JIT, *COMPILING_AT_IMPORT}

    def find_spec(self, name, path, target=None):
        if name not in self.pending:
            return None
        self.pending.discard(name)  # each is imported once per process
        if not self.pending:
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not _plain_without_cuda():
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module):
            if name == JIT:
                run_module(module)
                module.disable_jit_fuser()
                return
            import torch

            compile_ = torch.compile
            torch.compile = _plain_compile
            try:
                run_module(module)
            finally:
                torch.compile = compile_

        spec.loader.exec_module = exec_module
        return spec


def _plain_compile(fn=None, **_):
    return fn if fn is not None else (lambda f: f)


def _plain_without_cuda() -> bool:
    """No CUDA and the megatron-core release these hooks were written for (another release may
    bind its decorators differently: leave it, cpu_emulation refuses it)."""
    import torch

    from parallel.megatron_compat.version import MEGATRON_CORE_VERSION, installed_release

    return not torch.cuda.is_available() and installed_release() == MEGATRON_CORE_VERSION


def install() -> bool:
    """Make megatron's ``jit_fuser`` and import-time ``torch.compile`` plain on a machine without
    CUDA. Returns False when it is too late (megatron already imported) or done already."""
    if JIT in sys.modules or any(isinstance(f, _PlainJitFuserFinder) for f in sys.meta_path):
        return False
    sys.meta_path.insert(0, _PlainJitFuserFinder())
    return True
