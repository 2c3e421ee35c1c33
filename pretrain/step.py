"""Training steps through megatron-core's forward-backward schedules, DDP and optimizer."""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

from data_pipeline.batches import micro_batch_samples, micro_batches
from model_providers.glm5.model.dsa.attention import KL_TRACKER
from parallel.context_parallel import batch_on_this_cp_rank
from parallel.megatron_compat import MicroBatch, strict_cuda
from parallel.device import current_device, to_device
from pretrain.reliability.faults import step_is_finite


def lm_loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Token-summed LM loss; megatron's schedule divides by tokens and micro-batches.

    Under context parallelism each rank holds part of the tokens and DDP averages gradients over
    the CP group: the divisor is the whole sequence's token count and the sum is scaled by cp,
    so the averaged gradient is the one-rank gradient (the reported sums stay local)."""
    losses = output_tensor.float()
    mask = loss_mask.float()
    loss_sum = torch.sum(losses * mask)
    report = torch.stack([loss_sum.detach(), mask.sum()])
    num_tokens = mask.sum()
    cp = parallel_state.get_context_parallel_world_size()
    if cp > 1:
        num_tokens = num_tokens.detach().clone()
        dist.all_reduce(num_tokens, group=parallel_state.get_context_parallel_group())
        loss_sum = loss_sum * cp
    return loss_sum, num_tokens.to(torch.int), {"lm": report}


def with_sample_sums(loss_func, loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """``loss_func``'s result plus ``lm_samples`` [2, b]: each sample's loss sum and loss tokens
    (this rank's tokens of it under CP), for losses per data category."""
    loss, num_tokens, reports = loss_func(output_tensor)
    mask = loss_mask.float()
    losses = output_tensor.float().detach()
    reports["lm_samples"] = torch.stack([(losses * mask).sum(-1), mask.sum(-1)])
    return loss, num_tokens, reports


def document_mask(document_ids: torch.Tensor | None) -> torch.Tensor | None:
    """The micro-batch's document ids [b, L] when some sample holds several documents (the
    attention then masks across them), else None: one-document samples keep the plain causal
    path. Decided on the host batch (no device sync)."""
    if document_ids is None or bool((document_ids == document_ids[:, :1]).all()):
        return None
    return document_ids


def forward_step(data_iterator, model, per_sample: bool = False, return_schedule_plan: bool = False):
    """``per_sample``: also report each sample's loss sum and tokens (:func:`with_sample_sums`).
    ``return_schedule_plan``: megatron's combined 1F1B schedule (the EP all-to-all overlap) asks
    for the model's plan of this micro-batch, whose nodes it runs itself, instead of its output."""
    host = next(data_iterator)
    documents = document_mask(host.get("document_ids"))
    batch = batch_on_this_cp_rank(to_device(host))
    # the model's context for this micro-batch: the attention plans its document blocks on the
    # data loader's host copy of the ids (no device sync)
    micro_batch = MicroBatch(batch["document_ids"], documents) if documents is not None else MicroBatch()
    output = (model.build_schedule_plan if return_schedule_plan else model)(
        batch["tokens"],
        batch["position_ids"],
        micro_batch.document_ids,
        labels=batch["labels"],
        loss_mask=batch["loss_mask"],
        micro_batch=micro_batch,
    )
    loss_func = partial(lm_loss_func, batch["loss_mask"])
    if per_sample:
        loss_func = partial(with_sample_sums, loss_func, batch["loss_mask"])
    return output, loss_func


@dataclass
class StepStats:
    lm_loss: float  #: token mean over the global batch (0 when no token carries loss)
    loss_tokens: int  #: tokens with loss in the global batch
    mtp_losses: list
    moe_aux_loss: float  #: unscaled balance loss summed over MoE layer applications
    indexer_kl: list  #: per layer (decoder layers, then the shared MTP layer summed over depths)
    grad_norm: float
    moe_load_imbalance: float
    skipped: bool
    seconds: float
    host_syncs: int | None = None  #: device -> host syncs in the step (strict CPU emulation only)
    save_due: bool = False  #: rank 0 voted for a save after this step (``save_vote``)


class LoadImbalanceProbe:
    """Wraps megatron's ``finalize_model_grads`` to read each router's per-expert token counts
    before they are consumed by the aux-loss-free expert-bias update."""

    def __init__(self, model_chunks):
        self.routers = [m for c in model_chunks for m in c.modules() if hasattr(m, "expert_bias")
                        and getattr(m, "local_tokens_per_expert", None) is not None]
        self.value = None  #: device tensor [1], set at every grad finalisation

    def __call__(self, *args, **kwargs):
        worst = torch.ones(1, dtype=torch.float64, device=current_device())
        for r in self.routers:
            counts = r.local_tokens_per_expert.float()
            ratio = torch.where(counts.sum() > 0, counts.max() / counts.mean(), 1.0)
            worst = torch.maximum(worst, ratio.double())
        self.value = worst
        return finalize_model_grads(*args, **kwargs)


def configure_model_hooks(tcfg, ddp_chunks, optimizer) -> LoadImbalanceProbe:
    """The hooks megatron's schedules call: DDP no-sync, grad finalisation, loss scaling."""
    probe = LoadImbalanceProbe([c.module for c in ddp_chunks])
    tcfg.no_sync_func = [c.no_sync for c in ddp_chunks]
    if ddp_chunks[0].ddp_config.overlap_grad_reduce:  # each chunk's reduction starts after its last backward
        tcfg.grad_sync_func = [c.start_grad_sync for c in ddp_chunks]
    if len(ddp_chunks) == 1:
        tcfg.no_sync_func = tcfg.no_sync_func[0]
        tcfg.grad_sync_func = tcfg.grad_sync_func[0] if tcfg.grad_sync_func else None
    tcfg.finalize_model_grads_func = probe
    tcfg.grad_scale_func = optimizer.scale_loss
    return probe


def _reporting_rank() -> bool:
    """Last pipeline stage, TP rank 0: holds this DP replica's losses once."""
    return (parallel_state.is_pipeline_last_stage(ignore_virtual=True)
            and parallel_state.get_tensor_model_parallel_rank() == 0)


def train_step(ddp_chunks, optimizer, scheduler, dataset, consumed_samples: int, trainer_cfg,
               probe: LoadImbalanceProbe, mtp_steps: int, save_vote: bool = False) -> StepStats:
    """One optimizer step over a global batch. A step whose loss or gradients are non-finite on
    any rank is not applied (``skipped``). ``save_vote`` (rank 0's alone counts: its clock says a
    save is due) comes back on every rank as ``save_due``, carried by the step's own all-reduce."""
    t0 = time.perf_counter()
    if strict_cuda.is_active():
        strict_cuda.take_host_syncs()  # count this step's only
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    batches = list(micro_batches(dataset, consumed_samples, trainer_cfg.global_batch_size,
                                 trainer_cfg.micro_batch_size, dp_rank, dp_size))
    iters = [iter(batches) for _ in ddp_chunks]
    for c in ddp_chunks:
        c.zero_grad_buffer()
    optimizer.zero_grad()
    expert_bias = [r.expert_bias.detach().clone() for r in probe.routers]
    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iters if len(iters) > 1 else iters[0],
        model=ddp_chunks,
        num_microbatches=len(batches),
        seq_length=trainer_cfg.seq_length,
        micro_batch_size=trainer_cfg.micro_batch_size,
        forward_only=False,
    )
    n = 2 + mtp_steps
    report = torch.zeros(n + 1, dtype=torch.float64, device=current_device())  # [-1]: save vote
    if save_vote and dist.get_rank() == 0:
        report[n] = 1.0
    if _reporting_rank():
        for out in losses:
            report[:2] += out["lm"].double()
    if step_is_finite(report[:1], ddp_chunks):
        ok, grad_norm, _ = optimizer.step()  # fp16: megatron itself skips on found-inf (ok False)
    else:  # nothing of a skipped step is applied: undo its aux-loss-free expert-bias update too
        ok, grad_norm = False, None
        for router, bias in zip(probe.routers, expert_bias):
            router.expert_bias.copy_(bias)
    if ok:
        scheduler.step(increment=1)

    if _reporting_rank():
        values = MTPLossLoggingHelper.tracker.get("loss_values")
        if values is not None and mtp_steps:
            cp = parallel_state.get_context_parallel_world_size()  # every CP rank reports
            report[2:n] = values.double() / (len(batches) * dp_size * cp)
    dist.all_reduce(report)
    if MTPLossLoggingHelper.tracker.get("loss_values") is not None:
        MTPLossLoggingHelper.clean_metrics_in_tracker()

    device = current_device()
    imbalance = probe.value if probe.value is not None else torch.ones(1, dtype=torch.float64, device=device)
    dist.all_reduce(imbalance, op=dist.ReduceOp.MAX)
    aux = torch.zeros(1, dtype=torch.float64, device=device)
    kl = torch.zeros(0, dtype=torch.float64, device=device)
    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    if tracker:
        moe_utils.reduce_aux_losses_tracker_across_ranks()
        for name, entry in tracker.items():
            values = entry["values"] / len(batches)
            if name == KL_TRACKER:
                kl = values.double()
            else:
                aux += values.sum().double()
        moe_utils.clear_aux_losses_tracker()
    host = torch.cat([report[:n], imbalance, aux, kl, report[n:]]).tolist()  # the step's one copy to the host
    return StepStats(
        lm_loss=host[0] / max(host[1], 1),
        loss_tokens=int(host[1]),
        mtp_losses=host[2:n],
        moe_aux_loss=host[n + 1],
        indexer_kl=host[n + 2:-1],
        grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
        moe_load_imbalance=host[n],
        skipped=not ok,
        seconds=time.perf_counter() - t0,
        host_syncs=strict_cuda.take_host_syncs() if strict_cuda.is_active() else None,
        save_due=host[-1] > 0,
    )


def evaluate(ddp_chunks, valid, trainer_cfg, num_samples: int) -> dict:
    """Validation LM loss over ``num_samples`` held-out sequences of ``valid`` (a
    ``data_pipeline.build.MixtureDataset``), split evenly over its categories
    (:meth:`~data_pipeline.build.MixtureDataset.stratified`), forward only: the
    :func:`validation_metrics` of the per-category sums. Loss trackers are cleared afterwards so
    training metrics never see eval."""
    indices, labels = valid.stratified(num_samples)
    view = torch.utils.data.Subset(valid, indices)
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    mbs = trainer_cfg.micro_batch_size
    batches = list(micro_batches(view, 0, num_samples, mbs, dp_rank, dp_size))
    batch_labels = [[labels[i] for i in numbers]
                    for numbers in micro_batch_samples(0, num_samples, mbs, dp_rank, dp_size)]
    for c in ddp_chunks:
        c.eval()
    try:
        with torch.no_grad():
            losses = get_forward_backward_func()(
                forward_step_func=partial(forward_step, per_sample=True),
                data_iterator=[iter(batches) for _ in ddp_chunks] if len(ddp_chunks) > 1 else iter(batches),
                model=ddp_chunks,
                num_microbatches=len(batches),
                seq_length=trainer_cfg.seq_length,
                micro_batch_size=mbs,
                forward_only=True,
            )
    finally:
        for c in ddp_chunks:
            c.train()
        if MTPLossLoggingHelper.tracker.get("loss_values") is not None:
            MTPLossLoggingHelper.clean_metrics_in_tracker()
        moe_utils.clear_aux_losses_tracker()
    device = current_device()
    sums = torch.zeros(len(valid.categories), 2, dtype=torch.float64, device=device)
    if _reporting_rank():
        for out, ids in zip(losses, batch_labels):  # the schedule returns micro-batches in order
            sums.index_add_(0, torch.tensor(ids, device=device), out["lm_samples"].double().T)
    dist.all_reduce(sums)
    return validation_metrics(sums.tolist(), valid.categories, valid.category_shares)


def validation_metrics(sums: list, categories: list[str], shares: dict[str, float]) -> dict:
    """``valid_lm_loss/<category>`` (token mean of the category's samples) per category with loss
    tokens, and ``valid_lm_loss``: the mixture's category shares applied to them, so how many
    samples each category has in the validation set does not change it."""
    out = {f"valid_lm_loss/{c}": s / n for c, (s, n) in zip(categories, sums) if n > 0}
    weight = sum(shares[c] for c in categories if f"valid_lm_loss/{c}" in out)
    total = sum(shares[c] * out[f"valid_lm_loss/{c}"] for c in categories if f"valid_lm_loss/{c}" in out)
    return {"valid_lm_loss": total / weight if weight > 0 else float("nan"), **out}
