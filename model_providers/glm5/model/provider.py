"""Builds this rank's GLM-5 model chunks (one per virtual pipeline stage) on megatron-core."""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel

from model_providers.glm5.model.config import GLM5Config
from model_providers.glm5.model.dsa.modes import apply_dsa_mode, indexer_only_forward
from model_providers.glm5.model.mtp import SharedMultiTokenPredictionBlock
from model_providers.glm5.model.specs import decoder_block_spec, mtp_block_spec
from parallel import megatron_compat
from parallel.megatron_compat.tp_attributes import normalize_tp_attributes
from parallel.device import current_device


class GLM5Model(GPTModel):
    """megatron's GPTModel with GLM-5's shared MTP block.

    GPTModel constructs its MTP block itself (megatron-core offers no hook for its class); the
    block spec given here has one layer (megatron's config says ``mtp_num_layers=1``), and the
    built block is explicitly switched to :class:`SharedMultiTokenPredictionBlock` (same state, a
    forward that applies that layer at each of ``mtp_num_steps`` depths:
    ``megatron_compat.set_mtp_block_class``) so the parameters exist once; the model's own config
    counts the depths, which is what GPTModel's loss reads it for
    (``megatron_compat.config_with_mtp_depths``). Its MTP
    losses are sequence means under context parallelism and stay inside packed documents
    (``parallel.megatron_compat.mtp``). Its forward runs under one micro-batch context
    (``parallel.megatron_compat.micro_batch``).
    """

    #: the DSA warm-up: only the indexers train (``dsa.modes.apply_dsa_mode`` sets it)
    indexer_only: bool = False

    def __init__(self, *args, mtp_num_steps: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        if self.mtp_process:
            megatron_compat.set_mtp_block_class(self, SharedMultiTokenPredictionBlock)
            self.mtp.num_steps = mtp_num_steps
            for layer in self.mtp.layers:
                core = layer.mtp_model_layer.self_attention.core_attention
                core.tracker_slot = self.config.num_layers + layer.mtp_model_layer.layer_number
        if mtp_num_steps:
            self.config = megatron_compat.config_with_mtp_depths(self.config, mtp_num_steps)

    def forward(self, input_ids, position_ids, attention_mask, *args, micro_batch=None, **kwargs):
        """``attention_mask`` is None or the micro-batch's document ids [b, L] (see
        ``dsa.visibility``). ``micro_batch``: the ``megatron_compat.MicroBatch`` of this forward,
        whose document ids ``attention_mask`` is (the training step's carries the data loader's
        host copy); by default one is made here. It is the active one while megatron's forward
        runs: the dense attention plans its document blocks from its host ids, MTP's shifts stay
        inside its documents, the MLA hands the DSA core attention its intermediates through it."""
        micro_batch = _micro_batch_of(attention_mask, micro_batch)
        if self.indexer_only and self.training and torch.is_grad_enabled():
            # the DSA warm-up: the frozen network without autograd, the indexers' KLs attached
            # to the output; a pipeline stage's input gets a zero gradient to send back
            stage_input = None if self.pre_process else self.decoder.input_tensor
            return indexer_only_forward(micro_batch, lambda: super(GLM5Model, self).forward(
                input_ids, position_ids, attention_mask, *args, **kwargs), stage_input)
        with micro_batch.active():
            return super().forward(input_ids, position_ids, attention_mask, *args, **kwargs)

    def build_schedule_plan(self, input_ids, position_ids, attention_mask, *args, micro_batch=None,
                            **kwargs):
        """megatron's plan of this chunk for one micro-batch (the EP all-to-all overlap's combined
        1F1B schedule runs its nodes, not :meth:`forward`): each node runs under ``micro_batch``
        and the shared MTP layer is planned once per depth
        (``megatron_compat.schedule_plan.adapt``). Arguments as :meth:`forward`'s."""
        from parallel.megatron_compat import schedule_plan

        micro_batch = _micro_batch_of(attention_mask, micro_batch)
        plan = super().build_schedule_plan(input_ids, position_ids, attention_mask, *args, **kwargs)
        return schedule_plan.adapt(plan, micro_batch, self.mtp.num_steps if self.mtp_process else 0)


def _micro_batch_of(attention_mask, micro_batch):
    """``micro_batch``, which must carry ``attention_mask`` as its document ids; by default one
    made here."""
    if micro_batch is None:
        return megatron_compat.MicroBatch(attention_mask)
    if micro_batch.document_ids is not attention_mask:
        raise ValueError(f"attention_mask is not the document ids of {micro_batch!r}")
    return micro_batch


def build_model_chunks(cfg: GLM5Config, tcfg, backend: str) -> list[GLM5Model]:
    """Model chunks of this rank in virtual-stage order; each knows whether it embeds
    (first stage), computes the loss (last stage) and holds the MTP module. Their linear layers'
    TP attributes are set from the layers' layout, not the backend's marks
    (``megatron_compat.tp_attributes``).
    megatron-core's fixes are installed first (idempotent; ``parallel.initialize`` did already)."""
    megatron_compat.install()
    vpp = tcfg.virtual_pipeline_model_parallel_size or 1
    chunks = []
    for vp_stage in range(vpp):
        stage = vp_stage if vpp > 1 else None
        chunks.append(
            GLM5Model(
                config=tcfg,
                transformer_layer_spec=decoder_block_spec(tcfg, backend, cfg.dsa, vp_stage=stage),
                vocab_size=cfg.padded_vocab_size(tcfg.tensor_model_parallel_size),
                max_sequence_length=cfg.max_position_embeddings,
                pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
                share_embeddings_and_output_weights=False,
                position_embedding_type="rope",
                rotary_base=int(cfg.rope_theta),
                mtp_block_spec=mtp_block_spec(tcfg, backend, cfg.dsa, vp_stage=stage),
                mtp_num_steps=cfg.mtp_num_steps,
                vp_stage=stage,
            )
        )
    for chunk in chunks:  # plain torch modules (indexer, local norms) are built on the host
        if not any(p.is_meta for p in chunk.parameters()):  # meta builds (sizing) stay on meta
            chunk.to(current_device())
    normalize_tp_attributes(chunks)
    apply_dsa_mode(chunks, tcfg, cfg.dsa.mode)
    return chunks
