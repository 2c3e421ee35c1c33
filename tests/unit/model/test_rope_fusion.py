"""``parallel.apply_rope_fusion``: megatron's fused MLA RoPE kernels (Triton, run here by the
interpreter) give the unfused model's loss and gradients on a YaRN model with power-of-2 head
dims (the tiny DeepSeek-V3, one step through MLA and its MTP module), and cannot compile the
192-dim nope part GLM-5 has -- what ``parallel.features.rope_fusion_problems`` refuses."""

from __future__ import annotations

import pytest

from tests.support.triton_interpreter import collect_in_interpreter

pytestmark = pytest.mark.heavy


def _tiny_deepseek_v3(**fields):
    import dataclasses
    import os

    from omegaconf import OmegaConf

    from model_providers.glm5.model.config import GLM5Config
    from pretrain.config.schema import CONF_DIR

    raw = OmegaConf.load(os.path.join(CONF_DIR, "model", "deepseek_v3_tiny.yaml"))
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(GLM5Config), raw))
    return dataclasses.replace(cfg, **fields)


def _loss_and_grads(cfg, fused: bool, calls: list):
    from megatron.core.transformer import multi_latent_attention as mla

    from parallel.config import ParallelConfig
    from pretrain.config.schema import PrecisionConfig
    from tests.support.one_step import loss_and_grads

    for name in ("fused_apply_mla_rope_for_q", "fused_apply_mla_rope_for_kv"):
        real = getattr(getattr(mla, name), "counted_from", getattr(mla, name))

        def counted(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        counted.counted_from = real
        setattr(mla, name, counted)
    return loss_and_grads(cfg, ParallelConfig(apply_rope_fusion=fused), PrecisionConfig(), batch=1, seq=24)


def _collect() -> dict:
    """Run in a TRITON_INTERPRET=1 process (megatron's kernels are jitted at its import)."""
    import triton

    from parallel.config import ParallelConfig
    from parallel.features import rope_fusion_problems
    from parallel.initialize import DistEnv, initialize
    from tests.support.triton_interpreter import autotune_first_config

    autotune_first_config()
    initialize(ParallelConfig(), seed=5, env=DistEnv.one_process())
    cfg = _tiny_deepseek_v3(qk_nope_head_dim=32)  # 32 + 8 rope, v 32: powers of 2
    plain_calls, fused_calls = [], []
    loss, grads = _loss_and_grads(cfg, False, plain_calls)
    fused_loss, fused_grads = _loss_and_grads(cfg, True, fused_calls)
    worst = max(((fused_grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-30)).item()
                for n, g in grads.items())
    glm5_like = _tiny_deepseek_v3(qk_nope_head_dim=24)  # as the tiny GLM-5's: not a power of 2
    try:
        _loss_and_grads(glm5_like, True, [])
        compile_error = ""
    except Exception as e:  # noqa: BLE001 -- the interpreter's error is what the test reads
        compile_error = repr(e)
    return {"interpreted": bool(fused_calls) and triton.knobs.runtime.interpret,
            "plain_calls": len(plain_calls), "fused_calls": sorted(set(fused_calls)),
            "loss": [loss.item(), fused_loss.item()], "same_names": sorted(grads) == sorted(fused_grads),
            "worst_relative_grad": worst, "compile_error": compile_error[-300:],
            "refused": [rope_fusion_problems(cfg), rope_fusion_problems(glm5_like)]}


def test_fused_mla_rope_trains_like_the_unfused_one_where_megatron_can_compile_it():
    r = collect_in_interpreter(__name__)
    assert r["plain_calls"] == 0 and r["fused_calls"] == ["fused_apply_mla_rope_for_kv",
                                                          "fused_apply_mla_rope_for_q"], r
    plain, fused = r["loss"]
    assert fused == pytest.approx(plain, rel=1e-6)
    assert r["same_names"] and r["worst_relative_grad"] < 1e-5, r
    assert "power of 2" in r["compile_error"], r
    ok, refused = r["refused"]
    assert ok == [] and len(refused) == 1 and "model.qk_nope_head_dim=24" in refused[0], refused
