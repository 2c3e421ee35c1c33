"""Parameter counts of a GLM-5 config, computed from its shapes (no model is built), for the
start banner: a 744B config is described before (or without) building it."""

from __future__ import annotations

from dataclasses import dataclass

from model_providers.glm5.model.config import GLM5Config
from model_providers.glm5.counting.flops import attention_matmul_params


@dataclass(frozen=True)
class ModelSize:
    total: int  #: every parameter megatron builds (embedding, output layer, layers, MTP module)
    mtp: int  #: of which the shared MTP module's (eh_proj, its norms, its transformer layer)
    active: int  #: used per token by the main model, embedding and output layer excluded


def _attention(m: GLM5Config) -> int:
    """MLA (low-rank q and kv, their norms) + the DSA lightning indexer (none is built with
    ``dsa.mode=none``)."""
    mla = attention_matmul_params(m) + m.q_lora_rank + m.kv_lora_rank  # + the q/kv latent norms
    d = m.dsa
    if d.mode == "none":
        return mla
    indexer = (d.index_heads * d.index_head_dim * m.q_lora_rank + d.index_head_dim * m.hidden_size
               + 2 * d.index_head_dim + d.index_heads * m.hidden_size)
    return mla + indexer


def _layer(m: GLM5Config, moe: bool) -> tuple[int, int]:
    """(parameters, of which routed experts a token does not use) of one transformer layer."""
    norms = 2 * m.hidden_size
    if not moe:
        return _attention(m) + norms + 3 * m.hidden_size * m.ffn_hidden_size, 0
    expert = 3 * m.hidden_size * m.moe_ffn_hidden_size  # SwiGLU: fc1 [2f, h], fc2 [h, f]
    ffn = (m.num_experts * m.hidden_size + m.num_experts * expert
           + m.num_shared_experts * expert)
    return _attention(m) + norms + ffn, (m.num_experts - m.moe_topk) * expert


def model_size(m: GLM5Config, tp: int = 1) -> ModelSize:
    """Counts of the model megatron builds at tensor-parallel size ``tp`` (the vocabulary is
    padded to ``make_vocab_size_divisible_by * tp``). Router expert biases are buffers, not
    parameters, and are not counted."""
    vocab = m.padded_vocab_size(tp)
    dense, _ = _layer(m, moe=False)
    moe, moe_unused = _layer(m, moe=bool(m.num_experts))
    n_moe = m.num_moe_layers
    layers = (m.num_layers - n_moe) * dense + n_moe * moe
    embeddings = 2 * vocab * m.hidden_size  # untied input embedding and output layer
    main = embeddings + layers + m.hidden_size  # + final norm
    mtp = 0
    if m.mtp_num_steps:
        mtp = 3 * m.hidden_size + 2 * m.hidden_size * m.hidden_size + (moe if m.num_experts else dense)
    active = layers - n_moe * moe_unused + m.hidden_size
    return ModelSize(total=main + mtp, mtp=mtp, active=active)


def human(n: float) -> str:
    """1442848 -> '1.44M', 753864119552 -> '753.9B'."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            digits = 1 if n >= 100 * scale else 2
            return f"{n / scale:.{digits}f}{unit}"
    return str(int(n))
