"""Correctness and resource fixes to megatron-core 0.19.2, installed on every backend (CPU and
GPU) by :func:`install`, before any model or optimizer is built."""

from __future__ import annotations

import contextlib
import functools
import os
import queue

import torch

from parallel.megatron_compat import bucket_writes, distrib_optimizer, micro_batch, mtp
from parallel.megatron_compat.version import check_megatron_core

_INSTALLED = False


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


def reset_loss_trackers() -> None:
    """Drop megatron's process-global per-layer loss trackers (MoE aux losses, the DSA indexer
    KL, MTP). ``clear_aux_losses_tracker`` zeroes their values and keeps their entries: the
    next model in the process (a curriculum's next stage, HF evaluation) would report a tracker
    it never filled -- a dense stage after a DSA one logged ``indexer_kl`` 0.0 -- and entries
    are sized by the model that made them."""
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    destroy_moe_metrics_tracker()  # the next record() makes a new, empty one
    MTPLossLoggingHelper.tracker.clear()


def _replicated_mla_down_projections_without_transformer_engine() -> None:
    """megatron-core 0.19 builds MLA's q and kv down-projections from the classes it knows:
    ``TELinear`` (duplicated across TP), ``Linear`` (modelopt's replicated one) or a
    column-parallel layer; without Transformer Engine it sets ``Linear`` to None, so only the
    column-parallel layer is left. A column-parallel down-projection loses the other TP ranks'
    share of the k_rope gradient (MLA gathers k_rope along the hidden dim, whose backward is a
    split, not a sum), so the local spec keeps modelopt's replicated ``Linear``, as TE's
    duplicated ``TELinear`` does: the module-level name is set back to it. (0.16.1's TE probes,
    MLA's ``HAVE_TE`` and ``moe_utils``' ``te_general_gemm``, are fixed upstream: without TE
    0.19.2's ``HAVE_TE`` is False, ``TELinear`` and ``te_general_gemm`` are None.)"""
    from megatron.core.post_training.modelopt.layers import Linear
    from megatron.core.transformer import multi_latent_attention

    if multi_latent_attention.Linear is None:
        multi_latent_attention.Linear = Linear


def _in_process_checkpoint_write_results() -> None:
    """megatron's torch_dist writer hands its write results back through a queue served by a
    *spawned* multiprocessing Manager (``filesystem_async.get_write_results_queue``): a fresh
    interpreter per rank that re-imports the training entry point at the first save (5-10 s of
    CPU per rank). A synchronous save writes in this process (its forked per-file writers report
    through their own queue), so a plain in-process queue carries the results; an async save's
    writer process (``async_writer.SpawnedWriter``) sends its results back with its completion
    and they are put into this same queue."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


#: OSErrors of the rank-0-only writes of a save, held while :func:`deferred_rank_zero_writes` is on
_DEFERRED: list = []
_DEFERRING = [False]


@contextlib.contextmanager
def deferred_rank_zero_writes():
    """Around a save: the writes made on rank 0 alone (the ``.metadata`` of torch's writer,
    megatron's ``metadata.json``) keep their OSError (a full or read-only file system)
    for :func:`take_deferred_write_failure` instead of raising it. Raised where it happens, the
    error left the other ranks waiting for rank 0 in the save's next collective (the sharded
    write's planning, the failure broadcast of ``save_state_dict_async_finalize``, the barrier
    after ``save_config``): the run hung instead of stopping. The caller shares what rank 0
    kept with every rank (one all-reduce) and all of them raise together."""
    _DEFERRING[0] = True
    try:
        yield
    finally:
        _DEFERRING[0] = False


def take_deferred_write_failure() -> "OSError | None":
    """The first OSError a rank-0-only write kept (and forget them all), or None."""
    first = _DEFERRED[0] if _DEFERRED else None
    _DEFERRED.clear()
    return first


def _rank_zero_writes_defer_their_errors() -> None:
    """Wrap the two rank-0-only writes of a save for :func:`deferred_rank_zero_writes`."""
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    def deferring(write):
        if getattr(write, "_defers_errors", False):
            return write

        @functools.wraps(write)
        def write_or_keep_error(*args, **kwargs):
            try:
                return write(*args, **kwargs)
            except OSError as e:
                if not _DEFERRING[0]:
                    raise
                _DEFERRED.append(e)

        write_or_keep_error._defers_errors = True
        return write_or_keep_error

    FileSystemWriterAsync.finish = deferring(FileSystemWriterAsync.finish)
    serialization.save_config = deferring(serialization.save_config)


class StagingBuffers:
    """The host buffers a rank stages its checkpoint writes into: shared memory, so the spawned
    async writer (``async_writer.py``) receives them without a copy (torch's pickling moves a
    tensor that is not in shared memory there: a second staged copy), pinned on GPU ranks
    (``cudaHostRegister``) so the device-to-host copy runs at pinned speed. Kept and reused while
    the saves' tensors keep their shapes and dtypes (one save is in flight at a time, and every
    save of a stage has the same structure): the host memory a save needs is held from the first
    save on, and no save allocates, registers or maps it again. A save of another structure (a
    stage's final save, the next stage's layout) replaces them."""

    def __init__(self):
        self.signature: tuple = ()
        self.buffers: list = []

    def for_tensors(self, tensors: list) -> list:
        signature = tuple((tuple(t.shape), t.dtype) for t in tensors)
        if signature != self.signature:
            self.release()
            self.buffers = [self._allocate(shape, dtype) for shape, dtype in signature]
            self.signature = signature
        return self.buffers

    @staticmethod
    def _allocate(shape, dtype):
        buf = torch.empty(shape, dtype=dtype).share_memory_()
        if torch.cuda.is_available() and buf.numel():
            _check_cuda(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel() * buf.element_size(), 0))
        return buf

    def release(self) -> None:
        if torch.cuda.is_available():
            for buf in self.buffers:
                if buf.numel():
                    _check_cuda(torch.cuda.cudart().cudaHostUnregister(buf.data_ptr()))
        self.buffers, self.signature = [], ()


def _check_cuda(status) -> None:
    code = getattr(status, "value", status)
    if code:
        raise RuntimeError(f"cudaHostRegister/Unregister of a checkpoint staging buffer failed: CUDA error {code}")


STAGING = StagingBuffers()  #: this process's (every save of it goes through megatron's preload)


def _checkpoint_staging_into_shared_memory() -> None:
    """megatron's torch_dist writer stages what a rank writes to host memory before writing it
    (``FileSystemWriterAsync.preload_tensors``: ``tensor.to("cpu")``, for synchronous saves too),
    and an async save's writer then writes that copy while training changes the originals.
    Upstream, ``.to("cpu")`` allocates new host memory per save and is the tensor itself for one
    already on the host: on CPU ranks the writer read live training state (correct only through
    the copy-on-write of megatron's fork), and handing a staged tensor to a spawned writer would
    copy it again into shared memory. Here every tensor is copied into :data:`STAGING`'s
    shared-memory buffers (pinned on GPU ranks), on CPU and GPU ranks alike: a save stages one
    snapshot of what the rank writes, which the planner's ``host_ram_peak_gib`` counts."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    preload = FileSystemWriterAsync.preload_tensors

    @functools.wraps(preload)
    def preload_into_shared_memory(write_buckets, non_blocking=True):
        buffers = iter(STAGING.for_tensors([t for _, _, (_, tensors) in write_buckets for _, t in tensors]))
        staged = []
        for f, key, (data, tensors) in write_buckets:
            staged.append((f, key, (data, [(item, next(buffers).copy_(t.detach(), non_blocking=non_blocking))
                                           for item, t in tensors])))
        if non_blocking and torch.cuda.is_available():
            torch.cuda.synchronize()
        return staged

    FileSystemWriterAsync.preload_tensors = staticmethod(preload_into_shared_memory)


def _batched_p2p_pairs_same_peer_by_direction() -> None:
    """``p2p_communication._batched_p2p_ops`` (``batch_p2p_comm``, megatron-core's default)
    posts one exchange's operations as ``[send_prev, recv_prev, send_next, recv_next]`` on every
    rank. Point-to-point messages between two ranks pair in the order they were posted (NCCL's
    are tagless, gloo's all carry tag 0), so where a pipeline group has two ranks -- the previous
    rank is the next one -- an exchange with both directions (the interleaved schedule's
    ``send_forward_backward_recv_forward_backward``, from its first 1F1B step on) paired one
    rank's gradient for the previous stage with the other's receive of activations, and the
    reverse: from the first step's later micro-batches on, PP2 x VPP2 computed on the
    gradients as activations (and on activations as gradients), with no error (same shape).
    Sends are posted here as ``send_next, send_prev`` and receives as ``recv_prev, recv_next``
    on every rank: one rank's n-th send to the other is then the other's n-th receive from it,
    in the role it was sent in. With more than two ranks in the group the peers differ and the
    order changes nothing. (megatron-LM's training turns ``overlap_p2p_comm`` on for
    interleaving, whose unbatched ``_p2p_ops`` already post in this order; the shape exchange
    of ``variable_seq_lengths``, ``_communicate_shapes``, keeps the upstream order: unused here.)"""
    from megatron.core.pipeline_parallel import p2p_communication

    upstream = p2p_communication._batched_p2p_ops
    if getattr(upstream, "_pairs_by_direction", False):
        return
    P2POp, isend, irecv = torch.distributed.P2POp, torch.distributed.isend, torch.distributed.irecv

    @functools.wraps(upstream)
    def batched_p2p_ops(*, tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next,
                        group, prev_pipeline_rank, next_pipeline_rank):
        ops = [P2POp(op, tensor, peer, group) for op, tensor, peer in (
            (isend, tensor_send_next, next_pipeline_rank),
            (irecv, tensor_recv_prev, prev_pipeline_rank),
            (isend, tensor_send_prev, prev_pipeline_rank),
            (irecv, tensor_recv_next, next_pipeline_rank),
        ) if tensor is not None]
        return torch.distributed.batch_isend_irecv(ops) if ops else []

    batched_p2p_ops._pairs_by_direction = True
    p2p_communication._batched_p2p_ops = batched_p2p_ops


def install() -> None:
    """Install every fix once (idempotent); refuses another megatron-core release."""
    global _INSTALLED
    if _INSTALLED:
        return
    check_megatron_core(__file__, distrib_optimizer.__file__, mtp.__file__, micro_batch.__file__)
    _alltoall_dispatcher_drops_probs_after_combine()
    _replicated_mla_down_projections_without_transformer_engine()
    _in_process_checkpoint_write_results()
    bucket_writes.install()
    _rank_zero_writes_defer_their_errors()
    _checkpoint_staging_into_shared_memory()
    _batched_p2p_pairs_same_peer_by_direction()
    distrib_optimizer.install()
    mtp.install()
    micro_batch.install()
    _INSTALLED = True
