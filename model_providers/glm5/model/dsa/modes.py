"""Which parameters train in each DSA mode, and the warm-up's frozen forward."""

from __future__ import annotations

import torch

INDEXER_TAG = ".indexer."


def is_indexer_param(name: str) -> bool:
    return INDEXER_TAG in f".{name}"


def apply_dsa_mode(model_chunks, tcfg, mode: str) -> None:
    """none: everything trains (the model has no indexer); dense: everything but the indexer trains (it is not computed); warmup: only the indexer
    trains (the aux-loss-free expert bias is held: its update rate is 0, so nothing else changes); sparse:
    everything trains. Call before DDP wrapping and optimizer construction."""
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            indexer = is_indexer_param(name)
            param.requires_grad = {"none": True, "dense": not indexer, "warmup": indexer,
                                   "sparse": True}[mode]
    for chunk in model_chunks:  # GLM5Model runs the frozen network without autograd
        chunk.indexer_only = mode == "warmup"
    if mode == "warmup":  # routing still counts tokens (load-balance metrics), the bias holds
        tcfg.moe_router_bias_update_rate = 0.0


def indexer_only_forward(micro_batch, forward, stage_input=None):
    """``forward()`` as the DSA warm-up runs it: only the indexers train, on inputs they read
    detached, so the network runs without autograd (no activations kept, no backward through
    frozen layers, nothing recomputed); each indexer differentiates its KL at once
    (``DSACoreAttention``), ``micro_batch`` collects the parameter gradients, and backward of
    the output hands them to the parameters (:class:`FrozenOutput`). ``stage_input``: what a
    pipeline stage received, given a zero gradient to send back."""
    micro_batch.precomputed_grads = {}
    try:
        with micro_batch.active(), torch.no_grad():
            output = forward()
        grads = micro_batch.precomputed_grads
    finally:
        micro_batch.precomputed_grads = None
    if stage_input is not None and not stage_input.requires_grad:
        stage_input = None
    if stage_input is None and not grads:  # a chunk without indexers or input to pass a gradient to
        return output.requires_grad_()  # megatron's backward of it then does nothing
    return FrozenOutput.apply(output, stage_input, list(grads.values()), *grads)


class FrozenOutput(torch.autograd.Function):
    """The output of a forward that ran the frozen network without autograd, through which
    backward gives ``params`` their precomputed ``grads`` -- times megatron's auxiliary-loss
    gradient scale, what ``MoEAuxLossAutoScaler`` gave each KL when it rode on its layer's
    output -- and the stage's input a zero gradient (a pipeline stage sends one back), with no
    backward through the frozen layers in between."""

    @staticmethod
    def forward(ctx, output, stage_input, grads, *params):
        ctx.stage_input = None if stage_input is None else (stage_input.shape, stage_input.dtype,
                                                             stage_input.device)
        ctx.grads = grads
        return output

    @staticmethod
    def backward(ctx, grad_output):
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        scale = MoEAuxLossAutoScaler.main_loss_backward_scale
        grads, ctx.grads = ctx.grads, None
        grads = [g if scale is None else g * scale for g in grads]
        shape_dtype_device = ctx.stage_input
        zero = None if shape_dtype_device is None else torch.zeros(
            shape_dtype_device[0], dtype=shape_dtype_device[1], device=shape_dtype_device[2])
        return None, zero, None, *grads
