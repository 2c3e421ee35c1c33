"""Tiny random ``GlmMoeDsaForCausalLM`` checkpoints for the HF interop tests.

Every norm weight, the indexer's LayerNorm bias and the router's expert bias are perturbed away
from their init (1 / 0), so a mapping that drops or swaps one of them changes the logits. The
indexer has 16 heads: its scores are sums of ReLUs, and with few heads many keys score exactly
0, where HF's ``torch.topk`` breaks ties arbitrarily (ours by position), so the top-k sets could
differ for reasons that say nothing about the model.
"""

from __future__ import annotations

import json
import os

import torch

#: HF fields matching a 4-layer GLM5Config (1 dense + 3 MoE layers)
TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
            n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=64,
            qk_rope_head_dim=8, v_head_dim=32, qk_nope_head_dim=24, num_experts_per_tok=2,
            norm_topk_prob=True, n_group=1, topk_group=1, max_position_embeddings=4096,
            index_head_dim=32, index_n_heads=16, first_k_dense_replace=1, initializer_range=0.1,
            rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
SEQ = 48


def tokens(batch=2, seq=SEQ, seed=1) -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(seed))


def hf_config(index_topk: int, **overrides):
    from transformers import GlmMoeDsaConfig

    return GlmMoeDsaConfig(**{**TINY, "index_topk": index_topk, "num_nextn_predict_layers": 1,
                              **overrides})


@torch.no_grad()
def _perturb(module, gen) -> None:
    for name, p in module.named_parameters():
        if "norm" in name:
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.2 * noise if name.endswith("weight") else 0.1 * noise)
    for name, b in module.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.05 * torch.randn(b.shape, generator=gen))


def make_model(index_topk: int, seed: int = 0, **overrides):
    """Same seed, same weights, whatever ``overrides`` (e.g. ``rope_parameters``) say."""
    from transformers import GlmMoeDsaForCausalLM

    torch.manual_seed(seed)
    model = GlmMoeDsaForCausalLM(hf_config(index_topk, **overrides))
    _perturb(model, torch.Generator().manual_seed(seed + 1))
    return model.eval()


def mtp_modules(cfg, seed: int = 2) -> dict:
    """A released-style MTP module for ``cfg``: one decoder layer (index num_hidden_layers) built
    by transformers, plus enorm, hnorm, eh_proj and the shared head norm."""
    from transformers import GlmMoeDsaConfig
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import (
        GlmMoeDsaDecoderLayer, GlmMoeDsaRMSNorm)

    n = cfg.num_hidden_layers
    wide = GlmMoeDsaConfig(**{**cfg.to_dict(), "num_hidden_layers": n + 1, "indexer_types": None,
                              "mlp_layer_types": None, "layer_types": None})
    wide._attn_implementation = "eager"
    wide._experts_implementation = "eager"
    gen = torch.Generator().manual_seed(seed)
    mods = {"layer": GlmMoeDsaDecoderLayer(wide, n),
            "enorm": GlmMoeDsaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
            "hnorm": GlmMoeDsaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
            "eh_proj": torch.nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False),
            "head_norm": GlmMoeDsaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)}
    with torch.no_grad():
        for m in mods.values():
            for name, p in m.named_parameters():
                if "norm" not in name:
                    p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            _perturb(m, gen)
    for m in mods.values():
        m.eval()
    mods["config"] = wide
    return mods


def mtp_tensors(model, mods) -> dict:
    """The MTP module as GLM-5's release stores it: ``model.layers.<N>.*``, experts one by one,
    with copies of the embedding and head."""
    n = model.config.num_hidden_layers
    pre = f"model.layers.{n}."
    out = {}
    for k, v in mods["layer"].state_dict().items():
        if k.endswith("experts.gate_up_proj"):
            half = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{pre}mlp.experts.{e}.gate_proj.weight"] = v[e, :half]
                out[f"{pre}mlp.experts.{e}.up_proj.weight"] = v[e, half:]
        elif k.endswith("experts.down_proj"):
            for e in range(v.shape[0]):
                out[f"{pre}mlp.experts.{e}.down_proj.weight"] = v[e]
        else:
            out[pre + k] = v
    out[pre + "enorm.weight"] = mods["enorm"].weight
    out[pre + "hnorm.weight"] = mods["hnorm"].weight
    out[pre + "eh_proj.weight"] = mods["eh_proj"].weight
    out[pre + "shared_head.norm.weight"] = mods["head_norm"].weight
    out[pre + "embed_tokens.weight"] = model.model.embed_tokens.weight
    out[pre + "shared_head.head.weight"] = model.lm_head.weight
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def save_hf(model, path: str, extra: dict | None = None, shard_size: str = "300KB") -> str:
    """``save_pretrained`` in several shards; ``extra`` tensors go to one more shard, indexed."""
    from safetensors.torch import save_file

    model.save_pretrained(path, max_shard_size=shard_size)
    if extra:
        index_path = os.path.join(path, "model.safetensors.index.json")
        with open(index_path) as f:
            index = json.load(f)
        save_file(extra, os.path.join(path, "model-mtp.safetensors"), metadata={"format": "pt"})
        index["weight_map"].update({k: "model-mtp.safetensors" for k in extra})
        with open(index_path, "w") as f:
            json.dump(index, f)
    return path


def read_hf_tensors(path: str) -> dict:
    from safetensors.torch import load_file

    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    out = {}
    for f in files:
        out.update(load_file(os.path.join(path, f)))
    return out


@torch.no_grad()
def mtp_reference_logits(model, mods, tokens: torch.Tensor) -> torch.Tensor:
    """Depth-1 MTP logits [b, s-1, V] from transformers' own modules: position i combines the
    main model's final hidden state at i with the embedding of token i+1 (GLM-5 / DeepSeek-V3
    MTP: eh_proj([enorm(embedding) ; hnorm(hidden)]), one decoder layer, shared-head norm)."""
    h = model.model(input_ids=tokens).last_hidden_state[:, :-1]
    emb = model.model.embed_tokens(tokens[:, 1:])
    x = mods["eh_proj"](torch.cat([mods["enorm"](emb), mods["hnorm"](h)], dim=-1))
    s = x.shape[1]
    pos = torch.arange(s)[None]
    mask = torch.full((s, s), torch.finfo(x.dtype).min).triu(1)[None, None]
    y, _ = mods["layer"](x, attention_mask=mask, position_ids=pos,
                         position_embeddings=model.model.rotary_emb(x, pos))
    return model.lm_head(mods["head_norm"](y))


@torch.no_grad()
def topk_margin(indexers, run) -> float:
    """Smallest gap, over the given HF indexers during ``run()`` and every query past top-k,
    between the k-th and (k+1)-th indexer score (float64, relative to the row's largest |score|).
    Two correct fp32 implementations can pick different keys only where this gap is at rounding
    level."""
    import torch.nn.functional as F
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import apply_rotary_pos_emb_interleave

    inputs = []
    hooks = [ind.register_forward_hook(
        lambda m, args, out: inputs.append((m, args))) for ind in indexers]
    run()
    for h in hooks:
        h.remove()
    worst = float("inf")
    for ind, (x, q_resid, (cos, sin), *_) in inputs:
        b, s, _ = x.shape
        q = ind.wq_b(q_resid).view(b, s, ind.n_heads, ind.head_dim).double()
        k = ind.k_norm(ind.wk(x)).unsqueeze(2).double()
        r = ind.qk_rope_head_dim
        q_rot, k_rot = apply_rotary_pos_emb_interleave(q[..., :r], k[..., :r], cos.double(), sin.double(),
                                                       unsqueeze_dim=2)
        q, k = torch.cat([q_rot, q[..., r:]], -1), torch.cat([k_rot, k[..., r:]], -1).squeeze(2)
        scores = F.relu(torch.einsum("bshd,btd->bsht", q, k))
        w = ind.weights_proj(x).double() * (ind.n_heads ** -0.5 * ind.head_dim ** -0.5)
        index = torch.einsum("bsh,bsht->bst", w, scores)
        kk = ind.index_topk
        for t in range(kk, s):
            row = index[:, t, : t + 1]
            top = row.topk(kk + 1, dim=-1).values
            gap = (top[:, kk - 1] - top[:, kk]) / row.abs().amax(dim=-1)
            worst = min(worst, float(gap.min()))
    return worst


def well_separated_tokens(model, mods=None, batch=2, min_margin=1e-4, seq=SEQ) -> torch.Tensor:
    """Tokens whose indexer top-k is unambiguous (see :func:`topk_margin`): the first of a few
    fixed seeds whose k-th / (k+1)-th score gap exceeds ``min_margin`` in every layer (and in the
    MTP layer, given its ``mods``)."""
    if model.config.index_topk >= seq:
        return tokens(batch, seq)
    indexers = [layer.self_attn.indexer for layer in model.model.layers]
    for seed in range(1, 11):
        ids = tokens(batch, seq, seed=seed)
        if mods is None:
            margin = topk_margin(indexers, lambda: model(input_ids=ids))
        else:
            margin = topk_margin(indexers + [mods["layer"].self_attn.indexer],
                                 lambda: mtp_reference_logits(model, mods, ids))
        if margin > min_margin:
            return ids
    raise AssertionError("no token seed gives an unambiguous indexer top-k")
