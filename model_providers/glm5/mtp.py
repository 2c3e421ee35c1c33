"""GLM-5's multi-token prediction: ONE MTP module applied ``mtp_num_layers`` times.

megatron-core 0.16.1's ``MultiTokenPredictionBlock`` builds one layer per prediction depth. GLM-5
shares a single module (embedding, eh_proj, norms and a full decoder layer) across its 3 depths.
This block keeps megatron's interface and output layout ([1 + depths] hidden chunks concatenated
along the sequence dim, which ``GPTModel`` turns into per-depth MTP losses) but runs its one
layer at every depth.
"""

from __future__ import annotations

import contextlib

import torch
from megatron.core.models.gpt import gpt_model
from megatron.core.transformer import multi_token_prediction
from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock, roll_tensor

from parallel.context_parallel import cp_size, local_positions

#: [b, s_local] bool of the micro-batch the model is running: token t and token t + 1 are in the
#: same document (None: one document per sample)
_NEXT_IN_DOCUMENT: list = [None]


@contextlib.contextmanager
def document_boundaries(document_ids):
    """Within this block the MTP rolls stay inside documents (``document_ids`` [b, L], the whole
    sequence's ids as the attention receives them, or None).

    megatron-core 0.16.1 keeps MTP inside documents only for THD ``packed_seq_params``; with
    document ids in the attention-mask slot its rolls carry the next document's tokens, labels
    and loss mask into the end of each document, so depth d at the last d tokens of a document
    was trained to predict the next document from the wrong context. Here every roll is followed
    by zeroing the positions whose successor starts another document -- what megatron's packed
    roll does per sequence -- so inputs, labels and loss mask of a packed sample equal those of
    its documents run one by one (context parallel ranks pick their zigzag positions)."""
    before = _NEXT_IN_DOCUMENT[0]
    keep = None
    if document_ids is not None:
        keep = torch.zeros_like(document_ids, dtype=torch.bool)
        keep[:, :-1] = document_ids[:, 1:] == document_ids[:, :-1]
        pos = local_positions(document_ids.shape[1] // cp_size(), device=document_ids.device)
        keep = keep if pos is None else keep[:, pos]
    _NEXT_IN_DOCUMENT[0] = keep
    try:
        yield
    finally:
        _NEXT_IN_DOCUMENT[0] = before


def _roll_within_documents(tensor, shifts=-1, dims=-1, cp_group=None, packed_seq_params=None):
    rolled, count = roll_tensor(tensor, shifts=shifts, dims=dims, cp_group=cp_group,
                                packed_seq_params=packed_seq_params)
    keep = _NEXT_IN_DOCUMENT[0]
    if keep is None or packed_seq_params is not None:
        return rolled, count
    assert shifts == -1 and rolled.shape == keep.shape, (shifts, rolled.shape, keep.shape)
    rolled = rolled * keep.to(rolled.dtype)
    return rolled, rolled.sum()


def _roll_tensor_sequence_count(tensor, shifts=-1, dims=-1, cp_group=None, packed_seq_params=None):
    """megatron-core 0.16.1's GPTModel divides each MTP depth's loss by the count this returns
    for the rolled loss mask. Two fixes to that count:

    - a micro-batch with no loss token at a depth (e.g. a long masked tool result in agent data)
      gives 0/0 = NaN and poisons every weight: the count is clamped to >= 1, as megatron's
      schedule does for the main loss (the micro-batch then adds zero MTP loss);
    - under context parallelism megatron returns this rank's count, so the CP-averaged loss is a
      mean of per-rank means, not the sequence mean: the count becomes the sequence's / cp,
      which makes the CP average exactly the one-rank mean (gradient and logged loss).
    """
    rolled, count = _roll_within_documents(tensor, shifts=shifts, dims=dims, cp_group=cp_group,
                                           packed_seq_params=packed_seq_params)
    if not torch.is_tensor(count):
        return rolled, max(count, 1)
    cp = cp_group.size() if cp_group is not None and packed_seq_params is None else 1
    if cp > 1:
        count = count.detach().clone()
        torch.distributed.all_reduce(count, group=cp_group)
    return rolled, count.clamp(min=1) / cp if cp > 1 else count.clamp(min=1)


gpt_model.roll_tensor = _roll_tensor_sequence_count  # labels and loss mask of each depth
multi_token_prediction.roll_tensor = _roll_within_documents  # each depth's input ids and positions


class SharedMultiTokenPredictionBlock(MultiTokenPredictionBlock):
    def forward(self, input_ids, position_ids, hidden_states, attention_mask, context=None,
                context_mask=None, rotary_pos_emb=None, rotary_pos_cos=None,
                rotary_pos_sin=None, attention_bias=None, inference_params=None,
                packed_seq_params=None, sequence_len_offset=None, extra_block_kwargs=None,
                embedding=None):
        assert len(self.layers) == 1, "the shared MTP block holds exactly one layer"
        layer = self.layers[0]
        outputs = [hidden_states]
        for _ in range(self.config.mtp_num_layers):
            hidden_states, input_ids, position_ids = layer(
                input_ids=input_ids,
                position_ids=position_ids,
                hidden_states=hidden_states,
                attention_mask=attention_mask,
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

