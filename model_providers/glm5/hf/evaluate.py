"""Next-token logits and loss of GLM-5: by the project's megatron model (any TP/PP/EP layout) and
by ``transformers`` (the independent reference).

The evaluation model is the checkpoint's architecture without the MTP module (only the main
head's logits count) and with DSA in ``sparse`` mode: every query attends to its indexer top-k
keys, which is what HF's ``GlmMoeDsaAttention`` does (top-k >= sequence length is dense). Padded
vocabulary columns are masked out, so the cross-entropy is over the real vocabulary, as HF's.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F

from model_providers.glm5.model.config import GLM5Config, PrecisionConfig, to_transformer_config
from parallel.megatron_compat import reset_loss_trackers


def eval_config(cfg: GLM5Config, dsa_mode: str = "sparse", mtp_num_steps: int = 0) -> GLM5Config:
    """``cfg`` for evaluation; a model built without an indexer (``dsa.mode=none``) stays so."""
    dsa_mode = "none" if cfg.dsa.mode == "none" else dsa_mode
    dsa = dataclasses.replace(cfg.dsa, mode=dsa_mode, indexer_dtype="fp32")
    return dataclasses.replace(cfg, mtp_num_steps=mtp_num_steps, dsa=dsa)


def _mask_padded_vocab(chunks, vocab_size: int) -> None:
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()

    def hook(module, args, output):
        logits, bias = output
        start = tp_rank * logits.shape[-1]
        if start + logits.shape[-1] <= vocab_size:
            return output
        logits = logits.clone()
        logits[..., max(0, vocab_size - start):] = float("-inf")
        return logits, bias

    for chunk in chunks:
        if chunk.post_process:
            chunk.output_layer.register_forward_hook(hook)


def build_eval_model(cfg: GLM5Config, par, dsa_mode: str = "sparse", backend: str | None = None,
                     mtp_num_steps: int = 0):
    """This rank's fp32 model chunks in eval mode (call after ``parallel.initialize``); the MTP
    module only when ``mtp_num_steps`` > 0 (its forward then needs labels)."""
    from model_providers.glm5.model.provider import build_model_chunks
    from model_providers.glm5.model.specs import resolve_backend

    ecfg = eval_config(cfg, dsa_mode, mtp_num_steps)
    tcfg = to_transformer_config(ecfg, par, PrecisionConfig())
    chunks = build_model_chunks(ecfg, tcfg, resolve_backend(backend or ecfg.layer_backend))
    for c in chunks:
        c.eval()
    _mask_padded_vocab(chunks, cfg.vocab_size)
    reset_loss_trackers()
    return chunks, tcfg


def load_weights(ckpt_dir: str, chunks) -> None:
    """Model weights of a dist checkpoint, resharded to this rank's chunks (either layer
    backend's naming, see ``backend_keys``)."""
    from megatron.core import dist_checkpointing

    from checkpointing import backend_keys
    sd = {f"model{i}": c.sharded_state_dict() for i, c in enumerate(chunks)}
    restore = backend_keys.adapt_to_checkpoint(sd, backend_keys.model_backend(chunks),
                                               backend_keys.checkpoint_backend(ckpt_dir))
    loaded = restore(dist_checkpointing.load(sd, ckpt_dir))
    for i, c in enumerate(chunks):
        c.load_state_dict(loaded[f"model{i}"], strict=True)


@torch.no_grad()
def logits(chunks, tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[b, s, vocab] fp32 logits; one rank (no TP/PP)."""
    assert len(chunks) == 1 and chunks[0].pre_process and chunks[0].post_process
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    out = chunks[0](tokens, positions, None)[..., :vocab_size].float()
    reset_loss_trackers()
    return out


def _batches(tokens: torch.Tensor, dp_rank: int, dp_size: int) -> list[dict]:
    out = []
    for row in tokens[dp_rank::dp_size]:
        t = row[None].long()
        labels = torch.zeros_like(t)
        labels[:, :-1] = t[:, 1:]
        mask = torch.ones_like(t, dtype=torch.float32)
        mask[:, -1] = 0
        out.append({"tokens": t, "labels": labels, "loss_mask": mask,
                    "position_ids": torch.arange(t.shape[1])[None]})
    return out


@torch.no_grad()
def next_token_loss(chunks, tokens: torch.Tensor) -> tuple[float, int]:
    """(mean next-token cross-entropy, predicted tokens) over ``tokens`` [b, s], through
    megatron's forward-only pipeline schedule; data-parallel replicas split the rows."""
    from functools import partial

    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from parallel.device import current_device, to_device

    def loss_func(mask, output):
        loss_sum = (output.float() * mask).sum()
        return loss_sum, mask.sum().to(torch.int), {"lm": torch.stack([loss_sum, mask.sum()])}

    def forward_step(data_iterator, model):
        b = to_device(next(data_iterator))
        out = model(b["tokens"], b["position_ids"], None, labels=b["labels"], loss_mask=b["loss_mask"])
        return out, partial(loss_func, b["loss_mask"])

    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    batches = _batches(tokens, dp_rank, dp_size)
    iters = [iter(batches) for _ in chunks]
    outs = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iters if len(iters) > 1 else iters[0],
        model=chunks, num_microbatches=len(batches), seq_length=tokens.shape[1],
        micro_batch_size=1, forward_only=True)
    total = torch.zeros(2, dtype=torch.float64, device=current_device())
    if (parallel_state.is_pipeline_last_stage(ignore_virtual=True)
            and parallel_state.get_tensor_model_parallel_rank() == 0):
        for o in outs:
            total += o["lm"].double()
    dist.all_reduce(total)
    reset_loss_trackers()
    loss_sum, count = total.tolist()
    return loss_sum / count, int(count)


@torch.no_grad()
def hf_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens.long()).logits.float()


def load_hf_model(hf_dir: str):
    from transformers import GlmMoeDsaForCausalLM

    model = GlmMoeDsaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


@torch.no_grad()
def hf_next_token_loss(hf_dir: str, tokens: torch.Tensor) -> tuple[float, int]:
    model = load_hf_model(hf_dir)
    total, count = 0.0, 0
    for row in tokens:
        lg = hf_logits(model, row[None])[0, :-1]
        total += float(F.cross_entropy(lg.double(), row[1:].long(), reduction="sum"))
        count += lg.shape[0]
    return total / count, count
