"""The activation model's schedule replay against megatron-core's own schedule functions, its
scaling with sequence, TP and CP, its errors, and the 744B plan per pipeline rank (no process
group, no allocation). Its accuracy against measured peaks: tests/distributed/test_plan_activations.py."""

from types import SimpleNamespace

import pytest
from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches, get_schedule_table

from pretrain.config.schema import compose, to_run_config
from planner.activations import _held_at_peak, _interleaved_chunk_order, activation_bytes
from pretrain.config.validation import check_run

GIB = 2 ** 30


def _plan(overrides, world=1, backend="local"):
    rc = to_run_config(compose(["curriculum=none", *overrides]))
    layout, problems = check_run(rc, world, check_paths=False)
    assert not problems, problems
    return rc, layout, [activation_bytes(rc, layout, r, backend) for r in range(rc.parallel.pp)]


@pytest.mark.parametrize("micro_batches,vpp,pp", [(4, 2, 2), (8, 2, 4), (6, 3, 3), (5, 2, 2)])
def test_interleaved_order_is_megatrons_schedule_table(micro_batches, vpp, pp):
    table = get_schedule_table(micro_batches, vpp, pp)
    assert _interleaved_chunk_order(micro_batches, vpp, pp) == [chunk for _, chunk in table]


@pytest.mark.parametrize("pp,vpp,micro_batches", [(4, 1, 8), (4, 1, 2), (4, 2, 8), (8, 2, 16), (2, 2, 2)])
def test_held_micro_batches_follow_megatrons_warmup(pp, vpp, micro_batches):
    """With equal chunks the most held at once is megatron's warm-up count plus the first
    steady-state forward (all of them when the warm-up covers the step)."""
    for rank in range(pp):
        comm = SimpleNamespace(pp_group=SimpleNamespace(size=lambda: pp, rank=lambda r=rank: r),
                               virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None)
        total, _, warmup, _ = get_pp_rank_microbatches(micro_batches, vpp, pp, p2p_communicator=comm)
        held, _ = _held_at_peak([1] * vpp, pp, rank, vpp, micro_batches)
        assert held == min(warmup + 1, total), (rank, held, warmup, total)


def test_pipeline_ranks_hold_their_in_flight_micro_batches():
    """1F1B: rank r holds min(pp - r, micro-batches) micro-batches; only the last holds logits."""
    rc, layout, ranks = _plan(["parallel.pp=2", "trainer.global_batch_size=3",
                               "trainer.micro_batch_size=1"], world=2)
    assert [a.in_flight for a in ranks] == [2.0, 1.0]
    assert ranks[0].logits == 0 < ranks[1].logits
    one = _plan(["parallel.pp=2", "trainer.global_batch_size=1", "trainer.micro_batch_size=1"], 2)[2]
    assert [a.in_flight for a in one] == [1.0, 1.0]
    assert one[0].per_microbatch == ranks[0].per_microbatch
    assert one[0].peak < ranks[0].peak


def test_dense_activations_grow_linearly_with_the_sequence():
    """No s x s tensor is kept in dense mode (SDPA keeps its output and log-sum-exp)."""
    short, long = (_plan([f"trainer.seq_length={s}", "trainer.micro_batch_size=1"])[2][0]
                   for s in (512, 2048))
    assert long.per_microbatch == 4 * short.per_microbatch


def test_recomputation_keeps_less():
    seq = ["trainer.seq_length=2048", "trainer.micro_batch_size=1", "model.dsa.mode=sparse"]
    none, selective, full = (_plan([*seq, f"model.recompute={r}"])[2][0]
                             for r in ("null", "selective", "full"))
    assert none.peak > selective.peak > full.peak
    assert full.per_microbatch < selective.per_microbatch / 4
    assert none.working < selective.working < full.working  # what each recomputes in backward


def test_tensor_and_context_parallel_split_the_activations():
    """TP2 + SP halves every token's share (the MTP's gathered eh_proj output aside); CP2 halves
    the queries but each rank keeps the whole sequence's keys and values."""
    seq = ["trainer.seq_length=2048", "trainer.micro_batch_size=1"]
    one = _plan(seq)[2][0].per_microbatch
    tp = _plan([*seq, "parallel.tp=2", "parallel.sequence_parallel=true"], world=2)[2][0]
    cp = _plan([*seq, "parallel.cp=2"], world=2)[2][0]
    assert 0.5 * one < tp.per_microbatch < 0.55 * one
    assert 0.5 * one < cp.per_microbatch < 0.6 * one


def test_transformer_engine_norms_keep_less():
    seq = ["trainer.seq_length=512", "trainer.micro_batch_size=1"]
    local = _plan(seq, backend="local")[2][0]
    te = _plan(seq, backend="te")[2][0]
    assert te.per_microbatch < local.per_microbatch
    assert te.logits == local.logits  # fp32: same softmax, no reduced-precision copy


def test_bad_input_names_the_field():
    rc, layout, _ = _plan(["parallel.pp=2", "trainer.micro_batch_size=1", "trainer.global_batch_size=2"],
                          world=2)
    with pytest.raises(ValueError, match=r"pp_rank=2 is outside parallel.pp=2"):
        activation_bytes(rc, layout, 2)
    with pytest.raises(ValueError, match=r"backend='gpu' must be te or local"):
        activation_bytes(rc, layout, 0, backend="gpu")
    with pytest.raises(ValueError, match=r"cp_rank=1 is outside parallel.cp=1"):
        activation_bytes(rc, layout, 0, cp_rank=1)
    single = _plan([])[1]
    with pytest.raises(ValueError, match=r"layout has 1 model chunks, but parallel.pp=2"):
        activation_bytes(rc, single, 0)


def test_glm5_744b_activations_per_pipeline_rank():
    """The shipped 512-GPU layout (TP2 SP, PP8 x VPP2 with uneven ends, EP32) at 4K, selective
    recomputation, bf16 on Transformer Engine: the interleaved warm-up makes the first rank hold
    the most micro-batches, fewer down the pipeline; the last holds the heads' softmax."""
    rc, layout, ranks = _plan(["model=glm5_744b", "model.recompute_modules=[mla_up_proj,moe]", "parallel.tp=2", "parallel.pp=8", "parallel.vpp=2", "parallel.ep=32",
                               "parallel.sequence_parallel=true", "parallel.first_stage_layers=8",
                               "parallel.last_stage_layers=10", "parallel.distributed_optimizer=true", "precision=bf16",
                               "trainer.seq_length=4096", "trainer.micro_batch_size=1",
                               "trainer.global_batch_size=4096"], world=512, backend=None)
    for r, a in enumerate(ranks):
        print(f"pp {r}: peak {a.peak / GIB:6.2f} GiB, {a.in_flight:5.2f} x {a.per_microbatch / GIB:5.2f} "
              f"GiB held, logits {a.logits / GIB:5.2f}, dispatcher {a.dispatcher / GIB:4.2f}, "
              f"working {a.working / GIB:4.2f}")
    flights = [a.in_flight for a in ranks]
    assert all(x > y for x, y in zip(flights[:-1], flights[1:]))
    assert all(a.logits == 0 for a in ranks[:-1]) and ranks[-1].logits > 0
    assert ranks[0].peak == max(a.peak for a in ranks)
