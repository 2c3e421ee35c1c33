"""The planner's checkpoint cost (planner/checkpoint.py): each factor moves the figures the way
megatron's checkpoint formats say, the save interval keeps its rules, plan.json carries a
checkpoint object per stage, and the bytes agree with the model's size.

Most tests size a synthetic shard (a GLM-5-like pipeline rank: 1B dense and 6B expert parameters
at DP x CP 16, expert-DP 4) so each factor can be moved alone; two build a tiny model's rank."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace as NS

import pytest

from planner.checkpoint import (FP32, GB, GIB, MAX_BLOCKING_SHARE, MAX_LOST_MIN, RESHARDABLE, SHARDED,
                                ShardBytes, checkpoint_cost, choose_interval, optimizer_bytes_per_element,
                                predict, rank_write)
from planner.cluster import load_cluster

KEYS = {"bytes_per_rank", "total_bytes", "host_ram_peak_gib", "blocking_s", "save_s", "load_s", "interval_min"}


def _rc(distributed=True, moments="fp32", async_save=None, tp=4, ep=16, etp=1):
    return NS(parallel=NS(distributed_optimizer=distributed, tp=tp, ep=ep, expert_tp=etp),
              optimizer=NS(exp_avg_dtype=moments, exp_avg_sq_dtype=moments),
              checkpoint=NS(async_save=async_save, save_every_minutes=0.0))


def _shard(dp=16, expert_dp=4, dense=1_000_000_000, expert=6_000_000_000, tp=4, ep=16, pp_rank=0):
    """bf16 weights, everything trainable."""
    whole = dense * tp + expert * ep
    return ShardBytes(pp_rank, dense_weights=2 * dense, expert_weights=2 * expert, dense_stepped=dense,
                      expert_stepped=expert, dense_half=dense, expert_half=expert, whole_weights=2 * whole,
                      whole_stepped=whole, whole_half=whole, largest_tensor=2 * 10 ** 8, dp=dp,
                      expert_dp=expert_dp)


def _cluster(**over):
    return load_cluster("h200_141gb", {"nodes": 64, **over})


def test_doubling_data_parallel_halves_what_a_rank_writes_and_stages():
    """Each rank writes 1/(DP x CP) of the dense weights and 1/EDP of the expert weights (the fully
    parallel wrapper spreads the replicas) and its own optimizer shard (1/DP of the state)."""
    rc = _rc()
    one, two = rank_write(rc, _shard(16, 4)), rank_write(rc, _shard(32, 8))
    assert two.writes == pytest.approx(one.writes / 2) and two.host == pytest.approx(one.host / 2)
    weights = lambda s: s.dense_weights / s.dp + s.expert_weights / s.expert_dp  # noqa: E731
    optimizer = lambda w, s: w.writes - weights(s)  # noqa: E731
    assert optimizer(two, _shard(32, 8)) == pytest.approx(optimizer(one, _shard(16, 4)) / 2)
    assert optimizer(one, _shard(16, 4)) == pytest.approx(12 * (1e9 / 16 + 6e9 / 4))
    # where the expert-DP group is larger than the DP x CP group, the group holding the main
    # replica spreads the expert weights over its own ranks
    wide = rank_write(rc, _shard(dp=4, expert_dp=8))
    assert wide.writes == pytest.approx(2e9 / 4 + 12e9 / 4 + 12 * (1e9 / 4 + 6e9 / 8))


def test_doubling_data_parallel_halves_a_real_ranks_share():
    """The tiny model's rank (fp32: the dtype of CPU runs, 4 B weights + 12 B optimizer state per
    parameter) at DP 2 and DP 4 with the distributed optimizer."""
    from pretrain.config.schema import compose, to_run_config

    rc = to_run_config(compose(["curriculum=none", "parallel.distributed_optimizer=true"]))
    dp2, dp4 = predict(rc, 2), predict(rc, 4)
    for fmt in (SHARDED, RESHARDABLE):
        assert dp4[fmt]["bytes_per_rank"] == pytest.approx(dp2[fmt]["bytes_per_rank"] / 2, abs=1)
    assert dp4["before"]["bytes_per_rank"] == dp2["before"]["bytes_per_rank"]  # the main replica wrote all
    assert dp2[SHARDED]["host_ram_peak_gib"] < dp2[RESHARDABLE]["host_ram_peak_gib"]
    cuda = predict(rc, 2, device="cuda")[SHARDED]
    assert cuda["host_ram_peak_gib"] == pytest.approx(cuda["bytes_per_rank"] / GIB)  # the staged write share


def test_bf16_moments_shrink_the_optimizer_bytes_through_the_main_params():
    """megatron saves moments through FusedAdam.get_unscaled_state (fp32 whatever their dtype);
    the precision-aware optimizer keeps bf16 parameters' main copy as int16 remainders: 10 B per
    element instead of 12. The fully_reshardable format gathers fp32 copies of all three: 12."""
    fp32, bf16 = _rc(moments="fp32"), _rc(moments="bf16")
    assert optimizer_bytes_per_element(fp32, half=True) == 3 * FP32
    assert optimizer_bytes_per_element(bf16, half=True) == 10
    assert optimizer_bytes_per_element(bf16, half=False) == 3 * FP32  # fp32 parameters: no remainders
    assert optimizer_bytes_per_element(bf16, half=True, fmt=RESHARDABLE) == 3 * FP32
    s = _shard()
    own = s.dense_stepped / s.dp + s.expert_stepped / s.expert_dp
    assert rank_write(fp32, s).writes - rank_write(bf16, s).writes == pytest.approx(2 * own)
    cost = checkpoint_cost(bf16, [s], _cluster())
    assert any("fp32" in n and "GPU memory" in n for n in cost.notes)
    # without the distributed optimizer: fp32 copies of bf16 parameters and the moments, no remainders
    assert optimizer_bytes_per_element(_rc(distributed=False), half=True) == 3 * FP32
    assert optimizer_bytes_per_element(_rc(distributed=False), half=False) == 2 * FP32


def test_more_filesystem_bandwidth_shortens_the_save_only_where_the_filesystem_is_the_bottleneck():
    rc, shards = _rc(), [_shard(pp_rank=r) for r in range(8)]
    base = checkpoint_cost(rc, shards, _cluster())
    fast = checkpoint_cost(rc, shards, _cluster(fs_write_gbps_per_node=2 * 1.94))
    write = base.save_s - base.blocking_s
    assert write == pytest.approx(base.total_bytes / (64 * 1.94 * GB))  # the aggregate is the bottleneck
    assert fast.save_s - fast.blocking_s == pytest.approx(write / 2)
    assert fast.blocking_s == base.blocking_s and fast.load_s == base.load_s
    # a filesystem faster than the nodes' clients: each node's 20 GB/s bounds the save
    client = checkpoint_cost(rc, shards, _cluster(fs_write_gbps_per_node=100.0))
    faster = checkpoint_cost(rc, shards, _cluster(fs_write_gbps_per_node=200.0))
    assert client.save_s == faster.save_s
    assert client.save_s - client.blocking_s == pytest.approx(8 * client.bytes_per_rank / (20 * GB))
    # reads: the aggregate read bandwidth bounds a load the same way
    reads = checkpoint_cost(rc, shards, _cluster(fs_read_gbps_per_node=2 * 3.9))
    assert reads.load_s < base.load_s


def test_blocking_is_the_copy_to_host_memory_at_the_staging_bandwidth():
    rc, shards = _rc(), [_shard()]
    cluster = _cluster()
    base = checkpoint_cost(rc, shards, cluster)
    fast = checkpoint_cost(rc, shards, _cluster(d2h_gbps=2 * cluster.d2h_gbps))
    assert base.blocking_s - cluster.ckpt_fixed_s == pytest.approx(base.bytes_per_rank / (cluster.d2h_gbps * GB))
    assert fast.blocking_s - cluster.ckpt_fixed_s == pytest.approx((base.blocking_s - cluster.ckpt_fixed_s) / 2)
    assert base.host_ram_peak_gib == pytest.approx(base.bytes_per_rank / GIB)
    assert base.blocking_s < base.save_s
    sync = checkpoint_cost(_rc(async_save=False), shards, cluster)
    assert not sync.async_save and sync.blocking_s == sync.save_s == pytest.approx(base.save_s)


@pytest.mark.parametrize("blocking_s, save_s", [(6.0, 91.0), (1.0, 10.0), (60.0, 300.0)])
def test_the_interval_loses_at_most_30_min_and_blocks_at_most_5_percent(blocking_s, save_s):
    minutes, notes = choose_interval(blocking_s, save_s)
    assert not notes
    assert minutes + save_s / 60 == pytest.approx(MAX_LOST_MIN)  # the longest that loses <= 30 min
    assert blocking_s / (60 * minutes) <= MAX_BLOCKING_SHARE and 60 * minutes >= save_s


def test_the_interval_keeps_its_lower_bounds_when_the_rules_conflict_and_says_so():
    minutes, notes = choose_interval(120.0, 100.0)  # 5% of the time needs 40 min between saves
    assert minutes == pytest.approx(40.0) and 120.0 / (60 * minutes) == pytest.approx(MAX_BLOCKING_SHARE)
    assert len(notes) == 1 and "40.0 min" in notes[0] and "> 30 min" in notes[0]
    minutes, notes = choose_interval(10.0, 2400.0)  # a 40-minute save: the next cannot start sooner
    assert minutes == pytest.approx(40.0) and "to reach the disk" in notes[0]


def test_the_format_before_gathered_89_gb_per_rank_and_saved_synchronously():
    """Issue 38: the H200 preset's 7.45B-parameter pipeline rank gathered 3 x 7.45B x 4 B = 89 GB of
    fp32 optimizer state into host memory on every DP rank; the main replica wrote the whole
    shard while training waited."""
    n = 7_450_000_000
    s = _shard(dense=n // 5, expert=n - n // 5)
    before = checkpoint_cost(_rc(), [s], _cluster(), RESHARDABLE, parallel=False, staging_copies_host=False)
    now = checkpoint_cost(_rc(), [s], _cluster())
    assert before.host_ram_every_rank_gib * GIB == pytest.approx(3 * n * 4)
    # the writer also cloned the slices it wrote (views of the gathered tensors) and staged its weights
    assert before.host_ram_peak_gib * GIB == pytest.approx(2 * 3 * n * 4 + 2 * n)
    assert before.bytes_per_rank == pytest.approx(14 * n, rel=1e-9) and not before.async_save
    assert before.blocking_s == before.save_s
    assert now.host_ram_peak_gib < before.host_ram_every_rank_gib / 3 and now.blocking_s < before.blocking_s / 5
    assert now.total_bytes == before.total_bytes


def test_total_bytes_are_the_models_parameters_whatever_the_layout():
    """One checkpoint holds every parameter once in its dtype (fp32: the tiny model trains in fp32
    on CPU) and, for each trainable one, the two moments plus, with the distributed optimizer, the
    fp32 main parameter (megatron's FP32Optimizer saves none: the weight is the main parameter).
    The tiny model builds its DSA indexer frozen in dense mode: weights only. At TP 1 the ranks'
    even shares add up to the checkpoint."""
    from model_providers.glm5.counting.size import model_size
    from planner.stage_plan import _rank_state, stage_checkpoint
    from pretrain.config.schema import compose, to_run_config
    from pretrain.config.validation import check_run

    for par, world, per_trained in ((["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=2"], 4, 8),
                                    (["parallel.ep=2", "parallel.distributed_optimizer=true"], 4, 12)):
        rc = to_run_config(compose(["curriculum=none", *par]))
        layout, problems = check_run(rc, world, check_paths=False)
        assert not problems, problems
        shard = _rank_state(rc, layout, 0)[2]
        total = model_size(rc.model, rc.parallel.tp).total
        assert shard.whole_weights == 4 * total and 0 < total - shard.whole_stepped < total // 10
        cost = stage_checkpoint(rc, layout, _cluster(nodes=1))
        assert cost.total_bytes == 4 * total + per_trained * shard.whole_stepped
        if rc.parallel.tp == 1:
            assert cost.bytes_per_rank * world == pytest.approx(cost.total_bytes, rel=1e-6)


def test_plan_json_has_a_checkpoint_object_per_stage(capsys, tmp_path):
    from planner.__main__ import main

    path = tmp_path / "p.json"
    code = main(["curriculum=none", "trainer.global_batch_size=32", "trainer.micro_batch_size=4",
                 "cluster=h100_80gb", "cluster.nodes=1", f"plan.json={path}"])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    stages = json.loads(path.read_text())["stages"]
    assert stages
    for s in stages:
        ck = s["checkpoint"]
        assert KEYS <= set(ck) and ck["format"] == SHARDED, ck
        assert 0 < ck["bytes_per_rank"] <= ck["total_bytes"] and ck["blocking_s"] <= ck["save_s"]
        assert ck["interval_min"] * 60 >= ck["save_s"]
        line = next(ln for ln in out.splitlines() if ln.startswith(s["name"] + " ") and "GB/rank" not in ln
                    and f"{ck['interval_min']:.1f}" in ln)
        assert f"{ck['save_s']:.1f}" in line


def test_the_cluster_filesystem_fields_are_checked_and_scale_with_nodes():
    from pretrain.config.errors import ConfigError

    small, big = load_cluster("h100_80gb", {"nodes": 32}), load_cluster("h100_80gb", {"nodes": 128})
    assert big.fs_write_gbps == pytest.approx(4 * small.fs_write_gbps)
    assert big.client_write_gbps == small.client_write_gbps
    with pytest.raises(ConfigError, match="d2h_gbps"):
        load_cluster("h100_80gb", {"d2h_gbps": 0})
    assert dataclasses.replace(big, ckpt_fixed_s=0).problems("x") == []
