"""``parallel.config``: good layouts give the right derived sizes; every bad one is refused with
problems that name the field and its value."""

from __future__ import annotations


import pytest

from parallel.config import Layout, ParallelConfig, check_layout, stage_layer_counts

#: A small MoE model that fits the layouts below unless a test overrides a field.
MODEL = dict(
    num_layers=8,
    num_attention_heads=8,
    num_experts=8,
    seq_length=1024,
    micro_batch_size=1,
    global_batch_size=64,
)


def check(par: ParallelConfig, world_size: int, **overrides) -> Layout:
    layout, problems = check_layout(par, world_size=world_size, **{**MODEL, **overrides})
    assert (layout is None) == bool(problems), (layout, problems)
    assert not problems, problems
    return layout


def assert_rejects(par: ParallelConfig, world_size: int, message: str, **overrides) -> str:
    """Assert ``check_layout`` refuses the layout with ``message`` (literal text) in a problem."""
    layout, problems = check_layout(par, world_size=world_size, **{**MODEL, **overrides})
    assert layout is None and any(message in p for p in problems), problems
    return "\n".join(problems)


# --- accepted layouts ---------------------------------------------------------------------------


def test_single_rank_defaults():
    layout = check(ParallelConfig(), 1)
    assert layout == Layout(world_size=1, dp=1, expert_dp=1, layers_per_stage=(8,))


def test_data_parallel_is_what_is_left():
    layout = check(ParallelConfig(tp=2, pp=2, sequence_parallel=True), 16)
    assert layout.dp == 4
    assert layout.expert_dp == 4  # ep=1, etp=tp=2, pp=2
    assert layout.layers_per_stage == (4, 4)


def test_context_parallel_counts_against_data_parallel():
    layout = check(ParallelConfig(cp=2), 8)
    assert layout.dp == 4
    assert layout.expert_dp == 8


def test_expert_parallel_folding_derives_expert_dp():
    layout = check(ParallelConfig(tp=2, ep=4, etp=1, sequence_parallel=True), 8)
    assert layout.dp == 4
    assert layout.expert_dp == 2  # 8 / (ep 4 * etp 1 * pp 1)


def test_expert_tp_defaults_to_tp():
    par = ParallelConfig(tp=2, ep=2, sequence_parallel=True)
    assert par.expert_tp == 2
    assert check(par, 8).expert_dp == 2  # 8 / (2 * 2 * 1)


def test_virtual_pipeline_four_layers_pp2_vpp2():
    layout = check(
        ParallelConfig(pp=2, vpp=2), 2, num_layers=4, num_experts=None, global_batch_size=8
    )
    assert layout.dp == 1
    assert layout.layers_per_stage == (1, 1, 1, 1)


def test_virtual_pipeline_model_order_with_uneven_stages():
    """Model order is (virtual stage 0: pp ranks 0..pp-1), (virtual stage 1: ...), ..."""
    layout = check(
        ParallelConfig(pp=2, vpp=2, first_stage_layers=2, last_stage_layers=4),
        2,
        num_layers=6,
        global_batch_size=8,
    )
    assert layout.layers_per_stage == (1, 2, 1, 2)


def test_uneven_first_and_last_stages_78_layers_pp8():
    layout = check(
        ParallelConfig(pp=8, first_stage_layers=8, last_stage_layers=10),
        8,
        num_layers=78,
        global_batch_size=8,
    )
    assert layout.layers_per_stage == (8, 10, 10, 10, 10, 10, 10, 10)
    assert sum(layout.layers_per_stage) == 78


def test_uneven_first_stage_only():
    layout = check(ParallelConfig(pp=4, first_stage_layers=2), 4, num_layers=11)
    assert layout.layers_per_stage == (2, 3, 3, 3)


def test_uneven_last_stage_only():
    layout = check(ParallelConfig(pp=3, last_stage_layers=1), 3, num_layers=9)
    assert layout.layers_per_stage == (4, 4, 1)


def test_interleaved_schedule_with_microbatches_a_multiple_of_pp():
    layout = check(ParallelConfig(pp=2, vpp=2), 4, global_batch_size=8)  # dp=2 -> 4 micro-batches
    assert layout.dp == 2
    assert layout.layers_per_stage == (2, 2, 2, 2)


def test_vpp_one_and_null_are_the_same():
    a = check(ParallelConfig(pp=2, vpp=1), 2)
    b = check(ParallelConfig(pp=2, vpp=None), 2)
    assert a == b and a.layers_per_stage == (4, 4)


# --- stage_layer_counts -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "num_layers, par, expected",
    [
        (4, ParallelConfig(), [4]),
        (8, ParallelConfig(pp=4), [2, 2, 2, 2]),
        (4, ParallelConfig(pp=2, vpp=2), [1, 1, 1, 1]),
        (12, ParallelConfig(pp=2, vpp=3), [2, 2, 2, 2, 2, 2]),
        (78, ParallelConfig(pp=8, first_stage_layers=8, last_stage_layers=10), [8] + [10] * 7),
        (10, ParallelConfig(pp=3, vpp=2, first_stage_layers=2), [1, 2, 2, 1, 2, 2]),
        (5, ParallelConfig(pp=2, first_stage_layers=2, last_stage_layers=3), [2, 3]),
        (6, ParallelConfig(pp=2, vpp=2, first_stage_layers=4, last_stage_layers=2), [2, 1, 2, 1]),
    ],
)
def test_stage_layer_counts(num_layers, par, expected):
    assert stage_layer_counts(num_layers, par) == expected


@pytest.mark.parametrize(
    "num_layers, par",
    [
        (8, ParallelConfig(pp=4)),
        (12, ParallelConfig(pp=2, vpp=3)),
        (78, ParallelConfig(pp=8, first_stage_layers=8, last_stage_layers=10)),
        (10, ParallelConfig(pp=3, vpp=2, first_stage_layers=2)),
        (14, ParallelConfig(pp=3, vpp=2, last_stage_layers=2)),
        (6, ParallelConfig(pp=2, vpp=2, first_stage_layers=4, last_stage_layers=2)),
    ],
)
def test_stage_layer_counts_match_megatron(num_layers, par):
    """Same split as megatron-core's own ``get_num_layers_to_build`` for every (vp stage, rank)."""
    import torch
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig

    tcfg = TransformerConfig(
        num_layers=num_layers,
        hidden_size=64,
        num_attention_heads=4,
        pipeline_model_parallel_size=par.pp,
        virtual_pipeline_model_parallel_size=par.vpp,
        num_layers_in_first_pipeline_stage=par.first_stage_layers,
        num_layers_in_last_pipeline_stage=par.last_stage_layers,
        pipeline_dtype=torch.float32,
    )
    vp_stages = [None] if par.vpp is None else list(range(par.vpp))
    megatron = [
        get_num_layers_to_build(tcfg, vp_stage=s, pp_rank=r) for s in vp_stages for r in range(par.pp)
    ]
    assert stage_layer_counts(num_layers, par) == megatron


# --- rejected layouts ---------------------------------------------------------------------------


def test_world_not_divisible_by_tp_pp_cp():
    assert_rejects(
        ParallelConfig(tp=2, pp=2, sequence_parallel=True),
        6,
        "world size 6 is not divisible by parallel.tp*pp*cp = 2*2*1 = 4",
    )


def test_world_not_divisible_by_tp_pp_cp_through_cp():
    assert_rejects(ParallelConfig(cp=4), 6, "world size 6 is not divisible by parallel.tp*pp*cp = 1*1*4 = 4")


def test_world_not_divisible_by_ep_etp_pp():
    assert_rejects(
        ParallelConfig(tp=2, ep=4, sequence_parallel=True),
        4,
        "world size 4 is not divisible by parallel.ep*etp*pp = 4*2*1 = 8",
    )


def test_world_not_divisible_by_ep_with_explicit_etp():
    assert_rejects(
        ParallelConfig(pp=2, ep=2, etp=1),
        6,
        "world size 6 is not divisible by parallel.ep*etp*pp = 2*1*2 = 4",
        global_batch_size=3,
    )


def test_heads_not_divisible_by_tp():
    assert_rejects(
        ParallelConfig(tp=4, sequence_parallel=True),
        4,
        "model.num_attention_heads=6 is not divisible by parallel.tp=4",
        num_attention_heads=6,
    )


def test_experts_not_divisible_by_ep():
    assert_rejects(
        ParallelConfig(ep=4),
        4,
        "model.num_experts=6 is not divisible by parallel.ep=4",
        num_experts=6,
    )


def test_expert_parallel_on_dense_model():
    assert_rejects(ParallelConfig(ep=2), 2, "parallel.ep=2 needs a MoE model", num_experts=None)


def test_sequence_parallel_without_tp():
    assert_rejects(
        ParallelConfig(tp=1, sequence_parallel=True),
        1,
        "parallel.sequence_parallel=true needs parallel.tp > 1",
    )


@pytest.mark.parametrize("num_experts", [8, None], ids=["moe", "dense"])
def test_tp_needs_sequence_parallel(num_experts):
    assert_rejects(
        ParallelConfig(tp=2, sequence_parallel=False),
        2,
        "parallel.tp=2 needs parallel.sequence_parallel=true",
        num_experts=num_experts,
    )


def test_seq_length_not_divisible_by_tp_under_sequence_parallel():
    assert_rejects(
        ParallelConfig(tp=2, sequence_parallel=True),
        2,
        "seq_length=1023 is not divisible by parallel.tp=2 (sequence parallel)",
        seq_length=1023,
    )


def test_seq_length_not_divisible_by_twice_cp():
    assert_rejects(ParallelConfig(cp=2), 2, "seq_length=1026 is not divisible by 2*parallel.cp=4", seq_length=1026)


def test_seq_length_divisible_by_twice_cp_is_accepted():
    assert check(ParallelConfig(cp=2), 2, seq_length=1028).dp == 1


def test_tokens_per_cp_rank_not_divisible_by_tp_under_sequence_parallel():
    assert_rejects(ParallelConfig(cp=2, tp=4, sequence_parallel=True), 8,
                   "seq_length=1036 / parallel.cp=2 = 518 tokens per CP rank is not divisible by "
                   "parallel.tp=4 (sequence parallel)", seq_length=1036)
    assert check(ParallelConfig(cp=2, tp=2, sequence_parallel=True), 4, seq_length=1036).dp == 1


def test_vpp_needs_pipeline():
    assert_rejects(ParallelConfig(pp=1, vpp=2), 1, "parallel.vpp=2 needs parallel.pp > 1")


@pytest.mark.parametrize("field", ["first_stage_layers", "last_stage_layers"])
def test_uneven_stage_needs_pipeline(field):
    assert_rejects(ParallelConfig(pp=1, **{field: 2}), 1, f"parallel.{field}=2 needs parallel.pp > 1")


@pytest.mark.parametrize("field", ["first_stage_layers", "last_stage_layers"])
def test_uneven_stage_needs_a_layer(field):
    assert_rejects(ParallelConfig(pp=2, **{field: 0}), 2, f"parallel.{field}=0 needs parallel.pp > 1 and a value >= 1")


def test_layers_not_divisible_by_stages():
    assert_rejects(
        ParallelConfig(pp=3),
        3,
        "model.num_layers=8 (minus uneven first/last stages: 0) is not divisible by the remaining "
        "3 pipeline stages (parallel.pp=3)",
    )


def test_layers_not_divisible_by_vpp():
    assert_rejects(
        ParallelConfig(pp=2, vpp=2),
        2,
        "pipeline rank 0 holds 3 layers, not divisible by parallel.vpp=2",
        num_layers=6,
        global_batch_size=8,
    )


def test_uneven_first_stage_not_divisible_by_vpp():
    assert_rejects(
        ParallelConfig(pp=2, vpp=2, first_stage_layers=3),
        2,
        "pipeline rank 0 holds 3 layers, not divisible by parallel.vpp=2",
        num_layers=7,
        global_batch_size=8,
    )


def test_middle_stage_left_without_layers():
    assert_rejects(
        ParallelConfig(pp=3, first_stage_layers=4, last_stage_layers=4),
        3,
        "pipeline rank 1 would hold 0 layers",
    )


def test_uneven_stages_not_adding_up_without_middle_stages():
    assert_rejects(
        ParallelConfig(pp=2, first_stage_layers=3, last_stage_layers=3),
        2,
        "parallel.first_stage_layers=3 + last_stage_layers=3 do not add up to model.num_layers=8 over pp=2",
    )


def test_uneven_stages_exceeding_the_model():
    assert_rejects(
        ParallelConfig(pp=4, first_stage_layers=5, last_stage_layers=5),
        4,
        "parallel.first_stage_layers=5 + last_stage_layers=5 do not add up to model.num_layers=8 over pp=4",
    )


def test_uneven_middle_layers_not_divisible():
    assert_rejects(
        ParallelConfig(pp=8, first_stage_layers=9, last_stage_layers=10),
        8,
        "model.num_layers=78 (minus uneven first/last stages: 19) is not divisible by the remaining "
        "6 pipeline stages (parallel.pp=8)",
        num_layers=78,
    )


def test_global_batch_not_divisible_by_micro_times_dp():
    assert_rejects(
        ParallelConfig(),
        4,
        "trainer.global_batch_size=10 is not divisible by trainer.micro_batch_size*dp = 2*4",
        micro_batch_size=2,
        global_batch_size=10,
    )


def test_interleaved_microbatches_not_a_multiple_of_pp():
    assert_rejects(
        ParallelConfig(pp=2, vpp=2),
        2,
        "interleaved pipeline: micro-batches per step (3) must be a multiple of parallel.pp=2",
        global_batch_size=3,
    )


def test_non_interleaved_pipeline_accepts_any_microbatch_count():
    assert check(ParallelConfig(pp=2), 2, global_batch_size=3).dp == 1


@pytest.mark.parametrize("field", ["tp", "pp", "ep", "cp"])
@pytest.mark.parametrize("value", [0, -2])
def test_non_positive_sizes(field, value):
    assert_rejects(ParallelConfig(**{field: value}), 4, f"parallel.{field}={value} must be >= 1")


@pytest.mark.parametrize("field", ["vpp", "etp"])
def test_non_positive_optional_sizes(field):
    assert_rejects(ParallelConfig(pp=2, **{field: -1}), 2, f"parallel.{field}=-1 must be >= 1 or null")


@pytest.mark.parametrize("mbs, gbs", [(0, 8), (1, -8)])
def test_non_positive_batch_sizes(mbs, gbs):
    assert_rejects(
        ParallelConfig(),
        1,
        f"trainer.micro_batch_size={mbs} and trainer.global_batch_size={gbs} must be >= 1",
        micro_batch_size=mbs,
        global_batch_size=gbs,
    )


@pytest.mark.parametrize("world_size", [0, -4])
def test_non_positive_world_size(world_size):
    assert_rejects(ParallelConfig(), world_size, f"world size {world_size} must be >= 1")


def test_every_problem_is_listed():
    msg = assert_rejects(
        ParallelConfig(tp=4, ep=4, sequence_parallel=True),
        4,
        "model.num_attention_heads=6 is not divisible by parallel.tp=4",
        num_attention_heads=6,
        num_experts=6,
        seq_length=1022,
    )
    assert "model.num_experts=6 is not divisible by parallel.ep=4" in msg
    assert "seq_length=1022 is not divisible by parallel.tp=4" in msg
    assert "world size 4 is not divisible by parallel.ep*etp*pp = 4*4*1 = 16" in msg


def test_accepted_layouts_place_every_layer_exactly_once():
    """Over a grid of pipeline layouts, ``check_layout`` either refuses or accounts for every layer."""
    accepted = 0
    for num_layers in range(1, 13):
        for pp in (1, 2, 3, 4):
            for vpp in (None, 2, 3):
                for first in (None, 1, 2, 4):
                    for last in (None, 1, 3):
                        par = ParallelConfig(pp=pp, vpp=vpp, first_stage_layers=first, last_stage_layers=last)
                        layout, _ = check_layout(par, world_size=pp, **{**MODEL, "num_layers": num_layers,
                                                                         "global_batch_size": pp * 6})
                        if layout is None:
                            continue
                        accepted += 1
                        counts = layout.layers_per_stage
                        assert sum(counts) == num_layers, (par, num_layers, counts)
                        assert len(counts) == pp * (vpp or 1)
                        assert min(counts) >= 1, (par, num_layers, counts)
    assert accepted > 50


def test_a_pipeline_rank_without_moe_layers_is_refused():
    """megatron's MoE loss all-reduce over the pipeline runs on ranks with MoE layers only: a rank
    holding only the first_k_dense layers would hang the step."""
    from pretrain.config.schema import compose, to_run_config
    from pretrain.config.validation import check_run

    base = ["curriculum=none", "parallel.pp=2", "trainer.global_batch_size=16"]
    assert check_run(to_run_config(compose(base)), 2, check_paths=False)[1] == []
    problems = check_run(to_run_config(compose([*base, "model.num_layers=2"])), 2, check_paths=False)[1]
    assert problems == ["pipeline rank 0 holds no MoE layer (its layers are among model.first_k_dense=1): "
                        "megatron's MoE loss all-reduce over the pipeline would hang; give it more layers "
                        "(parallel.first_stage_layers=None)"]
