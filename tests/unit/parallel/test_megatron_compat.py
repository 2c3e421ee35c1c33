"""One test per fix in ``parallel/megatron_compat`` (the every-backend fixes; the CPU emulation's
are in ``test_cpu_emulation.py``): each reproduces the upstream behaviour the fix changes, so a
megatron-core upgrade shows which fix to re-check."""

from __future__ import annotations

import ast
import contextlib
import gc
import os
import subprocess
import sys
import time
import weakref
from types import SimpleNamespace

import pytest
import torch

from parallel import megatron_compat
from parallel.megatron_compat import fixes

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


# --- install ------------------------------------------------------------------------------------


def test_install_refuses_another_megatron_core_version_naming_the_files(monkeypatch):
    from megatron.core import package_info

    from parallel.megatron_compat import distrib_optimizer, micro_batch, mtp

    monkeypatch.setattr(package_info, "__version__", "0.17.0")
    monkeypatch.setattr(fixes, "_INSTALLED", False)
    with pytest.raises(RuntimeError, match=r"written for megatron-core 0\.19\.2, found 0\.17\.0") as err:
        megatron_compat.install()
    for patched in (fixes, distrib_optimizer, mtp, micro_batch):
        assert patched.__file__ in str(err.value)


@pytest.mark.heavy
def test_install_outside_the_cpu_emulation_installs_every_backend_fix():
    """What a GPU rank gets: ``megatron_compat.install()`` alone (a fresh interpreter in which the
    CPU emulation is never installed) patches the distributed optimizer, MTP's rolls, the
    checkpoint writer's queue and the recomputations (under their micro-batch)."""
    probe = """
import queue
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.transformer import multi_token_prediction
from parallel import megatron_compat
from parallel.megatron_compat import cpu_emulation, mtp
from megatron.core.extensions import transformer_engine
from megatron.core.tensor_parallel.random import CheckpointFunction
from megatron.core.transformer.attention import Attention
assert filesystem_async._results_queue is None
megatron_compat.install()
assert not cpu_emulation.is_active()
names = [DistributedOptimizer.load_state_dict.__code__.co_name,
         DistributedOptimizer.sharded_state_dict.__code__.co_name,
         DistributedOptimizer._set_main_param_and_optimizer_states.__code__.co_name]
assert names == ["load_state_dict_with_own_steps", "sharded_state_dict_with_state",
                 "set_states_keeping_step"], names
assert multi_token_prediction.roll_tensor is mtp.roll_with_sequence_count
assert type(filesystem_async._results_queue) is queue.Queue
assert DistributedOptimizer.load_parameter_state_from_dp_reshardable.__code__.co_name == "load_dp_reshardable_without_grad"
assert DistributedOptimizer._filter_and_reorder_param_groups.__code__.co_name == "filter_and_reorder_by_structure"
assert DistributedOptimizer.sharded_param_state_dp_reshardable.__code__.co_name == "sharded_with_zero_padding"
assert filesystem_async.FileSystemWriterAsync.preload_tensors.__code__.co_name == "preload_into_shared_memory"
assert CheckpointFunction.forward.__name__ == "forward_in_micro_batch"
assert Attention._checkpointed_attention_forward.__code__.co_name == "checkpointed_attention_forward"
assert transformer_engine.te_checkpoint.__code__.co_name == "checkpoint_in_micro_batch"
from megatron.core.pipeline_parallel import p2p_communication
assert p2p_communication._batched_p2p_ops.__code__.co_name == "batched_p2p_ops"
print("ok")
"""
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", probe], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def _tiny_moe_model_after_one_step():
    """A tiny GLM-5 (MoE layers, alltoall dispatcher) under megatron DDP after one forward and
    backward; returns weak references to the model and the DDP wrapper."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from model_providers.glm5.model.config import GLM5Config, to_transformer_config
    from model_providers.glm5.model.provider import build_model_chunks
    from parallel.config import ParallelConfig
    from model_providers.glm5.model.config import PrecisionConfig

    cfg = GLM5Config()
    tcfg = to_transformer_config(cfg, ParallelConfig(), PrecisionConfig())
    (chunk,) = build_model_chunks(cfg, tcfg, "local")
    ddp = DistributedDataParallel(config=tcfg, ddp_config=DistributedDataParallelConfig(), module=chunk)
    tokens = torch.randint(0, cfg.vocab_size, (2, 32))
    positions = torch.arange(32).expand(2, 32)
    loss = ddp(tokens, positions, None, labels=tokens, loss_mask=torch.ones(2, 32))
    loss.sum().backward()
    return weakref.ref(chunk), weakref.ref(ddp)


def test_a_trained_moe_model_is_freed_once_dropped(one_rank):
    """Without the fix the alltoall dispatcher's ``probs`` keep the autograd history, whose
    gradient-accumulator hooks hold megatron's DDP, alive: the model outlives every reference."""
    model, ddp = _tiny_moe_model_after_one_step()
    gc.collect()
    assert model() is None and ddp() is None


def test_rotary_embedding_caches_release_their_modules(one_rank):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    rope = RotaryEmbedding(kv_channels=16, rotary_percent=1.0)
    rope(8)
    ref = weakref.ref(rope)
    del rope
    gc.collect()
    assert ref() is not None  # megatron's lru_cache on forward holds the module
    megatron_compat.release_cached_modules()
    gc.collect()
    assert ref() is None


def test_loss_trackers_are_dropped_not_just_zeroed():
    """megatron's own clear keeps a tracker's entry (zeroed): the next model in the process
    would report it; the reset drops it."""
    import torch
    from megatron.core.transformer.moe import moe_logging

    tracker = moe_logging.get_moe_metrics_tracker()
    tracker.record("indexer_kl", torch.tensor(0.5), 1, 2)
    tracker.clear()
    assert float(tracker.metrics["indexer_kl"].values.sum()) == 0.0  # upstream: still there, zeroed
    megatron_compat.reset_loss_trackers()
    assert "indexer_kl" not in moe_logging.get_moe_metrics_tracker().metrics


def test_mla_have_te_is_false_without_transformer_engine():
    megatron_compat.install()
    from megatron.core.transformer import multi_latent_attention

    assert multi_latent_attention.HAVE_TE is False


def test_moe_utils_te_general_gemm_is_none_and_router_gemm_falls_back():
    megatron_compat.install()
    from megatron.core.transformer.moe import moe_utils

    assert moe_utils.te_general_gemm is None
    torch.manual_seed(0)
    inp = torch.randn(2, 3, 8)
    weight = torch.randn(4, 8)
    out = moe_utils.router_gating_linear(inp, weight, None, torch.float32)
    assert out.shape == (2, 3, 4)
    torch.testing.assert_close(out, inp @ weight.t())


# --- distributed optimizer around torch's AdamW (no TE / Apex FusedAdam) -------------------------


class _FakeDistOpt:
    """The attributes of megatron's DistributedOptimizer that the patched methods use, around a
    real torch AdamW with one (shard) parameter. ``fused_adam``: its state keeps no ``step``, as
    TE's / Apex's FusedAdam (step in the param groups)."""

    def __init__(self, stepped: bool, fused_adam: bool = False):
        self.param = torch.nn.Parameter(torch.zeros(4))
        self.optimizer = torch.optim.AdamW([self.param], lr=0.1)
        if stepped:
            self.param.grad = torch.ones(4)
            self.optimizer.step()
            if fused_adam:
                self.optimizer.param_groups[0]["step"] = int(self.optimizer.state[self.param].pop("step"))
        self.model_param_group_index_map = {"model_param": (0, 0)}
        self.config = SimpleNamespace(use_precision_aware_optimizer_no_fp8_or_ds_fp8=False)
        self.ddp_config = SimpleNamespace(use_megatron_fsdp=True)  # shortest path through the original
        self.is_stub_optimizer = False
        self.primed = False

    def _init_optimizer_states_with_dummy_values(self):
        self.primed = True
        self.param.grad = torch.zeros(4)
        self.optimizer.step()

    def sharded_param_state_fsdp_dtensor(self, is_loading):
        return {k: v.clone() for k, v in self.optimizer.state[self.param].items()}


_FSDP_META = {"distrib_optim_sharding_type": "fsdp_dtensor"}


def test_distributed_optimizer_loading_into_a_fresh_torch_adam_gets_placeholder_state():
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    megatron_compat.install()
    fresh = _FakeDistOpt(stepped=False)
    state = DistributedOptimizer.sharded_state_dict(fresh, {}, is_loading=True, metadata=_FSDP_META)
    assert fresh.primed and set(state) == {"step", "exp_avg", "exp_avg_sq"}
    stepped = _FakeDistOpt(stepped=True)
    DistributedOptimizer.sharded_state_dict(stepped, {}, is_loading=True, metadata=_FSDP_META)
    assert not stepped.primed  # existing state is left alone
    saving = _FakeDistOpt(stepped=False)
    assert DistributedOptimizer.sharded_state_dict(saving, {}, is_loading=False, metadata=_FSDP_META) == {}
    assert not saving.primed


def test_distributed_optimizer_state_load_keeps_torch_adam_step():
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    megatron_compat.install()
    opt = _FakeDistOpt(stepped=True)
    step = opt.optimizer.state[opt.param]["step"]
    loaded = {"param": torch.full((4,), 2.0), "exp_avg": torch.full((4,), 3.0), "exp_avg_sq": torch.full((4,), 4.0)}
    with torch.no_grad():  # as megatron's loaders call it
        DistributedOptimizer._set_main_param_and_optimizer_states(opt, "model_param", loaded)
    state = opt.optimizer.state[opt.param]
    assert torch.equal(opt.param.data, loaded["param"])
    assert torch.equal(state["exp_avg"], loaded["exp_avg"]) and torch.equal(state["exp_avg_sq"], loaded["exp_avg_sq"])
    assert state["step"] is step and float(step) == 1
    original = DistributedOptimizer._set_main_param_and_optimizer_states.__wrapped__
    with pytest.raises(KeyError, match="step"), torch.no_grad():  # megatron-core 0.19.2 unpatched
        original(opt, "model_param", loaded)


def test_distributed_optimizer_fixes_leave_fused_adam_alone(monkeypatch):
    """Under TE / Apex (FusedAdam: no per-parameter step) a fresh optimizer is not stepped with
    placeholder gradients before a load, and state loads are megatron's own."""
    from megatron.core.optimizer import distrib_optimizer

    megatron_compat.install()
    monkeypatch.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", True)
    fresh = _FakeDistOpt(stepped=False)
    distrib_optimizer.DistributedOptimizer.sharded_state_dict(fresh, {}, is_loading=True, metadata=_FSDP_META)
    assert not fresh.primed and not any(fresh.optimizer.state.values())
    opt = _FakeDistOpt(stepped=True, fused_adam=True)
    loaded = {"param": torch.full((4,), 2.0), "exp_avg": torch.full((4,), 3.0), "exp_avg_sq": torch.full((4,), 4.0)}
    with torch.no_grad():
        distrib_optimizer.DistributedOptimizer._set_main_param_and_optimizer_states(opt, "model_param", loaded)
    assert set(opt.optimizer.state[opt.param]) == {"exp_avg", "exp_avg_sq"}
    assert torch.equal(opt.optimizer.state[opt.param]["exp_avg_sq"], loaded["exp_avg_sq"])
    stepless = _FakeDistOpt(stepped=False)  # torch's SGD keeps no step either
    stepless.optimizer = torch.optim.SGD([stepless.param], lr=0.1, momentum=0.9)
    stepless.param.grad = torch.ones(4)
    stepless.optimizer.step()
    momentum = stepless.optimizer.state[stepless.param]["momentum_buffer"].clone()
    distrib_optimizer.DistributedOptimizer.load_state_dict(stepless, stepless.optimizer.state_dict())
    assert set(stepless.optimizer.state[stepless.param]) == {"momentum_buffer"}
    assert torch.equal(stepless.optimizer.state[stepless.param]["momentum_buffer"], momentum)


def _distributed_adam_after_one_step():
    """megatron's distributed optimizer (torch AdamW inside: no TE / Apex here) over a tiny GLM-5
    under megatron DDP, after one step; its DistributedOptimizer(s)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from model_providers.glm5.model.config import GLM5Config, PrecisionConfig, to_transformer_config
    from model_providers.glm5.model.provider import build_model_chunks
    from parallel.config import ParallelConfig

    cfg = GLM5Config()
    tcfg = to_transformer_config(cfg, ParallelConfig(), PrecisionConfig())
    (chunk,) = build_model_chunks(cfg, tcfg, "local")
    ddp = DistributedDataParallel(config=tcfg, module=chunk,
                                  ddp_config=DistributedDataParallelConfig(use_distributed_optimizer=True))
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-3, use_distributed_optimizer=True), [ddp])
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(16).expand(2, 16)
    ddp(tokens, positions, None, labels=tokens, loss_mask=torch.ones(2, 16)).sum().backward()
    ddp.finish_grad_sync()
    assert optimizer.step()[0]
    return getattr(optimizer, "chained_optimizers", [optimizer])


def _steps_after_load_and_one_step(opt, load) -> list:
    load(opt, opt.state_dict())
    steps = [state["step"] for state in opt.optimizer.state.values()]
    assert len(steps) > 1
    shared = len({id(s) for s in steps}) == 1
    for p in (p for g in opt.optimizer.param_groups for p in g["params"]):
        p.grad = torch.zeros_like(p)
    opt.optimizer.step()
    return shared, sorted({float(s) for s in steps})


def test_saved_param_groups_match_a_new_stages_schedule():
    """A curriculum stage loads its predecessor's groups under its own learning rates: megatron
    0.19 matched groups by their ``max_lr`` too and found none; they match by structure."""
    from megatron.core.optimizer.optimizer import MegatronOptimizer

    megatron_compat.install()

    def group(max_lr, wd_mult, params):
        return {"params": params, "max_lr": max_lr, "min_lr": max_lr / 10, "wd_mult": wd_mult,
                "lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False}

    saved = [group(2e-3, 0.0, [0]), group(2e-3, 1.0, [1, 2])]
    current = [group(1e-3, 1.0, ["w"]), group(1e-3, 0.0, ["b"])]  # the next stage, other order
    matched = MegatronOptimizer._filter_and_reorder_param_groups(current, saved)
    assert [g["wd_mult"] for g in matched] == [1.0, 0.0]  # paired by structure
    assert [g["params"] for g in matched] == [[0], [1, 2]]  # the saved order of the state's params
    with pytest.raises(ValueError, match="Could not find parameter group"):  # structure still counts
        MegatronOptimizer._filter_and_reorder_param_groups([group(1e-3, 0.5, ["w"])], saved[:1])


def test_distributed_optimizer_load_gives_each_parameter_its_own_adam_step(one_rank):
    """megatron's load_state_dict (torch AdamW) restores one step tensor for every parameter's
    state; each parameter's update then increments it: after one step past a load it read
    1 + (parameters) instead of 2."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    opt = _distributed_adam_after_one_step()[0]
    assert isinstance(opt, DistributedOptimizer) and isinstance(opt.optimizer, torch.optim.AdamW)
    assert _steps_after_load_and_one_step(opt, DistributedOptimizer.load_state_dict) == (False, [2.0])
    n = len(opt.optimizer.state)
    unpatched = DistributedOptimizer.load_state_dict.__wrapped__
    assert _steps_after_load_and_one_step(opt, unpatched) == (True, [2.0 + n])


# --- MTP rolls ----------------------------------------------------------------------------------


def test_mtp_loss_count_of_a_depth_without_loss_tokens_is_one_not_zero():
    """megatron divides a depth's summed MTP loss by this count: 0 gave 0/0 = NaN (0.16.1; 0.17+
    clamps it too, so both hold to it)."""
    from megatron.core.transformer import multi_token_prediction

    from parallel.megatron_compat import mtp

    megatron_compat.install()
    mask = torch.zeros(2, 6)
    _, upstream = mtp._UPSTREAM_ROLL[0](mask, shifts=-1, dims=-1)
    assert float(upstream) == 0
    rolled, count = multi_token_prediction.roll_tensor(mask, shifts=-1, dims=-1)
    assert float(count) == 1 and torch.equal(rolled, mask)
    _, count = multi_token_prediction.roll_tensor(torch.ones(2, 6), shifts=-1, dims=-1)
    assert float(count) == 10  # megatron's own count where there are loss tokens


def test_mtp_rolls_stop_at_document_boundaries(one_rank):
    from megatron.core.transformer import multi_token_prediction

    megatron_compat.install()
    ids = torch.tensor([[0, 0, 0, 1, 1], [0, 1, 1, 1, 2]])
    tokens = torch.arange(1.0, 11.0).reshape(2, 5)
    crossing, _ = multi_token_prediction.roll_tensor(tokens, shifts=-1, dims=-1)
    assert crossing.tolist() == [[2, 3, 4, 5, 0], [7, 8, 9, 10, 0]]
    with megatron_compat.MicroBatch(ids).active():
        inside, _ = multi_token_prediction.roll_tensor(tokens, shifts=-1, dims=-1)
        _, count = multi_token_prediction.roll_tensor(torch.ones(2, 5), shifts=-1, dims=-1)
    assert inside.tolist() == [[2, 3, 0, 5, 0], [0, 8, 9, 0, 0]]
    assert float(count) == 5


def test_mtp_block_class_must_add_no_state():
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock

    class WithState(MultiTokenPredictionBlock):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)

    with pytest.raises(TypeError, match="WithState must subclass MultiTokenPredictionBlock without"):
        megatron_compat.set_mtp_block_class(SimpleNamespace(mtp=None), WithState)
    with pytest.raises(TypeError, match="not the MultiTokenPredictionBlock"):
        megatron_compat.set_mtp_block_class(SimpleNamespace(mtp=torch.nn.Linear(1, 1)),
                                            type("Shared", (MultiTokenPredictionBlock,), {}))


def test_checkpoint_write_results_stay_in_process():
    """Without the fix megatron's first save starts a *spawned* Manager (a fresh interpreter that
    re-imports the entry point). Saves report through an in-process queue (an async save's
    writer process sends its results back with its completion: tests/e2e/test_async_writer_process.py
    and tests/unit/checkpointing/test_save_failures.py)."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    megatron_compat.install()
    in_process = filesystem_async.get_write_results_queue()
    assert type(in_process) is queue.Queue
    assert filesystem_async.get_write_results_queue() is in_process



@pytest.mark.parametrize("buckets", [1, 3])  # the writing thread's own bucket; and worker threads'
def test_a_failed_bucket_write_reaches_finalize_with_its_errno(tmp_path, buckets):
    """0.19.2's writer asserts that every bucket's outcome is a list: a failed write's error became
    ``"... error: <class 'FileNotFoundError'>"`` (one bucket) or an AssertionError out of the
    writer (several). With ``bucket_writes`` the retrieved result is megatron's wrapped worker
    failure naming the errno, caused by the OSError; writes that succeed still return results."""
    import queue

    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
    megatron_compat.install()

    def written(missing: set) -> object:
        writer = FileSystemWriterAsync(str(tmp_path), thread_count=buckets)
        writer.write_buckets = [(str(tmp_path / ("missing" if i in missing else ".") / f"{i}.distcp"), f"{i}_",
                                 ([], [])) for i in range(buckets)]
        writer.results_queue = queue.Queue()
        FileSystemWriterAsync.write_preloaded_data_multithread([], False, 0, writer.write_buckets,
                                                               writer.results_queue)
        return writer.retrieve_write_results()

    assert written(set()) == []  # empty buckets: no write results, and no failure
    for failing in ({0}, {buckets - 1}):
        result = written(failing)
        assert isinstance(result, tuple), result  # torch's WRAPPED_EXCEPTION: (exception, traceback)
        error, _ = result
        assert str(error).startswith("Worker failure: [Errno 2] No such file or directory"), error
        assert isinstance(error.__cause__, FileNotFoundError)

def test_checkpoint_staging_is_a_shared_memory_snapshot_reused_by_the_next_save():
    """A save's staged tensors are a snapshot (changing the training tensor after staging does not
    change what is written), in shared memory (the spawned writer gets them without a copy), and
    the next save of the same structure stages into the same buffers (no new host memory)."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    from parallel.megatron_compat import cpu_emulation

    megatron_compat.install()
    cpu_emulation.install()  # a CPU rank's
    live, other = torch.arange(6.0), torch.ones(2, 3, dtype=torch.bfloat16)
    buckets = [("f.distcp", "k", ([], [("item", live), ("other", other)]))]
    [(name, key, (data, [(item, staged), (_, staged_other)]))] = FileSystemWriterAsync.preload_tensors(
        buckets, non_blocking=False)
    live.add_(100.0)  # the next optimizer step
    assert (name, key, item) == ("f.distcp", "k", "item")
    assert torch.equal(staged, torch.arange(6.0)) and torch.equal(staged_other, other)
    assert staged.untyped_storage().data_ptr() != live.untyped_storage().data_ptr()
    assert staged.is_shared() and staged_other.is_shared() and staged_other.dtype == torch.bfloat16
    [(_, _, (_, [(_, again), _]))] = FileSystemWriterAsync.preload_tensors(buckets, non_blocking=False)
    assert torch.equal(again, torch.arange(6.0) + 100.0)
    assert again.data_ptr() == staged.data_ptr()  # the same buffer, refilled


# --- batched pipeline exchanges between the two ranks of a PP2 group (2 real gloo ranks) ----------


def _pp2_exchange_worker(rank: int, port: int) -> None:
    """Each rank sends activations (10 + rank) to the next stage and gradients (20 + rank) to the
    previous one in one batch, as the interleaved schedule's 1F1B steps do; the previous and
    next rank are the one other rank. Megatron's order crosses them; the fix's pairs them."""
    from datetime import timedelta

    import torch.distributed as dist
    from megatron.core.pipeline_parallel import p2p_communication

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        fixed = p2p_communication._batched_p2p_ops
        upstream = getattr(fixed, "__wrapped__", fixed)
        fixes._batched_p2p_pairs_same_peer_by_direction()
        fixed, peer = p2p_communication._batched_p2p_ops, 1 - rank
        got = {}
        for name, ops in (("upstream", upstream), ("fixed", fixed)):
            recv_prev, recv_next = torch.empty(3), torch.empty(3)
            for req in ops(tensor_send_prev=torch.full((3,), 20.0 + rank), tensor_recv_prev=recv_prev,
                           tensor_send_next=torch.full((3,), 10.0 + rank), tensor_recv_next=recv_next,
                           group=dist.group.WORLD, prev_pipeline_rank=peer, next_pipeline_rank=peer):
                req.wait()
            got[name] = (recv_prev[0].item(), recv_next[0].item())
        want = (10.0 + peer, 20.0 + peer)  # the previous stage's activations, the next one's grads
        assert got["upstream"] == want[::-1], f"rank {rank}: megatron's order no longer crosses: {got}"
        assert got["fixed"] == want, f"rank {rank}: {got}"
    finally:
        dist.destroy_process_group()


@pytest.mark.heavy
def test_batched_exchange_between_two_pipeline_ranks_pairs_activations_and_gradients():
    """Both ranks are spawned processes (this one may hold a one-rank process group)."""
    from parallel.initialize import free_port

    ctx = torch.multiprocessing.start_processes(
        _pp2_exchange_worker, args=(free_port(),), nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + 120
    try:
        while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):  # raises a rank's failure
            if time.monotonic() > deadline:  # (join returns as each rank ends)
                pytest.fail("the two ranks did not finish within 120 s")
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()


# --- meta_rank: megatron's parallel state for a meta build -----------------------------------------


def _parallel_state_snapshot() -> dict:
    import re

    from megatron.core import parallel_state as ps

    return {k: v for k, v in vars(ps).items() if re.match(r"^_[A-Z][A-Z0-9_]*$", k)}


@pytest.mark.parametrize("fail_inside", [False, True])
def test_rank_position_sets_megatrons_sizes_and_restores_every_global(fail_inside):
    """Inside: megatron's own getters answer the layout's sizes and this rank's pipeline index,
    ``torch.distributed`` looks initialised and ``torch.cuda.current_device()`` is ``meta``. On
    exit (also through an exception): every parallel_state global is the object it was, none is
    added, and the default group and ``current_device`` are torch's again."""
    from torch.distributed.distributed_c10d import GroupMember

    world, GroupMember.WORLD = GroupMember.WORLD, None  # no process group, as in the planner CLI
    try:
        _check_rank_position(fail_inside)
    finally:
        GroupMember.WORLD = world


def _check_rank_position(fail_inside: bool) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from torch.distributed.distributed_c10d import GroupMember

    from parallel.megatron_compat import cpu_emulation, meta_rank

    cpu_emulation.install()  # what rank_position installs first on CPU, and leaves (as every CPU run)
    before, device = _parallel_state_snapshot(), torch.cuda.current_device
    sizes = dict(tp=2, pp=4, cp=2, dp=3, ep=4, expert_tp=1, expert_dp=6, world_size=96, vpp=2)
    with pytest.raises(KeyError) if fail_inside else contextlib.nullcontext():
        with meta_rank.rank_position(**sizes, pp_rank=3):
            assert dist.is_initialized() and GroupMember.WORLD.size() == 96
            assert torch.cuda.current_device() == torch.device("meta")
            assert ps.get_tensor_model_parallel_world_size() == 2
            assert ps.get_tensor_model_parallel_rank() == 0
            assert ps.get_pipeline_model_parallel_world_size() == 4
            assert ps.get_pipeline_model_parallel_rank() == 3
            assert ps.get_pipeline_model_parallel_group().rank() == 3
            assert ps.get_virtual_pipeline_model_parallel_world_size() == 2
            assert ps.get_context_parallel_world_size() == 2
            assert ps.get_data_parallel_world_size() == 3
            assert ps.get_data_parallel_group(with_context_parallel=True).size() == 6
            assert ps.get_expert_model_parallel_world_size() == 4
            assert ps.get_expert_data_parallel_world_size() == 6
            assert ps.get_embedding_group(check_initialized=False) is None  # untied: no all-reduce
            ps._ADDED_BY_A_BUILD = 1
            if fail_inside:
                raise KeyError("a build that fails")
    after = _parallel_state_snapshot()
    assert after.keys() == before.keys()
    assert [k for k in before if after[k] is not before[k]] == []
    assert GroupMember.WORLD is None and not dist.is_initialized()
    assert torch.cuda.current_device is device


def test_rank_position_keeps_an_existing_default_group(one_rank):
    """With a real process group (a training process planning) the default group stays it."""
    from torch.distributed.distributed_c10d import GroupMember

    from parallel.megatron_compat import meta_rank

    world = GroupMember.WORLD
    with meta_rank.rank_position(tp=1, pp=2, cp=1, dp=8, ep=1, expert_tp=1, expert_dp=8,
                                 world_size=16, pp_rank=1):
        assert GroupMember.WORLD is world
    assert GroupMember.WORLD is world
    with pytest.raises(ValueError, match="pp_rank=2 is not a pipeline rank of pp=2"):
        with meta_rank.rank_position(tp=1, pp=2, cp=1, dp=8, ep=1, expert_tp=1, expert_dp=8,
                                     world_size=16, pp_rank=2):
            pass


# --- optimizer_wrappers: what an optimizer replacing megatron's inner one reads of its wrappers ----


def _fp32_wrapper(groups):
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import FP32Optimizer

    return FP32Optimizer(torch.optim.AdamW(groups, lr=1e-3), OptimizerConfig(lr=1e-3), lambda opt, cfg: None)


def _groups(**differ):
    """Two param groups with megatron's identifier keys; ``differ``: the second group's keys."""
    keys = dict(wd_mult=1.0, lr_mult=1.0, is_expert_parallel=False, is_decoupled_lr=False)
    return [dict(params=[torch.nn.Parameter(torch.ones(3, 2)), torch.nn.Parameter(torch.ones(4))], **keys),
            dict(params=[torch.nn.Parameter(torch.ones(2, 2))], **{**keys, **differ})]


def test_replace_inner_optimizer_keeps_megatrons_groups(one_rank):
    """The new inner optimizer steps megatron's very group dicts and parameters: the wrapper's
    param_groups (what the LR scheduler sets) are its groups, and its main parameters are the
    model parameters (fp32, no distributed optimizer)."""
    from parallel.megatron_compat import optimizer_wrappers

    wrapper = _fp32_wrapper(_groups(is_decoupled_lr=True))
    groups, params = list(wrapper.optimizer.param_groups), [list(g["params"]) for g in wrapper.optimizer.param_groups]
    new = optimizer_wrappers.replace_inner_optimizer(wrapper, lambda gs: torch.optim.SGD(gs, lr=0.1))
    assert wrapper.optimizer is new and type(new) is torch.optim.SGD
    assert all(a is b for a, b in zip(wrapper.param_groups, groups)) and len(wrapper.param_groups) == 2
    pairs = optimizer_wrappers.main_params(wrapper)
    assert [m for m, _ in pairs] == [p for ps in params for p in ps] and all(m is s for m, s in pairs)
    assert not optimizer_wrappers.is_distributed(wrapper)


def test_replace_inner_optimizer_refuses_groups_megatron_cannot_tell_apart(one_rank):
    """megatron matches param groups by ``param_group_identifier_keys`` when it loads a
    checkpoint: two groups equal in those keys would load each other's state."""
    from parallel.megatron_compat import optimizer_wrappers

    wrapper = _fp32_wrapper(_groups())  # the second group differs in no identifier key
    inner, built = wrapper.optimizer, []
    with pytest.raises(ValueError, match="param groups megatron cannot tell apart on load"):
        optimizer_wrappers.replace_inner_optimizer(wrapper, lambda gs: built.append(1) or torch.optim.SGD(gs, lr=0.1))
    assert wrapper.optimizer is inner and built == []


@pytest.mark.parametrize("change", ["copied groups", "reordered params", "dropped group"])
def test_replace_inner_optimizer_refuses_other_groups(one_rank, change):
    """The wrapper indexes its inner optimizer's groups and parameters by position."""
    from parallel.megatron_compat import optimizer_wrappers

    def build(gs):
        if change == "copied groups":
            return torch.optim.SGD([dict(g) for g in gs], lr=0.1)
        if change == "reordered params":
            gs[0]["params"] = gs[0]["params"][::-1]
            return torch.optim.SGD(gs, lr=0.1)
        return torch.optim.SGD(gs[:1], lr=0.1)

    wrapper = _fp32_wrapper(_groups(is_decoupled_lr=True))
    inner = wrapper.optimizer
    with pytest.raises(ValueError, match="must step megatron's param groups themselves"):
        optimizer_wrappers.replace_inner_optimizer(wrapper, build)
    assert wrapper.optimizer is inner


def test_replace_inner_optimizer_refuses_an_optimizer_with_state_and_skips_a_stub(one_rank):
    from parallel.megatron_compat import optimizer_wrappers

    wrapper = _fp32_wrapper(_groups(is_decoupled_lr=True))
    for group in wrapper.optimizer.param_groups:
        for p in group["params"]:
            p.grad = torch.ones_like(p)
    wrapper.optimizer.step()
    with pytest.raises(ValueError, match="already has state"):
        optimizer_wrappers.replace_inner_optimizer(wrapper, lambda gs: torch.optim.SGD(gs, lr=0.1))
    stub = SimpleNamespace(optimizer=None)  # a rank without parameters in this wrapper
    assert optimizer_wrappers.replace_inner_optimizer(stub, lambda gs: pytest.fail("built")) is None


def test_distributed_optimizer_shards_as_optimizer_wrappers_reads_them(one_rank):
    """One DP rank owns every parameter whole: each model parameter's main is its fp32 shard of
    the same size, owned over [0, numel); the buffers hold every trainable parameter once."""
    from parallel.megatron_compat import optimizer_wrappers

    for wrapper in _distributed_adam_after_one_step():
        assert optimizer_wrappers.is_distributed(wrapper)
        pairs = optimizer_wrappers.main_params(wrapper)
        order = optimizer_wrappers.buffer_order(wrapper)
        assert len(order) == len(set(order)) and {m for m, _ in pairs} == set(order)
        for model, main in pairs:
            assert main.dtype == torch.float32 and main.numel() == model.numel()
            assert optimizer_wrappers.owned_range(wrapper, model) == (0, model.numel())
        assert optimizer_wrappers.data_parallel_group(wrapper).size() == 1
        assert optimizer_wrappers.buffer_device(wrapper) == pairs[0][0].device


def test_entry_points_outside_install_refuse_another_megatron_core_version(monkeypatch):
    """The modules whose functions are called directly (not installed patches) check the release
    too, naming their file."""
    from megatron.core import package_info

    from parallel.megatron_compat import meta_rank, optimizer_wrappers, tp_attributes

    monkeypatch.setattr(package_info, "__version__", "0.17.0")
    calls = {
        meta_rank: lambda: meta_rank.rank_position(tp=1, pp=1, cp=1, dp=1, ep=1, expert_tp=1,
                                                   expert_dp=1, world_size=1).__enter__(),
        tp_attributes: lambda: tp_attributes.normalize_tp_attributes([]),
        optimizer_wrappers: lambda: optimizer_wrappers.replace_inner_optimizer(
            SimpleNamespace(optimizer=None), lambda groups: None),
    }
    for module, call in calls.items():
        with pytest.raises(RuntimeError, match="found 0.17.0") as err:
            call()
        assert module.__file__ in str(err.value)


# --- micro_batch: the one per-micro-batch context ---------------------------------------------------


def test_micro_batch_is_active_once_at_a_time_and_checks_its_hand_overs():
    from parallel.megatron_compat.micro_batch import MicroBatch, current

    first, second, receiver = MicroBatch(), MicroBatch(), torch.nn.Identity()
    assert current() is None
    with first.active():
        assert current() is first
        with first.active():  # re-entered (a recomputation inside the forward)
            assert current() is first
        with pytest.raises(RuntimeError, match="cannot become active inside"):
            with second.active():
                pass
        assert current() is first
        first.hand_over(receiver, 1)
        with pytest.raises(RuntimeError, match="Identity has not taken its previous hand-over"):
            first.hand_over(receiver, 2)
        assert first.take(receiver) == 1 and first.take(receiver) is None
        first.hand_over(receiver, 3)
        with first.active():
            pass  # an inner exit leaves the outer block's hand-over
        assert first.take(receiver) == 3
    assert current() is None
    with pytest.raises(RuntimeError, match=r"ended with hand-overs nobody took: \['Identity'\]"):
        with first.active():
            first.hand_over(receiver, 4)
    with pytest.raises(KeyError):  # a failing forward: its hand-overs go with it
        with first.active():
            first.hand_over(receiver, 5)
            raise KeyError("forward failed")
    assert current() is None and first.take(receiver) is None


def test_model_forward_refuses_a_micro_batch_of_other_document_ids():
    """GLM5Model.forward makes its micro-batch active for megatron's forward (build_schedule_plan
    binds it to the plan's nodes); the one the training step passes must carry the
    ``attention_mask`` the model gets."""
    from model_providers.glm5.model.provider import GLM5Model
    from parallel.megatron_compat.micro_batch import MicroBatch

    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"attention_mask is not the document ids of MicroBatch\(document_ids=None\)"):
        GLM5Model.forward(None, ids, ids, ids, micro_batch=MicroBatch())
    with pytest.raises(ValueError, match="attention_mask is not the document ids"):
        GLM5Model.forward(None, ids, ids, ids.clone(), micro_batch=MicroBatch(ids))
    with pytest.raises(ValueError, match="attention_mask is not the document ids"):  # the EP-overlap plan's
        GLM5Model.build_schedule_plan(None, ids, ids, ids.clone(), micro_batch=MicroBatch(ids))


def test_recomputation_runs_under_the_micro_batch_of_its_forward(one_rank):
    """megatron's checkpoint (full and selective recomputation) runs its function again in
    backward, after other micro-batches' forwards (a pipeline schedule): each recomputation sees
    the micro-batch its forward saw, and outside a micro-batch none."""
    from megatron.core import tensor_parallel

    from parallel.megatron_compat.micro_batch import MicroBatch, current

    megatron_compat.install()
    seen = []

    def layer(x):
        seen.append(current())
        return x * 2

    batches = [MicroBatch(), MicroBatch()]
    outs = []
    for mb in batches:
        with mb.active():
            outs.append(tensor_parallel.checkpoint(layer, False, torch.ones(3, requires_grad=True)))
    outs.append(tensor_parallel.checkpoint(layer, False, torch.ones(3, requires_grad=True)))
    assert seen == [*batches, None]
    seen.clear()
    for out in reversed(outs):  # backward in another order than the forwards
        out.sum().backward()
    assert seen == [None, batches[1], batches[0]]


def test_te_checkpoint_runs_its_function_under_the_micro_batch_of_its_forward():
    """Transformer Engine's checkpoint (megatron's choice under fp8) gets the same binding; a
    stand-in that keeps the function for a later recomputation shows it."""
    from parallel.megatron_compat.micro_batch import MicroBatch, bind_checkpoint, current

    kept = []

    def te_checkpoint(function, *args, **kwargs):
        kept.append(function)
        return function(*args, **kwargs)

    bound = bind_checkpoint(te_checkpoint)
    assert bind_checkpoint(bound) is bound
    mb = MicroBatch()
    with mb.active():
        assert bound(lambda x, y=0: (current(), x + y), 1, y=2) == (mb, 3)
    assert current() is None and kept[0](1)[0] is mb


# --- megatron's jit_fuser, plain without CUDA (jit_fusers.py) ----------------------------------

#: entry modules that never import megatron-core (so need no bootstrap), and why
NO_MEGATRON = {
    "pretrain/torchrun.py": "launches the ranks; imports torch.distributed.run only",
    "data_pipeline/samples/sandbox.py": "runs a sample's code in a subprocess",
    "model_providers/glm5/model/dsa/kernels/dsa_cpu.py": "builds the fused CPU kernel",
    "benchmarks/gpu_check/wheelhouse.py": "gathers wheels (a machine with an index)",
    "benchmarks/gpu_check/node.py": "installs the wheels on a GPU node, before the project can import",
}


def _entry_modules(root) -> list:
    """Every module a process starts in: ``__main__.py``, modules run as ``__main__``, the tests'
    conftest, the async checkpoint writer's."""
    found = [root / "tests" / "conftest.py", root / "parallel" / "megatron_compat" / "async_writer.py"]
    for path in sorted(root.rglob("*.py")):
        rel = str(path.relative_to(root))
        if rel.startswith((".venv", "build")) or rel in NO_MEGATRON:
            continue
        if path.name == "__main__.py" or any(_runs_as_main(n) for n in ast.parse(path.read_text()).body):
            found.append(path)
    return found


def _runs_as_main(node) -> bool:
    """``if __name__ == "__main__":`` at module level."""
    test = getattr(node, "test", None) if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Compare) and getattr(test.left, "id", None) == "__name__"
            and any(getattr(c, "value", None) == "__main__" for c in test.comparators))


def test_every_entry_point_bootstraps_before_its_first_import():
    """Each module a process starts in calls ``parallel.megatron_compat.bootstrap()`` before any
    import but the standard library's (and ``__future__``): megatron cannot come in ahead of
    :mod:`.jit_fusers`, whatever those imports bring. No package ``__init__`` imports
    ``megatron_compat`` for its side effects; the exempt entry modules never import megatron."""
    from pathlib import Path

    root = Path(megatron_compat.__file__).parents[2]
    late = []
    for path in _entry_modules(root):
        body = ast.parse(path.read_text()).body
        call = next((i for i, n in enumerate(body) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call)
                     and getattr(n.value.func, "id", None) == "bootstrap"), None)
        before = body[:call] if call is not None else body
        project = [n for n in before if isinstance(n, (ast.Import, ast.ImportFrom))
                   and not _stdlib(n) and getattr(n, "module", None) != "parallel.megatron_compat"]
        if call is None or project:
            late.append(str(path.relative_to(root)))
    assert len(_entry_modules(root)) > 25 and not late, f"entry modules importing before bootstrap(): {late}"
    for package in ("checkpointing", "data_pipeline", "model_providers", "parallel", "planner", "pretrain"):
        init = ast.parse((root / package / "__init__.py").read_text())
        assert not [n for n in ast.walk(init) if isinstance(n, (ast.Import, ast.ImportFrom))
                    and any("megatron" in name for name in _imported(n))], package
    for rel in NO_MEGATRON:
        assert not [n for n in ast.walk(ast.parse((root / rel).read_text())) if isinstance(n, (ast.Import, ast.ImportFrom))
                    and any(name.startswith("megatron") for name in _imported(n))], rel


def _imported(node) -> list:
    return [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]


def _stdlib(node) -> bool:
    return all(n.split(".")[0] in sys.stdlib_module_names for n in _imported(node))


@pytest.mark.parametrize("cuda, version, plain", [(False, "0.19.2", True), (True, "0.19.2", False),
                                                  (False, "0.17.0", False)])
def test_jit_fuser_is_made_plain_only_without_cuda_on_the_release_it_was_written_for(
        monkeypatch, cuda, version, plain):
    from megatron.core import package_info

    from parallel.megatron_compat import jit_fusers

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(package_info, "__version__", version + "+0123abc")  # 0.19 appends a git sha
    assert jit_fusers._plain_without_cuda() is plain


@pytest.mark.heavy
def test_a_cpu_process_importing_the_project_first_never_imports_inductor():
    """A fresh interpreter as a training process starts: megatron comes in through the project's
    packages, its ``jit_fuser`` is plain, SwiGLU is a plain function (numerically the same), and
    neither dynamo's compile nor inductor is imported (~1.8 s of every CPU process's start)."""
    probe = """
import json, sys
import pretrain.train
from model_providers.glm5.model import specs  # noqa: F401 -- imports megatron's fused ops
import torch
from megatron.core import jit
from megatron.core.fusions.fused_bias_swiglu import swiglu
from parallel.megatron_compat import jit_fusers
y = torch.randn(3, 8)
print(json.dumps({"plain": jit.jit_fuser is jit.noop_decorator,
                  "compiled": hasattr(swiglu, "_torchdynamo_orig_callable"),
                  "same": bool(torch.equal(swiglu(y), torch.nn.functional.silu(y[:, :4]) * y[:, 4:])),
                  "inductor": "torch._inductor" in sys.modules, "installed_again": jit_fusers.install()}))
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(megatron_compat.__file__))))
    assert out.returncode == 0, out.stderr[-3000:]
    import json

    assert json.loads(out.stdout.strip().splitlines()[-1]) == {
        "plain": True, "compiled": False, "same": True, "inductor": False, "installed_again": False}
