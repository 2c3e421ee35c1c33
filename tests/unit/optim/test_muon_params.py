"""Which parameters of the tiny GLM-5 Muon updates, and how (whole, per head), vs Adam."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

CONF = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", "conf"))
QK, ROPE, V = 24, 8, 32  # the tiny model's MLA head dims


@pytest.fixture(scope="module")
def tiny_chunks():
    from megatron.core import parallel_state
    from omegaconf import OmegaConf

    from model_providers.glm5.model.config import GLM5Config, PrecisionConfig, to_transformer_config
    from model_providers.glm5.model.provider import build_model_chunks
    from parallel.config import ParallelConfig
    from parallel.initialize import DistEnv, initialize

    initialize(ParallelConfig(), seed=1, env=DistEnv.one_process())
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(GLM5Config),
                                              OmegaConf.load(os.path.join(CONF, "model", "glm5_tiny.yaml"))))
    yield build_model_chunks(cfg, to_transformer_config(cfg, ParallelConfig(), PrecisionConfig()), "local")
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def test_tiny_model_muon_and_adam_parameters(tiny_chunks):
    from pretrain.optim.matrices import muon_matrices

    specs = {s.name: s for s in muon_matrices(tiny_chunks, "per_head").values()}
    names = {n: p for c in tiny_chunks for n, p in c.named_parameters()}
    attn = "decoder.layers.1.self_attention."
    assert specs[attn + "linear_q_up_proj.weight"].block_rows == (QK + ROPE,)
    assert specs[attn + "linear_kv_up_proj.weight"].block_rows == (QK, V)
    for whole in ("linear_q_down_proj", "linear_kv_down_proj", "linear_proj"):
        assert specs[attn + whole + ".weight"].block_rows is None
    mlp = "decoder.layers.1.mlp."
    for e in range(8):
        assert specs[mlp + f"experts.local_experts.{e}.linear_fc1.weight"].shape == (128, 128)
    assert mlp + "shared_experts.linear_fc2.weight" in specs
    assert "decoder.layers.0.mlp.linear_fc1.weight" in specs and "mtp.layers.0.eh_proj.weight" in specs
    adam = {n for n in names if n not in specs}
    assert {"embedding.word_embeddings.weight", "output_layer.weight", mlp + "router.weight",
            "decoder.final_layernorm.weight", attn + "kv_layernorm.weight"} <= adam
    assert all(names[n].ndim == 2 for n in specs)
    assert not any("indexer" in n for n in specs)  # frozen in dense DSA mode: in no optimizer
    assert all(s.tp_group is None for s in specs.values())  # one rank: nothing to gather
    whole = muon_matrices(tiny_chunks, "none")
    assert all(s.block_rows is None for s in whole.values()) and len(whole) == len(specs)


def test_the_last_stage_mtp_embedding_copy_is_adam_like_the_first_stage_embedding():
    """With pipeline parallelism megatron keeps a copy of the word embedding on the last stage for
    MTP; its gradient is summed with the first stage's copy, so it must take the same optimizer."""
    from pretrain.config.schema import compose, to_run_config
    from pretrain.curriculum import plan
    from pretrain.optim.matrices import uses_adam
    from planner.meta_build import build_rank
    from pretrain.config.validation import check_run

    st = plan(to_run_config(compose(["parallel=tp2_pp2", "optimizer=muon_split"])))[0][0]
    layout, problems = check_run(st.rc, 4, check_paths=False)
    assert not problems
    for pp_rank in (0, 1):
        names = {n: p for c in build_rank(st.rc, layout, pp_rank).chunks for n, p in c.named_parameters()}
        embedding = names["embedding.word_embeddings.weight"]
        assert uses_adam("embedding.word_embeddings.weight", embedding), pp_rank
