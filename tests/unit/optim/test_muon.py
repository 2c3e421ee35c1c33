"""Muon with Muon Split (pretrain/optim/): the update against torch.optim.Muon, the per-head
blocks' orthogonality, which tiny-model parameters Muon takes and how, and config checks."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir

from pretrain.optim.matrices import MatrixSpec
from pretrain.optim.muon_adamw import MuonAdamW, MuonHyper
from pretrain.optim.newton_schulz import (SINGULAR_VALUE_BAND, orthogonalize, orthogonalized_blocks,
                                          orthogonalized_update, rms_scale)

CONF = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", "conf"))
HEADS, QK, ROPE, V, Q_LORA, KV_LORA = 4, 24, 8, 32, 64, 32  # the tiny model's MLA


def _grads(shape, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(steps)]


@pytest.mark.parametrize("scale", ["match_rms_adamw", "original"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_plain_matrix_equals_torch_muon(scale, nesterov):
    """Same hyper-parameters, same gradients, 6 steps: bit-identical weights and momentum."""
    w0 = torch.randn(48, 32, generator=torch.Generator().manual_seed(1))
    ours, ref = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    kw = dict(lr=0.02, weight_decay=0.1)
    opt = MuonAdamW([{"params": [ours], "muon": True}], matrices={ours: MatrixSpec("w", (48, 32))},
                    hyper=MuonHyper(momentum=0.9, nesterov=nesterov, ns_dtype="bf16", scale=scale), **kw)
    torch_opt = torch.optim.Muon([ref], momentum=0.9, nesterov=nesterov, adjust_lr_fn=scale, **kw)
    for g in _grads((48, 32), 6):
        ours.grad, ref.grad = g.clone(), g.clone()
        opt.step()
        torch_opt.step()
        assert torch.equal(ours.data, ref.data)
    assert torch.equal(opt.state[ours]["exp_avg"], torch_opt.state[ref]["momentum_buffer"])
    assert float(opt.state[ours]["step"]) == 6
    assert not torch.equal(ours.data, w0)


def test_fp32_iteration_is_torch_iteration_without_bf16_rounding():
    m = torch.randn(40, 64, generator=torch.Generator().manual_seed(2))
    fp32, bf16 = orthogonalize(m, 5, "fp32"), orthogonalize(m, 5, "bf16")
    assert fp32.dtype == torch.float32
    assert 0 < (fp32 - bf16).abs().max() < 0.03  # bf16 rounding only


def test_adam_groups_are_torch_adamw():
    """Non-Muon groups go through torch's AdamW untouched, next to a Muon group."""
    w0 = torch.randn(16, generator=torch.Generator().manual_seed(3))
    m0 = torch.randn(8, 8)
    a, ref, m = (torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone()),
                 torch.nn.Parameter(m0.clone()))
    kw = dict(lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opt = MuonAdamW([{"params": [a]}, {"params": [m], "muon": True}],
                    matrices={m: MatrixSpec("m", (8, 8))}, hyper=MuonHyper(), **kw)
    adamw = torch.optim.AdamW([ref], **kw)
    for g, gm in zip(_grads((16,), 4), _grads((8, 8), 4, seed=1)):
        a.grad, ref.grad, m.grad = g.clone(), g.clone(), gm
        opt.step()
        adamw.step()
    assert torch.equal(a.data, ref.data)
    assert torch.equal(opt.state[a]["exp_avg_sq"], adamw.state[ref]["exp_avg_sq"])
    assert not torch.equal(m.data, m0)


def _block_gradient(rows, cols, gen, scale):
    """rows x cols with singular values logspace(-2, 0) x scale in random directions: conditioned
    like a gradient the 5-step quintic can map into its band (singular values far below 1e-3 of
    the largest are amplified only partly, by torch's iteration as by any 5-step one)."""
    k = min(rows, cols)
    u, _ = torch.linalg.qr(torch.randn(rows, k, generator=gen))
    v, _ = torch.linalg.qr(torch.randn(cols, k, generator=gen))
    return scale * u @ torch.diag(torch.logspace(-2, 0, k)) @ v.T


def _head_gradients(shape, blocks, seed):
    """Per-head blocks stacked; head 0's first block 30x larger than the rest."""
    gen = torch.Generator().manual_seed(seed)
    parts = [_block_gradient(r, shape[1], gen, 30.0 if h == 0 and i == 0 else 1.0)
             for h in range(shape[0] // sum(blocks)) for i, r in enumerate(blocks)]
    return torch.cat(parts)


def _svals(x):
    return torch.linalg.svdvals(x.double())


@pytest.mark.parametrize("ns_dtype", ["fp32", "bf16"])
def test_every_per_head_block_of_a_split_update_is_orthogonal(ns_dtype):
    """kv_up of the tiny model: 4 heads x [K 24; V 32] rows x 32 cols; q_up: 4 x [24 + 8] x 64.
    One optimizer step with a fresh momentum: each block of -(W1 - W0) / (lr * its RMS scale) has
    its singular values in the quintic's band; whole-matrix Muon gives different blocks, and with
    one head's gradients 30x larger it leaves the other heads' blocks far from orthogonal."""
    lo, hi = SINGULAR_VALUE_BAND
    cases = {"kv_up": ((HEADS * (QK + V), KV_LORA), (QK, V)), "q_up": ((HEADS * (QK + ROPE), Q_LORA), (QK + ROPE,))}
    for shape, blocks in cases.values():
        grad = _head_gradients(shape, blocks, seed=4)
        updates = {}
        for split, block_rows in (("per_head", blocks), ("none", None)):
            w = torch.nn.Parameter(torch.zeros(shape))
            opt = MuonAdamW([{"params": [w], "muon": True}], matrices={w: MatrixSpec("w", shape, block_rows)},
                            hyper=MuonHyper(ns_dtype=ns_dtype), lr=0.1, weight_decay=0.0)
            w.grad = grad.clone()
            opt.step()
            updates[split] = -w.data / 0.1
        row, n_blocks = 0, 0
        for h in range(HEADS):
            for rows in blocks:
                split_block = updates["per_head"][row: row + rows]
                whole_block = updates["none"][row: row + rows]
                s = _svals(split_block / rms_scale((rows, shape[1]), "match_rms_adamw"))
                assert lo <= float(s.min()) and float(s.max()) <= hi, (h, rows, s)
                assert float(s.max() / s.min()) < 2.0
                if row > 0:  # whole-matrix Muon spends the update on the dominant head 0 (K)
                    s_whole = _svals(whole_block / rms_scale(shape, "match_rms_adamw"))
                    assert float(s_whole.min()) < lo, (h, rows, s_whole)
                assert (split_block - whole_block).norm() > 0.3 * split_block.norm()
                row += rows
                n_blocks += 1
        assert row == shape[0] and n_blocks == HEADS * len(blocks)


def test_split_update_is_the_blocks_orthogonalised_independently():
    m = torch.randn(HEADS * (QK + V), KV_LORA)
    full = orthogonalized_update(m, (QK, V), 5, "fp32", "match_rms_adamw")
    row = 0
    for first, o, ratio in orthogonalized_blocks(m, (QK, V), 5, "fp32", "match_rms_adamw"):
        assert first == row
        assert torch.equal(full[row: row + o.size(0)], o * ratio)
        assert torch.allclose(o, orthogonalize(m[row: row + o.size(0)], 5, "fp32"))
        row += o.size(0)
    assert row == m.size(0)
    with pytest.raises(ValueError, match=r"224 rows are not a whole number of \(24, 31\) head blocks"):
        orthogonalized_update(m, (24, 31), 5, "fp32", "match_rms_adamw")


def test_dp_assembly_gathers_on_the_parameters_device(monkeypatch):
    """The distributed optimizer's assembly is all-gathered (NCCL on GPUs) and Newton-Schulz runs
    on views of it: it is made on the device it is given (megatron's grad buffers'), not the
    host. ``meta`` stands in for the GPU; a rank without Muon shards sends its padding too."""
    from pretrain.optim.muon_adamw import DPAssembly, ShardPlacement

    gathered = []
    monkeypatch.setattr(dist, "all_gather_single", lambda out, t, group=None: gathered.append((out, t)))
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    a, b = torch.empty(2, 3, device="meta"), torch.empty(4, device="meta")
    segments = [[(0, 6), (7, 3)], [(6, 1)]]  # rank 0: a, b[1:]; rank 1: b[0]
    assembly = DPAssembly(None, 0, segments, {a: ShardPlacement(0, 6, 0, 6), b: ShardPlacement(6, 4, 1, 4)}, "meta")
    full = assembly.gather({a: a.reshape(-1), b: b[1:]})
    DPAssembly(None, 1, [[(0, 10)], []], {}, "meta").gather({})
    assert [(o.device.type, o.shape[0], t.device.type, t.shape[0]) for o, t in gathered] == [
        ("meta", 18, "meta", 9), ("meta", 20, "meta", 10)]
    assert full[a].device.type == "meta" and full[b].shape == (4,)
    with pytest.raises(ValueError, match=r"DP rank 1's Muon shards \[\] are not its segment \[\(6, 1\)\]"):
        DPAssembly(None, 1, segments, {}, "meta")


#: matrices (Muon) and a vector (Adam) in one flattened buffer of two buckets, as megatron lays out
#: a distributed optimizer's grad buffer; each bucket padded to a multiple of 4 ranks
SHAPES = {"a": (6, 5), "adam": (5,), "b": (3, 7), "c": (8, 4)}
BUCKETS = [("a", "adam"), ("b", "c")]


def _owned(size: int) -> list:
    """For each of ``size`` ranks, {name: (start, end)} of the flattened tensor it owns: each
    bucket cut into ``size`` equal contiguous shares (megatron's rule)."""
    ranks, offset = [{} for _ in range(size)], 0
    for bucket in BUCKETS:
        numel = sum(torch.Size(SHAPES[n]).numel() for n in bucket)
        padded = -(-numel // 4) * 4
        share, at = padded // size, 0
        for name in bucket:
            n = torch.Size(SHAPES[name]).numel()
            for r in range(size):
                lo, hi = max(at, r * share), min(at + n, (r + 1) * share)
                if lo < hi:
                    ranks[r][name] = (lo - at, hi - at)
            at += n
        offset += padded
    return ranks


def _dp_assembly_worker(rank: int, port: int, out: str) -> None:
    """Three Muon steps of the same matrices over DP groups of 1, 2 and 4 (real gloo): this rank's
    updated shards, for the parent to compare."""
    from datetime import timedelta

    from pretrain.optim.muon_adamw import DPAssembly, ShardPlacement

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4,
                            timeout=timedelta(seconds=60))
    groups = {size: [dist.new_group(list(range(s, s + size))) for s in range(0, 4, size)] for size in (1, 2, 4)}
    matrices = [n for n in SHAPES if len(SHAPES[n]) == 2]
    offsets = {n: sum(torch.Size(SHAPES[m]).numel() for m in matrices[:i]) for i, n in enumerate(matrices)}
    start = _start()
    g = torch.Generator().manual_seed(1)
    grads = [{n: torch.randn(SHAPES[n], generator=g) for n in matrices} for _ in range(3)]
    result = {}
    for size in (1, 2, 4):
        group, me = groups[size][rank // size], rank % size
        owned = _owned(size)
        segments = [[(offsets[n] + lo, hi - lo) for n, (lo, hi) in ranks.items() if n in offsets] for ranks in owned]
        shards = {n: torch.nn.Parameter(start[n].reshape(-1)[lo:hi].clone())
                  for n, (lo, hi) in owned[me].items() if n in offsets}
        placements = {shards[n]: ShardPlacement(offsets[n], start[n].numel(), lo, hi)
                      for n, (lo, hi) in owned[me].items() if n in offsets}
        opt = MuonAdamW([{"params": list(shards.values()), "muon": True, "lr": 0.02, "weight_decay": 0.1}],
                        matrices={shards[n]: MatrixSpec(n, SHAPES[n]) for n in shards}, hyper=MuonHyper(),
                        assembly=DPAssembly(group, me, segments, placements, "cpu"))
        for step in grads:
            for n, p in shards.items():
                lo, hi = owned[me][n]
                p.grad = step[n].reshape(-1)[lo:hi].clone()
            opt.step()
        result[size] = {n: (owned[me][n], p.detach().clone()) for n, p in shards.items()}
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.heavy
def test_dp_assembly_updates_are_bitwise_the_same_at_dp1_dp2_and_dp4(tmp_path):
    """The all-gather brings each rank exactly the other ranks' direction shards: three Muon
    steps give bit-identical matrices whether one rank owns them or 2 or 4 share them (shards
    that cut matrices, a bucket boundary, an Adam vector between them)."""
    from parallel.initialize import free_port

    ctx = torch.multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.conftest", __name__])  # bootstrap(), then one import of this module,
    # in a fresh process the 4 ranks are forked from
    torch.multiprocessing.start_processes(_dp_assembly_worker, args=(free_port(), str(tmp_path)), nprocs=4,
                                          start_method="forkserver")
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(4)]
    start = _start()
    for name in ("a", "b", "c"):
        reference = results[0][1][name][1]  # rank 0 alone
        assert not torch.equal(reference, start[name].reshape(-1))  # the steps moved the weights
        for size in (1, 2, 4):
            for first in range(0, 4, size):  # each DP group of that size
                whole, covered = torch.zeros_like(reference), 0
                for rank in range(first, first + size):
                    if name in results[rank][size]:
                        (lo, hi), shard = results[rank][size][name]
                        whole[lo:hi] = shard
                        covered += hi - lo
                assert covered == whole.numel(), (size, name)
                assert torch.equal(whole, reference), (size, first, name)


def _start() -> dict:
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(SHAPES[n], generator=g) for n in SHAPES if len(SHAPES[n]) == 2}


# --- config ---------------------------------------------------------------------------------------


def _rc(*overrides):
    from pretrain.config.schema import register, to_run_config

    register()
    with initialize_config_dir(config_dir=CONF, version_base=None):
        return to_run_config(compose("config", overrides=list(overrides)))


def test_optimizer_presets_compose():
    rc = _rc("optimizer=muon_split")
    assert rc.optimizer.name == "muon" and rc.optimizer.muon.split == "per_head"
    assert (rc.optimizer.lr, rc.optimizer.min_lr) == (2e-4, 4e-5)  # GLM-5 pre-training
    assert (rc.optimizer.muon.lr, rc.optimizer.muon.min_lr) == (2e-4, 4e-5)
    assert _rc("optimizer=muon").optimizer.muon.split == "none"
    assert _rc("optimizer=adam").optimizer.name == "adam"


@pytest.mark.parametrize("override, message", [
    ("optimizer.muon.split=per_layer", "optimizer.muon.split='per_layer' must be one of none, per_head"),
    ("optimizer.muon.ns_dtype=fp16", "optimizer.muon.ns_dtype='fp16' must be one of fp32, bf16"),
    ("optimizer.muon.scale=spectral", "optimizer.muon.scale='spectral' must be one of match_rms_adamw, original"),
    ("optimizer.muon.momentum=1.0", "optimizer.muon.momentum=1.0 must be in [0, 1)"),
    ("optimizer.muon.ns_steps=0", "optimizer.muon.ns_steps=0 must be in [1, 99]"),
    ("optimizer.muon.min_lr=0.001", "optimizer.muon.min_lr=0.001 must be in [0, optimizer.muon.lr=0.0002]"),
    ("optimizer.muon.weight_decay=-0.1", "optimizer.muon.weight_decay=-0.1 must be a finite number >= 0"),
    ("optimizer.name=lion", "optimizer.name='lion' must be one of adam, muon"),
])
def test_muon_misconfiguration_is_rejected_before_compute(override, message):
    from pretrain.config.validation import ConfigError, plan_run

    with pytest.raises(ConfigError) as e:
        plan_run(_rc("curriculum=none", "optimizer=muon_split", override), 1)
    assert message in str(e.value)
    assert not dist.is_initialized()


def test_state_without_per_parameter_step_resumes_from_the_group_step():
    """megatron's distributed optimizer saves the step in the param groups (not per parameter)
    when Transformer Engine / Apex is installed; loading such a state continues exactly."""
    def make():
        gen = torch.Generator().manual_seed(5)
        a, m = torch.nn.Parameter(torch.randn(16, generator=gen)), torch.nn.Parameter(torch.randn(8, 8, generator=gen))
        opt = MuonAdamW([{"params": [a]}, {"params": [m], "muon": True}], matrices={m: MatrixSpec("m", (8, 8))},
                        hyper=MuonHyper(), lr=0.01, weight_decay=0.1)
        return a, m, opt

    grads = list(zip(_grads((16,), 4), _grads((8, 8), 4, seed=1)))
    a, m, opt = make()
    for ga, gm in grads:
        a.grad, m.grad = ga.clone(), gm.clone()
        opt.step()
    a2, m2, opt2 = make()
    for ga, gm in grads[:2]:
        a2.grad, m2.grad = ga.clone(), gm.clone()
        opt2.step()
    sd = opt2.state_dict()
    assert [g["step"] for g in sd["param_groups"]] == [2, 2]
    for s in sd["state"].values():
        del s["step"]
    a3, m3, opt3 = make()
    a3.data.copy_(a2.data)
    m3.data.copy_(m2.data)
    opt3.load_state_dict(sd)
    for ga, gm in grads[2:]:
        a3.grad, m3.grad = ga.clone(), gm.clone()
        opt3.step()
    assert torch.equal(a3.data, a.data) and torch.equal(m3.data, m.data)
    assert float(opt3.state[a3]["step"]) == 4
