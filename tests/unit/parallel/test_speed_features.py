"""megatron's speed features as config fields: the combinations megatron-core refuses are
refused before compute with both fields named (and megatron's own TransformerConfig refuses the
same config), the GPU presets' features are accepted by megatron's TransformerConfig built here,
and what this machine lacks is refused only when a run starts."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from model_providers.glm5.model.config import GLM5Config, PrecisionConfig, to_transformer_config
from parallel.config import ParallelConfig, check_layout
from parallel.features import check_features, machine_problems
from pretrain.config.schema import OptimizerConfig

MOE = GLM5Config()  # tiny: 4 layers, 8 experts, MTP x 3, plain RoPE
BF16 = PrecisionConfig(dtype="bf16")
EP2 = dict(ep=2, pp=2, vpp=2)


def _problems(par, model=MOE, precision=BF16):
    return check_features(par, model, precision.dtype)


def _megatron_refuses(par, model=MOE, precision=BF16) -> str:
    with pytest.raises((AssertionError, ValueError, ImportError)) as e:
        to_transformer_config(model, par, precision)
    return str(e.value)


REFUSED = [  # (layout fields, model fields, precision, our message, megatron's)
    (dict(ep=2, overlap_moe_expert_parallel_comm=True, pp=2, vpp=2), dict(recompute="full"), BF16,
     "parallel.overlap_moe_expert_parallel_comm=true needs model.recompute other than full",
     "disable full recomputation"),
    (dict(ep=2, overlap_moe_expert_parallel_comm=True, pp=2, vpp=2), {}, PrecisionConfig(dtype="fp32"),
     "parallel.overlap_moe_expert_parallel_comm=true needs precision.dtype=bf16 (got fp32)",
     "only supported with bf16"),
    (dict(ep=2, overlap_moe_expert_parallel_comm=True, pp=2), dict(mtp_num_steps=1), BF16,
     "with parallel.pp=2 needs virtual pipeline stages: parallel.vpp > 1", "virtual_pipeline_model_parallel_size must be"),
    (dict(ep=1, overlap_moe_expert_parallel_comm=True, pp=2, vpp=2), dict(mtp_num_steps=1), BF16,
     "needs expert parallelism: parallel.ep > 1", "only supported with expert model parallelism"),
    (dict(ep=2, overlap_moe_expert_parallel_comm=True, pp=2, vpp=2),
     dict(recompute="selective", recompute_modules=["mla_up_proj", "moe"]), BF16,
     "cannot recompute the MoE layer: model.recompute_modules=['mla_up_proj', 'moe'] must not hold moe",
     "disable moe in recompute_modules"),
    (dict(delay_wgrad_compute=True), {}, BF16,
     "parallel.delay_wgrad_compute=true needs parallel.overlap_moe_expert_parallel_comm=true",
     "overlap_moe_expert_parallel_comm must be enabled"),
    (dict(high_priority_a2a_comm_stream=True), {}, BF16,
     "parallel.high_priority_a2a_comm_stream=true needs parallel.overlap_moe_expert_parallel_comm=true", None),
    (dict(apply_rope_fusion=True), {}, BF16,
     "parallel.apply_rope_fusion=true needs model.rope_type=yarn (got rope)", "only works with YARN"),
    (dict(apply_rope_fusion=True), dict(rope_type="yarn", qk_nope_head_dim=192, v_head_dim=256), BF16,
     "needs MLA head dims that are powers of 2 (got model.qk_nope_head_dim=192)", None),
    (dict(tp=2, sequence_parallel=True, tp_comm_overlap=True), {}, BF16,
     "parallel.tp_comm_overlap=true cannot run with multi-latent attention on megatron-core 0.19.2", None),
    (dict(overlap_param_gather=True, distributed_optimizer=False, overlap_grad_reduce=True), {}, BF16,
     "parallel.overlap_param_gather=true needs parallel.distributed_optimizer=true", None),
    (dict(overlap_param_gather=True, distributed_optimizer=True), {}, BF16,
     "parallel.overlap_param_gather=true needs parallel.overlap_grad_reduce=true", None),
    (dict(cross_entropy_loss_fusion=True), {}, PrecisionConfig(dtype="fp32"),
     "parallel.cross_entropy_loss_fusion=true needs precision.dtype=bf16 (got fp32)", None),
    (dict(moe_token_dispatcher_type="flex"), {}, BF16,
     "parallel.moe_token_dispatcher_type=flex needs parallel.ep*etp > 1 (got ep=1, etp=1)", None),
]


@pytest.mark.parametrize("fields, model_fields, precision, ours, megatrons", REFUSED,
                         ids=[r[3][:60] for r in REFUSED])
def test_refused_combinations_name_the_fields_and_megatron_refuses_them_too(fields, model_fields, precision,
                                                                            ours, megatrons):
    par, model = ParallelConfig(**fields), dataclasses.replace(MOE, **model_fields)
    problems = _problems(par, model, precision)
    assert any(ours in p for p in problems), problems
    if megatrons is not None:  # a rule of megatron's TransformerConfig (the others: its DDP, optimizer, dispatcher)
        assert megatrons in _megatron_refuses(par, model, precision)


def test_ep_overlap_validates_where_megatron_allows_it():
    """GLM-5's shared MTP module applied 3 times (megatron is told of its one layer), bf16, EP2,
    PP2 x VPP2, selective recompute of the MLA up-projections (0.19 refuses ``moe`` with the
    overlap; ``moe_act`` is allowed, with GPUs' grouped-GEMM experts): megatron builds its config with the overlap and the delayed
    wgrad on. The overlap itself runs on CPU ranks (tests/distributed/test_ep_overlap.py); the
    delayed wgrad needs Transformer Engine's grouped GEMM, which only the machine check asks for."""
    model = dataclasses.replace(MOE, recompute="selective", recompute_modules=["mla_up_proj"])
    assert model.mtp_num_steps == 3
    par = ParallelConfig(overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True,
                         high_priority_a2a_comm_stream=True, **EP2)
    assert _problems(par, model) == []
    assert machine_problems(par, BF16, OptimizerConfig(), cuda=False) == [
        "parallel.delay_wgrad_compute=true needs CUDA and Transformer Engine grouped GEMM (this machine has no CUDA)"]
    tcfg = to_transformer_config(model, par, BF16)
    assert tcfg.overlap_moe_expert_parallel_comm and tcfg.delay_wgrad_compute and tcfg.mtp_num_layers == 1
    assert tcfg.high_priority_a2a_comm_stream


def test_megatron_takes_every_feature_field_under_its_own_name():
    par = ParallelConfig(tp=2, sequence_parallel=True, cross_entropy_loss_fusion=True, ep=2,
                         moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="hybridep")
    tcfg = to_transformer_config(MOE, par, BF16)
    assert (tcfg.cross_entropy_loss_fusion, tcfg.moe_token_dispatcher_type, tcfg.moe_flex_dispatcher_backend) == \
        (True, "flex", "hybridep")
    assert to_transformer_config(MOE, ParallelConfig(), BF16).moe_token_dispatcher_type == "alltoall"


@pytest.mark.parametrize("preset", ["glm5_h200_512gpu", "glm5_h100_1024gpu", "dsv3_h100_1024gpu"])
def test_gpu_presets_are_accepted_by_megatron_but_for_what_this_machine_lacks(preset):
    """Every stage layout of a GPU preset builds megatron's TransformerConfig here, once the
    features megatron checks against the installed kernels (TE's fused permute) are off -- and
    exactly those are what :func:`machine_problems` reports for this machine."""
    import os

    from omegaconf import OmegaConf

    from pretrain.config.schema import CONF_DIR
    from pretrain.curriculum import PRESET_STAGE_KEYS

    path = os.path.join(CONF_DIR, "parallel", f"{preset}.yaml")
    if not os.path.exists(path):
        pytest.skip(f"{preset} not shipped")
    raw = OmegaConf.to_container(OmegaConf.load(path))
    raw.pop("defaults", None)
    stages = raw.pop("stages", {}) or {}
    model_name = "deepseek_v3_671b" if preset.startswith("dsv3") else "glm5_744b"
    model_raw = OmegaConf.load(os.path.join(CONF_DIR, "model", f"{model_name}.yaml"))
    model = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(GLM5Config), model_raw))
    for stage, over in [("4K", {})] + list(stages.items()):
        over = {k: v for k, v in over.items() if k not in PRESET_STAGE_KEYS}
        par = ParallelConfig(**{**raw, **over})
        memory = stages.get(stage, {})
        m = dataclasses.replace(model, recompute=memory.get("recompute", model.recompute),
                                recompute_modules=memory.get("recompute_modules", model.recompute_modules))
        if m.recompute == "none":
            m = dataclasses.replace(m, recompute=None)
        assert _problems(par, m) == [], (stage, _problems(par, m))
        lacking = machine_problems(par, BF16, OptimizerConfig(), cuda=torch.cuda.is_available())
        needs_te_here = {"moe_permute_fusion"} & {f for f in ("moe_permute_fusion",) if getattr(par, f)}
        here = dataclasses.replace(par, moe_permute_fusion=False) if needs_te_here else par
        if not torch.cuda.is_available():  # moe_act: the grouped-GEMM experts of GPUs only
            m = dataclasses.replace(m, recompute_modules=[r for r in m.recompute_modules if r != "moe_act"])
        tcfg = to_transformer_config(m, here, BF16)
        assert tcfg.num_layers == m.num_layers
        if needs_te_here and not torch.cuda.is_available():
            assert "fused permutation is not available" in _megatron_refuses(par, m)  # TE's fused permute
            assert any(p.startswith("parallel.moe_permute_fusion=true needs CUDA") for p in lacking)


@pytest.mark.skipif(torch.cuda.is_available(), reason="lists what a machine without CUDA lacks")
def test_machine_problems_name_each_missing_feature_once():
    par = ParallelConfig(ep=2, moe_token_dispatcher_type="flex", moe_permute_fusion=True, overlap_grad_reduce=True,
                         overlap_param_gather=True, distributed_optimizer=True)
    opt = OptimizerConfig(exp_avg_dtype="bf16")
    lacking = machine_problems(par, PrecisionConfig(dtype="bf16", fp8="mxfp8"), opt, cuda=False)
    assert lacking == [
        "parallel.moe_permute_fusion=true needs CUDA and Transformer Engine >= 2.1 (this machine has no CUDA)",
        "parallel.moe_token_dispatcher_type=flex needs CUDA and the deep_ep package (deepep kernels) "
        "(this machine has no CUDA)",
        "precision.fp8=mxfp8 needs CUDA and Transformer Engine (this machine has no CUDA)",
        "optimizer.exp_avg_dtype=bf16 (megatron's precision-aware optimizer) needs CUDA and Transformer "
        "Engine's FusedAdam (this machine has no CUDA)",
    ]  # DP overlap runs on gloo: not listed
    assert machine_problems(ParallelConfig(), PrecisionConfig(), OptimizerConfig(), cuda=False) == []


def test_pipeline_layout_is_checked_by_megatron_and_gives_the_chunks():
    base = dict(world_size=2, num_layers=4, num_attention_heads=4, num_experts=8, seq_length=64,
                micro_batch_size=1, global_batch_size=8, mtp_num_steps=3)
    layout, p = check_layout(ParallelConfig(pp=2, vpp=2, pipeline_layout="Et|tt|t|mL"), **base)
    assert p == [] and layout.layers_per_stage == (1, 2, 1, 0)
    assert (layout.embedding_chunk, layout.mtp_chunk, layout.loss_chunk) == (0, 3, 3)
    _, p = check_layout(ParallelConfig(pp=2, pipeline_layout="Et|tt|t|mL"), **base)
    assert p == ["parallel.pipeline_layout='Et|tt|t|mL' has 4 stages, but parallel.pp=2 x vpp=None = 2 model chunks"]
    _, p = check_layout(ParallelConfig(pp=2, vpp=2, pipeline_layout="Et|tt|tt|mL"), **base)
    assert "Number of decoder layers 5" in p[0] and "model.num_layers=4" in p[0]
    _, p = check_layout(ParallelConfig(pp=2, pipeline_layout="Ett|ttmL", last_stage_layers=2), **base)
    assert p == ["parallel.pipeline_layout='Ett|ttmL' replaces parallel.first_stage_layers=None and "
                 "last_stage_layers=2: set those to null"]
    # megatron is told of the one shared MTP module, applied mtp_num_steps times: one m
    tcfg = to_transformer_config(MOE, ParallelConfig(pp=2, vpp=2, pipeline_layout="Et|tt|t|mL"), BF16)
    assert [t.name for t in tcfg.pipeline_model_parallel_layout.layout[1][1]] == ["mtp", "loss"]
    assert tcfg.mtp_num_layers == 1 and MOE.mtp_num_steps == 3


def test_bf16_moments_are_megatrons_precision_aware_adam():
    from pretrain.optim import check_moments
    from pretrain.optim.build import megatron_config, moment_dtypes

    opt = OptimizerConfig(exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")
    assert check_moments(opt, distributed=True) == []
    assert check_moments(dataclasses.replace(opt, name="muon"), distributed=True) == [
        "optimizer.exp_avg_dtype=bf16 / exp_avg_sq_dtype=bf16 (megatron's precision-aware optimizer) "
        "needs optimizer.name=adam, got muon"]
    assert "needs parallel.distributed_optimizer=true" in check_moments(opt, distributed=False)[0]
    assert check_moments(OptimizerConfig(exp_avg_dtype="fp16"), True) == [
        "optimizer.exp_avg_dtype='fp16' must be fp32 or bf16"]
    # megatron's OptimizerConfig takes them as these fields (building it needs TE: at launch,
    # machine_problems refuses first)
    assert moment_dtypes(opt) == dict(use_precision_aware_optimizer=True, exp_avg_dtype=torch.bfloat16,
                                      exp_avg_sq_dtype=torch.bfloat16)
    assert moment_dtypes(OptimizerConfig()) == {}
    assert not megatron_config(OptimizerConfig(), "bf16", distributed=True).use_precision_aware_optimizer
