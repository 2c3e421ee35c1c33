"""The planner's static memory: the meta build of a rank position (no process groups) has the
model's parameters, and ``state_bytes`` equals what a real rank holds.

Multi-rank equality (TP, SP, EP, PP x VPP, DP with the distributed optimizer, Adam and Muon) is
asserted on the runs of tests/distributed/test_parity.py; here a
real one-rank bf16 model takes one optimizer step in this process (main params only exist in
bf16) and the 744B sizes are checked against ``model_providers.glm5.counting.size``.
"""

from __future__ import annotations

import logging

import pytest
import torch

from planner.memory import state_bytes
from planner.meta_build import build_rank


def _rc(*overrides: str):
    from pretrain.config.schema import compose, to_run_config

    return to_run_config(compose(["curriculum=none", *overrides]))


def _layout(rc, world: int):
    from parallel.config import check_layout

    t = rc.trainer
    layout, problems = check_layout(rc.parallel, world_size=world, num_layers=rc.model.num_layers,
                                    num_attention_heads=rc.model.num_attention_heads,
                                    num_experts=rc.model.num_experts, seq_length=t.seq_length,
                                    micro_batch_size=1, global_batch_size=world)
    assert not problems, problems
    return layout


def _whole_model_count(rank, par) -> int:
    """Parameters of the whole model seen from one rank: TP-sharded ones x TP (x ETP for
    experts), experts x EP (megatron ``allreduce=False``)."""
    total = 0
    for chunk in rank.chunks:
        for p in chunk.parameters():
            expert = not getattr(p, "allreduce", True)
            sharded = getattr(p, "tensor_model_parallel", False)
            total += p.numel() * (par.ep if expert else 1) * (
                (par.expert_tp if expert else par.tp) if sharded else 1)
    return total


@pytest.mark.parametrize("model,tp,ep,vocab", [("glm5_tiny", 1, 1, 500), ("glm5_tiny", 2, 2, 300),
                                               ("glm5_744b", 1, 256, None), ("glm5_744b", 2, 32, None)])
def test_meta_build_has_the_models_parameters(model, tp, ep, vocab, caplog):
    """Every parameter megatron builds, from one rank at TP x EP, the vocabulary padded to a
    multiple of 128 x TP (tiny: 500 -> 512 at TP1, 300 -> 512 at TP2; GLM-5's 154880 needs none);
    megatron's per-build warnings stay out of the plan's output."""
    from model_providers.glm5.counting.size import model_size

    rc = _rc(f"model={model}", f"parallel.tp={tp}", f"parallel.sequence_parallel={tp > 1}",
             f"parallel.ep={ep}", *([f"model.vocab_size={vocab}"] if vocab else []))
    with caplog.at_level(logging.WARNING):
        rank = build_rank(rc, _layout(rc, tp * ep), 0)
    assert not [r.getMessage() for r in caplog.records if r.name.startswith("megatron")]
    assert _whole_model_count(rank, rc.parallel) == model_size(rc.model, tp).total
    vocab_rows = rank.chunks[0].embedding.word_embeddings.weight.shape[0]
    assert vocab_rows * tp == rc.model.padded_vocab_size(tp) == (512 if vocab else rc.model.vocab_size)
    assert {p.device.type for c in rank.chunks for p in c.parameters()} == {"meta"}


#: the 512-GPU layout GLM-5 shipped with first (TP2 SP, PP8 x VPP2, 8 / 10 layer ends, EP32)
LAYOUT_512 = ["parallel.tp=2", "parallel.pp=8", "parallel.vpp=2", "parallel.ep=32", "parallel.sequence_parallel=true", "parallel.first_stage_layers=8", "parallel.last_stage_layers=10", "parallel.distributed_optimizer=true"]


def test_744b_pipeline_ranks_of_the_512gpu_layout():
    """A 512-GPU layout (TP2 SP, PP8 x VPP2 with 8 / 10 layer ends, EP32): the first rank embeds, the
    last holds the output layer, the MTP layer and the MTP's copy of the embedding; all eight
    together are the model plus that copy (on the meta device: nothing is allocated)."""
    from model_providers.glm5.counting.size import model_size

    rc = _rc("model=glm5_744b", "precision=bf16", *LAYOUT_512)
    layout = _layout(rc, 512)
    first, last = build_rank(rc, layout, 0), build_rank(rc, layout, 7)
    assert all(p.is_meta for r in (first, last) for c in r.chunks for p in c.parameters())
    assert [len(c.decoder.layers) for c in first.chunks + last.chunks] == [4, 4, 5, 5]
    assert first.chunks[0].pre_process and not first.chunks[1].pre_process
    assert last.chunks[1].post_process and last.chunks[1].mtp_process and not last.chunks[0].post_process
    ranks = [first] + [build_rank(rc, layout, r) for r in range(1, 7)] + [last]
    m = rc.model
    embedding_copy = m.padded_vocab_size(2) * m.hidden_size
    assert sum(_whole_model_count(r, rc.parallel) for r in ranks) == model_size(m, 2).total + embedding_copy
    assert all(p.dtype == torch.bfloat16 for r in ranks for c in r.chunks for p in c.parameters())


def test_the_build_leaves_megatron_and_torch_state_as_it_found_them():
    import re

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    def snapshot():
        return {k: v for k, v in vars(ps).items() if re.match(r"^_[A-Z][A-Z0-9_]*$", k)}

    before, device, initialized = snapshot(), torch.cuda.current_device, dist.is_initialized()
    rc = _rc("parallel=tp2_pp2")
    build_rank(rc, _layout(rc, 4), 1)
    after = snapshot()
    assert after.keys() == before.keys()
    assert all(after[k] is before[k] for k in before), [k for k in before if after[k] is not before[k]]
    assert dist.is_initialized() is initialized and torch.cuda.current_device is device
    with pytest.raises(ValueError, match="pp_rank=2 is not a pipeline rank of parallel.pp=2"):
        build_rank(rc, _layout(rc, 4), 2)


def test_frozen_parameters_hold_weights_only():
    """DSA warm-up trains only the indexer; a stage's ``trainable`` patterns narrow it further."""
    rc = _rc("model.dsa.mode=warmup")
    layout = _layout(rc, 1)
    warm = state_bytes(rc, layout, 0)
    dense = state_bytes(_rc(), layout, 0)
    assert warm.params == dense.params and warm.weights == dense.weights
    indexer = sum(p.numel() for c in build_rank(rc, layout, 0).chunks
                  for n, p in c.named_parameters() if ".indexer." in n)
    assert warm.trainable == indexer and warm.grads == 4 * indexer and warm.optimizer == 8 * indexer
    wq = state_bytes(rc, layout, 0, trainable=[r"indexer\.wq_b"])
    assert 0 < wq.trainable < warm.trainable and wq.grads == 4 * wq.trainable


def _real_rank(rc):
    """A real one-rank model of ``rc`` after one optimizer step (zero gradients: the state is
    created all the same)."""
    from pretrain.stage_build import build_stage

    built = build_stage(rc, "local", steps=1)
    for d in built.ddp:
        d.zero_grad_buffer()
    built.optimizer.step()
    return built.ddp, built.optimizer


def _what_is_built(chunks, ddp) -> dict:
    """Every parameter (name, shape, dtype, trained) and buffer of the chunks, and every DDP
    gradient / parameter buffer's layout."""
    return {
        "parameters": [(n, tuple(p.shape), p.dtype, p.requires_grad) for c in chunks for n, p in c.named_parameters()],
        "buffers": [(n, tuple(b.shape), b.dtype) for c in chunks for n, b in c.named_buffers()],
        "ddp": [(b.param_dtype, b.grad_dtype, b.numel, b.numel_unpadded, len(b.params), len(b.buckets))
                for d in ddp for b in (*d.buffers, *d.expert_parallel_buffers)],
    }


@pytest.mark.parametrize("overrides, trainable", [
    (["precision=bf16", "optimizer=adam", "parallel.distributed_optimizer=true"], ()),
    (["model.dsa.mode=warmup"], ()),
    (["precision=bf16", "model.dsa.mode=sparse"], [r"indexer\.", r"\.mlp\."]),
])
def test_the_planner_sizes_what_the_run_builds(one_rank, overrides, trainable):
    """One build path (pretrain.stage_build.build_stage): the planner's meta-device rank and the
    run's real one hold the same parameters, buffers and DDP buffers, frozen sets included."""
    from pretrain.stage_build import build_stage

    rc = _rc(*overrides)
    planned = build_rank(rc, _layout(rc, 1), 0, trainable)
    real = build_stage(rc, "local", trainable, steps=1)
    want, have = _what_is_built(real.chunks, real.ddp), _what_is_built(planned.chunks, planned.ddp)
    assert have == want
    frozen = {n for n, *_, trained in want["parameters"] if not trained}
    assert want["ddp"] and len(want["parameters"]) > len(frozen) > 0  # the DSA mode's or trainable's freeze


@pytest.mark.parametrize("overrides", [
    ["precision=bf16", "optimizer=adam"],
    ["precision=bf16", "optimizer=muon_split", "parallel.distributed_optimizer=true"],
])
def test_state_bytes_equal_a_real_bf16_rank(one_rank, overrides):
    """bf16: fp32 main copies of every trainable parameter, weights in bf16 (the distributed
    optimizer's padded param buffer), fp32 grads; predicted before the real build, measured after."""
    from pretrain.reporting import memory_report
    rc = _rc(*overrides)
    predicted = state_bytes(rc, _layout(rc, 1), 0)
    ddp, optimizer = _real_rank(rc)
    measured = memory_report.measure(ddp, optimizer)
    assert {f: getattr(predicted, f) for f in measured} == measured
    assert predicted.main_params == 4 * predicted.trainable and predicted.weights >= 2 * predicted.params
    if rc.optimizer.name == "muon":
        assert 0 < predicted.muon_idle < predicted.optimizer // 2
