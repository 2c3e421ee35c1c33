"""A one-layer MLA + DSA attention built from the project's layer spec, and its outputs and
gradients under each ``model.dsa.kernels`` choice (tests of the layer and of the kernels)."""

import torch

from model_providers.glm5.model.config import DSAConfig
from parallel.megatron_compat.micro_batch import MicroBatch


def sparse_layer(mode, topk, **recompute):
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from model_providers.glm5.model.specs import local_layer_spec

    cfg = MLATransformerConfig(
        num_layers=1, hidden_size=64, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=24,
        qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=12, rope_type="rope",
        rotary_scaling_factor=1.0, normalization="RMSNorm", qk_layernorm=True, add_bias_linear=False,
        apply_rope_fusion=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False,
        bias_dropout_fusion=False, use_cpu_initialization=True, init_method_std=0.2, **recompute)
    dsa = DSAConfig(mode=mode, index_heads=2, index_head_dim=16, topk=topk, query_chunk=7)
    return build_module(local_layer_spec(None, dsa).submodules.self_attention, config=cfg, layer_number=1)


def outputs_per_kernel_choice(choices, topk=6):
    """{choice: [output, input grad, parameter grads...]} of the sparse layer under each
    ``model.dsa.kernels`` choice, one set of weights, two rows of two packed documents each.
    The choice "exact" is the torch path with the weights and input in fp64 (it computes in fp64)."""
    torch.manual_seed(0)
    layers = {}
    for choice in choices:
        layer = sparse_layer("sparse", topk=topk)
        layer.core_attention.dsa.kernels = "torch" if choice == "exact" else choice
        layers[choice] = layer
    for layer in layers.values():
        layer.load_state_dict(layers[choices[0]].state_dict())
    if "exact" in layers:
        layers["exact"].double()
    x = torch.randn(21, 2, 64)
    docs = torch.tensor([[0] * 8 + [1] * 13, [0] * 15 + [1] * 6])
    res = {}
    for choice, layer in layers.items():
        xi = (x.double() if choice == "exact" else x).clone().requires_grad_()
        with MicroBatch(docs).active():
            out, _ = layer(xi, attention_mask=docs)
        out.square().sum().backward()
        res[choice] = [out.detach(), xi.grad] + [p.grad for p in layer.parameters()]
    return res
