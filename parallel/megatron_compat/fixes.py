"""Correctness and resource fixes to megatron-core 0.16.1, installed on every backend."""

from __future__ import annotations

import functools

#: the megatron-core release these fixes were written against and tested with
MEGATRON_CORE_VERSION = "0.16.1"

_INSTALLED = False


def _check_version() -> None:
    from megatron.core import package_info

    if package_info.__version__ != MEGATRON_CORE_VERSION:
        raise RuntimeError(
            f"parallel.megatron_compat was written for megatron-core {MEGATRON_CORE_VERSION}, "
            f"found {package_info.__version__}: re-check each fix in {__file__} against it")


def _alltoall_dispatcher_drops_probs_after_combine() -> None:
    """``MoEAlltoAllTokenDispatcher.dispatch_preprocess`` keeps the micro-batch's routing
    probabilities (``self.probs``, with their autograd history) until the next forward. That
    history reaches every parameter's gradient accumulator, whose hooks close over megatron's
    DDP module: a reference cycle through autograd's C++ nodes that Python's collector cannot
    see, so a model once trained stayed alive with its grad buffers, optimizer and process
    groups for the life of the process (every finished curriculum stage, and on GPUs their
    device memory and NCCL communicators). ``self.probs`` is read only for its dtype in
    ``combine_preprocess``: drop it once the combine is done."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    combine_postprocess = MoEAlltoAllTokenDispatcher.combine_postprocess

    @functools.wraps(combine_postprocess)
    def combine_postprocess_dropping_probs(self, *args, **kwargs):
        try:
            return combine_postprocess(self, *args, **kwargs)
        finally:
            self.probs = None

    MoEAlltoAllTokenDispatcher.combine_postprocess = combine_postprocess_dropping_probs


def release_cached_modules() -> None:
    """Empty megatron's per-instance caches, which keep modules of a model that is gone alive.

    ``RotaryEmbedding.forward`` and ``YarnRotaryEmbedding.forward`` are ``functools.lru_cache``d
    methods: the cache is keyed on ``self`` and holds up to 32 embedding modules with their
    tables and their context-parallel process group, after the model that owned them was
    dropped (a curriculum stage change; the destroyed group's communicator threads stayed).
    """
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding

    for cls in (RotaryEmbedding, YarnRotaryEmbedding):
        cached = cls.__dict__.get("forward")
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()


def _te_probes_without_transformer_engine() -> None:
    """Without Transformer Engine, two megatron modules believe it is (half) present, on GPUs as
    on CPUs (the first GPU smoke on an H200 without TE failed here at model build):
    ``multi_latent_attention`` keeps ``HAVE_TE`` True while ``TELinear`` is None, so MLA's
    ``isinstance(self.linear_proj, TELinear)`` raises TypeError; ``moe_utils`` never defines
    ``te_general_gemm``, so the router's GEMM raises NameError."""
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.moe import moe_utils

    if not isinstance(multi_latent_attention.TELinear, type):  # None or a MagicMock stand-in
        multi_latent_attention.HAVE_TE = False
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def install() -> None:
    """Install every fix once (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    _check_version()
    _alltoall_dispatcher_drops_probs_after_combine()
    _te_probes_without_transformer_engine()
    _INSTALLED = True
