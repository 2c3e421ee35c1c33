"""megatron-core's multi-token prediction: the shifts of packed documents, the per-depth loss
count, and the one place a model changes the MTP block megatron built.

megatron-core 0.19 shifts each depth's labels and loss mask (``process_mtp_loss``, which
``GPTModel`` calls) and each depth's input ids, positions and padding mask
(``MultiTokenPredictionLayer``) with ``multi_token_prediction.roll_tensor``: :func:`install`
rebinds that one reference to :func:`roll_with_sequence_count`, which is
:func:`roll_within_documents` with the loss mask's count fixed.
"""

from __future__ import annotations

import torch

from parallel.megatron_compat import micro_batch

#: megatron's own roll_tensor, captured by :func:`install`
_UPSTREAM_ROLL: list = [None]


def roll_within_documents(tensor, shifts=-1, dims=-1, cp_group=None, packed_seq_params=None):
    """megatron's ``roll_tensor``, then zero where the next token is in another document of the
    micro-batch being computed (``micro_batch.MicroBatch.next_in_document``); the count is the
    kept positions'.

    megatron-core 0.19.2 keeps MTP inside documents only for THD ``packed_seq_params``; with
    document ids in the attention-mask slot its rolls carry the next document's tokens, labels
    and loss mask into the end of each document, so depth d at the last d tokens of a document
    was trained to predict the next document from the wrong context. Here every roll is followed
    by zeroing the positions whose successor starts another document -- what megatron's packed
    roll does per sequence -- so inputs, labels and loss mask of a packed sample equal those of
    its documents run one by one (context parallel ranks pick their zigzag positions)."""
    rolled, count = _UPSTREAM_ROLL[0](tensor, shifts=shifts, dims=dims, cp_group=cp_group,
                                      packed_seq_params=packed_seq_params)
    active = micro_batch.current()
    keep = None if active is None or packed_seq_params is not None else active.next_in_document
    if keep is None:
        return rolled, count
    assert shifts == -1 and rolled.shape == keep.shape, (shifts, rolled.shape, keep.shape)
    rolled = rolled * keep.to(rolled.dtype)
    return rolled, rolled.sum()


def roll_with_sequence_count(tensor, shifts=-1, dims=-1, cp_group=None, packed_seq_params=None):
    """megatron-core 0.19.2's ``process_mtp_loss`` divides each MTP depth's loss by the count this
    returns for the rolled loss mask (clamped to >= 1 there since 0.17; 0.16.1 divided 0/0 = NaN
    for a micro-batch without loss tokens at a depth, and the clamp here stays for that). On top
    of :func:`roll_within_documents`:

    - under context parallelism megatron returns this rank's count, so the CP-averaged loss is a
      mean of per-rank means, not the sequence mean: the count becomes the sequence's / cp,
      which makes the CP average exactly the one-rank mean (gradient and logged loss).
    """
    rolled, count = roll_within_documents(tensor, shifts=shifts, dims=dims, cp_group=cp_group,
                                          packed_seq_params=packed_seq_params)
    if not torch.is_tensor(count):
        return rolled, max(count, 1)
    if not tensor.is_floating_point():  # ids, positions, labels, padding: their count is unused
        return rolled, count
    cp = cp_group.size() if cp_group is not None and packed_seq_params is None else 1
    if cp > 1:
        count = count.detach().clone()
        torch.distributed.all_reduce(count, group=cp_group)
    return rolled, count.clamp(min=1) / cp if cp > 1 else count.clamp(min=1)


def install() -> None:
    """Rebind megatron's ``multi_token_prediction.roll_tensor`` (every MTP shift: ids, positions,
    padding, labels and loss mask of each depth)."""
    from megatron.core.transformer import multi_token_prediction

    if _UPSTREAM_ROLL[0] is None:
        _UPSTREAM_ROLL[0] = multi_token_prediction.roll_tensor
    multi_token_prediction.roll_tensor = roll_with_sequence_count


def set_mtp_block_class(model, block_class) -> None:
    """Give the MTP block ``GPTModel`` built another forward.

    megatron-core 0.19.2 has no extension point for the block: ``GPTModel.__init__`` constructs
    ``MultiTokenPredictionBlock`` by name (its ``mtp_block_spec`` contributes only the layer
    specs; a ``ModuleSpec`` naming a subclass is accepted and its module ignored). Building a
    second block would allocate its layer twice and draw other initial weights, so the built
    block's class is switched instead. ``block_class`` must subclass megatron's block and add no
    state (no ``__init__``): parameters, buffers and checkpoint keys stay megatron's."""
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock

    if not issubclass(block_class, MultiTokenPredictionBlock) or "__init__" in vars(block_class):
        raise TypeError(f"{block_class.__name__} must subclass MultiTokenPredictionBlock without "
                        "its own __init__ (it takes over a block megatron already built)")
    if type(model.mtp) is not MultiTokenPredictionBlock:
        raise TypeError(f"model.mtp is a {type(model.mtp).__name__}, not the "
                        "MultiTokenPredictionBlock megatron-core's GPTModel builds")
    model.mtp.__class__ = block_class


def config_with_mtp_depths(config, depths: int):
    """The model's own copy of its megatron config, counting ``depths`` MTP depths where the
    modules' config counts one MTP layer.

    megatron-core 0.19.2 reads ``mtp_num_layers`` as two things: the number of MTP layers (its
    validation -- the EP all-to-all overlap allows one --, the pipeline layout, the layers
    built, the per-layer schedule plans, all reading the layers' config) and, in
    ``GPTModel._postprocess`` alone (``process_mtp_loss``, handed ``GPTModel``'s config), the
    number of depths (the chunks of the MTP block's output, one loss each, the loss scale
    ``mtp_loss_scaling_factor / depths``). A model with one layer applied at several depths
    needs the two apart: the copy is ``GPTModel``'s ``self.config`` only, which elsewhere is
    read for ``mtp_num_layers`` as a flag (finalize_model_grads, the schedules' MTP loss scale,
    the embedding sync, the EP-overlap post-process node)."""
    import copy

    from parallel.megatron_compat.version import check_megatron_core

    check_megatron_core(__file__)
    if not config.mtp_num_layers == 1 <= depths:
        raise ValueError(f"one MTP layer applied at depths >= 1 (got mtp_num_layers="
                         f"{config.mtp_num_layers}, depths={depths})")
    model_config = copy.copy(config)
    model_config.mtp_num_layers = depths
    return model_config
