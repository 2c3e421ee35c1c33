"""The micro-batch the model is computing: the one object through which modules deep inside
megatron-core's forward learn what megatron does not pass them.

megatron-core 0.19.2 hands a layer, from ``GPTModel.forward`` down to the core attention and the
MTP shifts, only what it knows: tensors (``attention_mask``, which its full recomputation saves
with ``save_for_backward``, so only a tensor travels there) and ``packed_seq_params`` (which
switches megatron to its THD code paths); MLA's ``core_attention_extra_kwargs`` carry only
megatron's own DSA inputs (``x``, ``qr``). Three things have no slot:

- the host copy of the document ids (the dense attention plans its blocks on the host; the data
  loader has them there, so no device sync is needed): :meth:`MicroBatch.host_document_ids`;
- where the next token is in the same document (the MTP shifts stay inside documents,
  ``mtp.py``): :attr:`MicroBatch.next_in_document`;
- what megatron's MLA computes on the way to q, k, v and the DSA core attention needs again,
  handed from one method of the layer call to the other across megatron's ``forward`` between
  them: :meth:`MicroBatch.hand_over` / :meth:`MicroBatch.take`.

So the model's forward receives the :class:`MicroBatch` explicitly (``GLM5Model.forward(...,
micro_batch=...)``; the training step makes one per micro-batch with the data loader's host ids)
and makes it the active one for its duration, in one ``with`` (:meth:`MicroBatch.active`); the
modules read it with :func:`current`. Passing it further explicitly would mean forking
megatron's block, layer and attention forwards, so this module is the one documented place
where it is ambient. Recomputation runs in backward, possibly after other micro-batches'
forwards (pipeline schedules): :func:`install` makes megatron's checkpoint functions (its own
``CheckpointFunction``, used by full and selective recomputation, and Transformer Engine's
``te_checkpoint``) run their function again under the micro-batch their forward ran under, and
megatron's selective recomputation of the core attention carry the hand-over to it as checkpoint
inputs. Layers called without ``GLM5Model`` (unit tests, benchmarks, megatron's stock
``GPTModel`` over this project's layer specs) run inside ``with MicroBatch(ids).active():``.

Checks: a model forward's ``attention_mask`` must be its micro-batch's document ids; the ids a
module asks the host copy for must be that tensor (or a detached alias or leading-key slice of
it); a micro-batch cannot become active inside another one; a hand-over must be taken before the
next one for the same receiver, and none may be left when the micro-batch's outermost ``with``
ends.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Optional

import torch

#: the active micro-batches, innermost last: one, or one re-entered by a recomputation. Not
#: thread-local: CUDA's autograd runs backward (and so recomputation) on its own device thread.
_ACTIVE: list = []


def current() -> Optional["MicroBatch"]:
    """The micro-batch being computed, or None outside any (a module called on its own)."""
    return _ACTIVE[-1] if _ACTIVE else None


class MicroBatch:
    """What the model's modules need to know about one micro-batch beyond what megatron passes.

    ``document_ids``: [b, L] the per-token document ids as the attention receives them in
    megatron's ``attention_mask`` slot (the whole sequence's under context parallelism), or
    None (one document per sample). ``host_document_ids``: their host copy when the caller has
    it (the data loader); otherwise one is made on first need (one device -> host copy)."""

    def __init__(self, document_ids: Optional[torch.Tensor] = None,
                 host_document_ids: Optional[torch.Tensor] = None):
        if host_document_ids is not None:
            if document_ids is None or host_document_ids.shape != document_ids.shape:
                raise ValueError(f"host document ids {tuple(host_document_ids.shape)} do not "
                                 f"match the device ones {_shape(document_ids)}")
        self.document_ids = document_ids
        self._host = host_document_ids
        self._version = None if document_ids is None else document_ids._version
        self._next_in_document = None
        self._handoffs: dict = {}
        self._depth = 0
        #: None, or where a frozen forward collects the gradients its modules computed at once
        #: (parameter -> gradient, summed over applications): the DSA warm-up runs the frozen
        #: network without autograd, each layer's indexer differentiates its own KL, and the
        #: model's output hands the gradients to backward (``dsa.modes.indexer_only_forward``)
        self.precomputed_grads: Optional[dict] = None

    def __repr__(self) -> str:
        return f"MicroBatch(document_ids={_shape(self.document_ids)})"

    # --- the one ``with`` ------------------------------------------------------------------------

    @contextlib.contextmanager
    def active(self):
        """This micro-batch is :func:`current` within the block (re-entered by recomputation).
        When its outermost block ends, pending hand-overs are dropped; a clean end with one left
        is an error (a receiver never ran)."""
        if _ACTIVE and _ACTIVE[-1] is not self:
            raise RuntimeError(f"{self!r} cannot become active inside {_ACTIVE[-1]!r}: one "
                               "micro-batch at a time")
        _ACTIVE.append(self)
        self._depth += 1
        try:
            yield self
        except BaseException:
            self._leave()
            raise
        left = self._leave()
        if left:
            raise RuntimeError(f"{self!r} ended with hand-overs nobody took: {left}")

    def _leave(self) -> list:
        assert _ACTIVE and _ACTIVE[-1] is self, "micro-batches left out of order"
        _ACTIVE.pop()
        self._depth -= 1
        if self._depth:
            return []
        left, self._handoffs = self._handoffs, {}
        return [type(receiver).__name__ for receiver in left]

    def bind(self, function):
        """``function`` that runs under this micro-batch wherever it is called (recomputation)."""

        @functools.wraps(function)
        def in_micro_batch(*args, **kwargs):
            with self.active():
                return function(*args, **kwargs)

        return in_micro_batch

    # --- the document ids ------------------------------------------------------------------------

    def host_document_ids(self, document_ids: torch.Tensor) -> torch.Tensor:
        """Host copy of ``document_ids`` [b, L'], which must be this micro-batch's ids as a module
        received them: the tensor itself, a detached alias of it (recomputation) or its leading
        L' <= L keys (the sparse mode's prefix), unmodified since the copy was made (else it is
        made again)."""
        held = self.document_ids
        if held is None or not _aliases(document_ids, held):
            raise RuntimeError(f"document ids {_shape(document_ids)} are not those of the active "
                               f"{self!r}: the model ran another micro-batch's")
        if self._host is None or held._version != self._version:
            self._host, self._version = held.cpu(), held._version
        keys = document_ids.shape[1]
        return self._host if keys == self._host.shape[1] else self._host[:, :keys]

    @property
    def next_in_document(self) -> Optional[torch.Tensor]:
        """[b, s_local] bool: token t and token t + 1 are in the same document (this context
        parallel rank's zigzag positions t); None without document ids. Made on first use."""
        if self.document_ids is None:
            return None
        if self._next_in_document is None:
            from parallel.context_parallel import cp_size, local_positions

            ids = self.document_ids
            keep = torch.zeros_like(ids, dtype=torch.bool)
            keep[:, :-1] = ids[:, 1:] == ids[:, :-1]
            pos = local_positions(ids.shape[1] // cp_size(), device=ids.device)
            self._next_in_document = keep if pos is None else keep[:, pos]
        return self._next_in_document

    # --- hand-overs within a layer call ----------------------------------------------------------

    def hand_over(self, receiver, value) -> None:
        """Leave ``value`` for ``receiver`` (a module) to :meth:`take` in this layer call. A
        value a recomputation must carry has ``tensors()`` and is rebuilt as
        ``type(value)(*tensors)`` (``install``'s core-attention recomputation)."""
        if receiver in self._handoffs:
            raise RuntimeError(f"{type(receiver).__name__} has not taken its previous hand-over "
                               f"in {self!r}")
        self._handoffs[receiver] = value

    def take(self, receiver):
        """The value handed over for ``receiver``, once; None if there is none."""
        return self._handoffs.pop(receiver, None)


def precomputed_grads() -> Optional[dict]:
    """The active micro-batch's :attr:`MicroBatch.precomputed_grads`, or None (none active, or
    it is not a frozen forward): where a module puts the gradients of a loss it would otherwise
    attach to its own output."""
    micro_batch = current()
    return None if micro_batch is None else micro_batch.precomputed_grads


def take(receiver):
    """:meth:`MicroBatch.take` from the active micro-batch; None outside any."""
    micro_batch = current()
    return None if micro_batch is None else micro_batch.take(receiver)


def host_document_ids(document_ids: torch.Tensor) -> torch.Tensor:
    """Host copy of ``document_ids`` from the active micro-batch (no copy when the data loader's
    was given); outside any micro-batch (a module called on its own) a device -> host copy."""
    micro_batch = current()
    return document_ids.cpu() if micro_batch is None else micro_batch.host_document_ids(document_ids)


def _aliases(t: torch.Tensor, held: torch.Tensor) -> bool:
    """``t`` is ``held`` or a view over the same memory with the same rows and at most its keys."""
    return (t.dim() == held.dim() == 2 and t.shape[0] == held.shape[0]
            and t.shape[1] <= held.shape[1] and t.dtype == held.dtype and t.device == held.device
            and t.untyped_storage().data_ptr() == held.untyped_storage().data_ptr()
            and t.storage_offset() == held.storage_offset() and t.stride() == held.stride())


def _shape(t) -> str:
    return "None" if t is None else str(tuple(t.shape))


# --- recomputation under its micro-batch -----------------------------------------------------------


def _checkpoint_function_in_its_micro_batch() -> None:
    """megatron's ``CheckpointFunction`` (``tensor_parallel.checkpoint``: full recomputation of
    layers and of the MTP layer, selective recomputation of the core attention and MoE) runs its
    function in forward and again in backward: both under the micro-batch active at forward."""
    from megatron.core.tensor_parallel.random import CheckpointFunction

    forward = CheckpointFunction.forward
    if getattr(forward, "_binds_micro_batch", False):
        return

    def forward_in_micro_batch(ctx, run_function, distribute_saved_activations, *args):
        micro_batch = current()
        if micro_batch is not None:
            run_function = micro_batch.bind(run_function)
        return forward(ctx, run_function, distribute_saved_activations, *args)

    forward_in_micro_batch._binds_micro_batch = True
    CheckpointFunction.forward = staticmethod(forward_in_micro_batch)


def bind_checkpoint(checkpoint):
    """A checkpoint function ``checkpoint(function, *args, **kwargs)`` whose ``function`` runs
    under the micro-batch active when it is called (Transformer Engine's ``te_checkpoint``)."""
    if getattr(checkpoint, "_binds_micro_batch", False):
        return checkpoint

    @functools.wraps(checkpoint)
    def checkpoint_in_micro_batch(function, *args, **kwargs):
        micro_batch = current()
        return checkpoint(function if micro_batch is None else micro_batch.bind(function),
                          *args, **kwargs)

    checkpoint_in_micro_batch._binds_micro_batch = True
    return checkpoint_in_micro_batch


def _te_checkpoint_in_its_micro_batch() -> None:
    """megatron calls Transformer Engine's checkpoint instead under fp8 (``te_checkpoint``, bound
    by name in the modules that import it at load -- 0.19's full-layer recompute lives in
    ``megatron.core.recompute`` --; the others import it when called)."""
    from megatron.core import recompute
    from megatron.core.extensions import transformer_engine
    from megatron.core.transformer.moe import moe_layer

    for module in (transformer_engine, recompute, moe_layer):
        if getattr(module, "te_checkpoint", None) is not None:
            module.te_checkpoint = bind_checkpoint(module.te_checkpoint)


def _core_attention_recompute_carries_handoffs() -> None:
    """megatron's selective recomputation of the core attention (``recompute_modules`` with
    ``core_attn``: ``Attention._checkpointed_attention_forward``) checkpoints q, k, v, the mask
    and the tensors of ``core_attention_extra_kwargs`` (0.19: megatron's own DSA gets its inputs
    that way), and calls the core attention without what was handed over to it (GLM-5's MLA
    intermediates: the latent, the kv up-projection's weight and outputs). Where the active
    micro-batch holds a hand-over for this layer's core attention, its tensors become checkpoint
    inputs too and are handed over again in the recomputation (which then gets this forward's
    values, and returns their gradients). Without one, megatron's method runs unchanged."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer.attention import Attention

    upstream = Attention._checkpointed_attention_forward
    if getattr(upstream, "_binds_micro_batch", False):
        return

    @functools.wraps(upstream)
    def checkpointed_attention_forward(self, query, key, value, attention_mask,
                                       rotary_pos_emb=None, attn_mask_type=None,
                                       attention_bias=None, packed_seq_params=None,
                                       core_attention_extra_kwargs=None):
        core, micro_batch = self.core_attention, current()
        handoff = None if micro_batch is None else micro_batch.take(core)
        if handoff is None:
            return upstream(self, query, key, value, attention_mask, rotary_pos_emb=rotary_pos_emb,
                            attn_mask_type=attn_mask_type, attention_bias=attention_bias,
                            packed_seq_params=packed_seq_params,
                            core_attention_extra_kwargs=core_attention_extra_kwargs)
        if core_attention_extra_kwargs:  # upstream's DSA inputs; GLM-5's core attention takes none
            raise ValueError(f"{type(core).__name__} got both a hand-over and core attention "
                             f"kwargs {sorted(core_attention_extra_kwargs)}")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type

        def run(query, key, value, attention_mask, *tensors):
            with micro_batch.active():
                micro_batch.hand_over(core, type(handoff)(*tensors))
                return core(query, key, value, attention_mask, attn_mask_type=mask_type,
                            attention_bias=attention_bias, packed_seq_params=packed_seq_params)

        return tensor_parallel.checkpoint(run, False, query, key, value, attention_mask,
                                          *handoff.tensors())

    checkpointed_attention_forward._binds_micro_batch = True
    Attention._checkpointed_attention_forward = checkpointed_attention_forward


def install() -> None:
    _checkpoint_function_in_its_micro_batch()
    _te_checkpoint_in_its_micro_batch()
    _core_attention_recompute_carries_handoffs()
