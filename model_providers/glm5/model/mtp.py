"""GLM-5's multi-token prediction: ONE MTP module applied ``mtp_num_steps`` times.

megatron-core's ``MultiTokenPredictionBlock`` builds one layer per prediction depth. GLM-5
shares a single module (embedding, eh_proj, norms and a full decoder layer) across its 3 depths,
so megatron is told of one MTP layer (``mtp_num_layers=1``: its pipeline layouts, its checks --
the EP all-to-all overlap allows only one -- and its per-layer schedules see the one module
there is). This block keeps megatron's interface and output layout ([1 + depths] hidden chunks
concatenated along the sequence dim, which ``GPTModel`` turns into per-depth MTP losses:
``megatron_compat.mtp.config_with_mtp_depths``) but runs its one layer at every depth. The shifts inside packed documents and the per-depth loss counts are
megatron-core fixes (``parallel.megatron_compat.mtp``).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock


class SharedMultiTokenPredictionBlock(MultiTokenPredictionBlock):
    """megatron's block with one layer, applied at each of ``num_steps`` depths; no tensors of
    its own (it takes over the block GPTModel built: ``provider.GLM5Model`` sets ``num_steps``)."""

    num_steps: int = 1

    def forward(self, input_ids, position_ids, hidden_states, attention_mask, padding_mask=None,
                context=None, context_mask=None, rotary_pos_emb=None, rotary_pos_cos=None,
                rotary_pos_sin=None, attention_bias=None, inference_params=None,
                packed_seq_params=None, sequence_len_offset=None, extra_block_kwargs=None,
                embedding=None):
        assert len(self.layers) == 1, "the shared MTP block holds exactly one layer"
        layer = self.layers[0]
        outputs = [hidden_states]
        for _ in range(self.num_steps):
            hidden_states, input_ids, position_ids, padding_mask = layer(
                input_ids=input_ids,
                position_ids=position_ids,
                hidden_states=hidden_states,
                attention_mask=attention_mask,
                padding_mask=padding_mask,
                inference_params=inference_params,
                rotary_pos_emb=rotary_pos_emb,
                rotary_pos_cos=rotary_pos_cos,
                rotary_pos_sin=rotary_pos_sin,
                packed_seq_params=packed_seq_params,
                sequence_len_offset=sequence_len_offset,
                embedding=embedding,
                **(extra_block_kwargs or {}),
            )
            outputs.append(hidden_states)
        return torch.cat(outputs, dim=0)

