"""One test per patch in ``parallel/megatron_compat/cpu_emulation.py``: when a megatron-core (or torch) upgrade
breaks the CPU emulation, the failing test names the patch.

Every test runs with the emulation installed (CUDA is absent on the machines that run these);
without it each of the calls below raises (no CUDA) or returns the wrong thing.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from parallel import megatron_compat
from parallel.initialize import free_port
from parallel.megatron_compat import cpu_emulation

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU emulation is for CUDA-less hosts")

cpu_emulation.install()
megatron_compat.install()  # the TE-probe fixes the local MLA spec needs


def _draws(state: torch.Tensor, n: int = 8) -> torch.Tensor:
    """``n`` uniform draws from a generator put in ``state`` (the state is not modified)."""
    g = torch.Generator(device="cpu")
    g.set_state(state)
    return torch.rand(n, generator=g)


def _seeded_draws(seed: int, n: int = 8) -> torch.Tensor:
    return torch.rand(n, generator=torch.Generator(device="cpu").manual_seed(seed))


# --- install ---------------------------------------------------------------------------------


def test_install_is_idempotent_and_reports_active():
    mode = cpu_emulation._MODE
    assert cpu_emulation.install() is True
    assert cpu_emulation.install() is True
    assert cpu_emulation.is_active()
    assert cpu_emulation._MODE is mode, "a second install() must not stack another device mode"
    wrapped = dist.all_to_all_single
    cpu_emulation.install()
    assert dist.all_to_all_single is wrapped, "a second install() must not wrap all_to_all_single twice"


def test_torch_compile_functions_run_eagerly():
    """Where megatron was imported before its ``jit_fuser`` was made plain (``jit_fusers.py``), its
    fusers are ``torch.compile`` functions (SwiGLU, the router's expert bias, the dispatcher's
    helpers): on CPU ranks they run eagerly, no frame traced by dynamo."""
    from torch._dynamo.utils import counters

    cpu_emulation.install()
    fused = torch.compile(lambda y: torch.nn.functional.silu(y[:, :4]) * y[:, 4:])
    traced = counters["frames"]["total"]
    y = torch.randn(3, 8)
    assert torch.equal(fused(y), torch.nn.functional.silu(y[:, :4]) * y[:, 4:])
    assert counters["frames"]["total"] == traced


def test_install_refuses_another_megatron_core_version_naming_the_file(monkeypatch):
    from megatron.core import package_info

    monkeypatch.setattr(package_info, "__version__", "0.17.0")
    monkeypatch.setattr(cpu_emulation, "_INSTALLED", False)
    wrapped = dist.all_to_all_single
    with pytest.raises(RuntimeError, match=r"written for megatron-core 0\.19\.2, found 0\.17\.0") as err:
        cpu_emulation.install()
    assert cpu_emulation.__file__ in str(err.value)
    assert dist.all_to_all_single is wrapped, "nothing is patched before the version check"


# --- device rewriting (CudaDeviceToCpuMode) ---------------------------------------------------


@pytest.mark.parametrize(
    "device",
    ["cuda", "cuda:1", torch.device("cuda"), torch.device("cuda", 1), 0, 3],
    ids=["str-cuda", "str-cuda:1", "device-cuda", "device-cuda:1", "ordinal-0", "ordinal-3"],
)
@pytest.mark.parametrize(
    "factory",
    [
        lambda d: torch.zeros(2, 3, device=d),
        lambda d: torch.ones(4, device=d, dtype=torch.float16),
        lambda d: torch.empty(5, device=d),
        lambda d: torch.arange(6, device=d),
        lambda d: torch.tensor([1.0, 2.0], device=d),
        lambda d: torch.full((2,), 7.0, device=d),
        lambda d: torch.randn(3, device=d),
    ],
    ids=["zeros", "ones", "empty", "arange", "tensor", "full", "randn"],
)
def test_factory_cuda_device_is_rewritten_to_cpu(factory, device):
    t = factory(device)
    assert t.device == torch.device("cpu")


def test_factory_with_current_device():
    dev = torch.cuda.current_device()
    t = torch.zeros(2, device=dev)
    assert t.device.type == "cpu"
    assert torch.equal(t, torch.zeros(2))


def test_factory_values_are_unchanged_by_rewrite():
    assert torch.equal(torch.arange(5, device="cuda"), torch.arange(5))
    assert torch.equal(torch.full((3,), 2.5, device=0), torch.tensor([2.5, 2.5, 2.5]))
    assert torch.ones(2, device="cuda", dtype=torch.bfloat16).dtype == torch.bfloat16


def test_tensor_methods_with_cuda_device_kwarg():
    x = torch.arange(4.0)
    assert x.new_zeros(3, device="cuda").device.type == "cpu"
    assert x.new_empty((2,), device=torch.device("cuda:0")).device.type == "cpu"
    assert torch.empty_like(x, device="cuda").device.type == "cpu"
    assert x.to(device="cuda").device.type == "cpu"


def test_non_cuda_devices_are_left_alone():
    assert cpu_emulation._cpu_device("meta") == "meta"
    assert cpu_emulation._cpu_device(torch.device("meta")) == torch.device("meta")
    assert cpu_emulation._cpu_device(None) is None
    assert cpu_emulation._cpu_device(True) is True, "bools are ints in Python but not ordinals"
    assert torch.zeros(2, device="meta").device.type == "meta"


def test_tensor_cuda_is_a_noop():
    x = torch.randn(3)
    assert x.cuda() is x
    assert x.cuda(1) is x
    assert x.cuda(non_blocking=True) is x


def test_tensor_to_cuda_stays_on_cpu():
    x = torch.randn(3)
    y = x.to("cuda")
    assert y.device.type == "cpu" and torch.equal(y, x)
    y = x.to(torch.device("cuda:1"))
    assert y.device.type == "cpu" and torch.equal(y, x)
    y = x.to(0)
    assert y.device.type == "cpu" and torch.equal(y, x)


def test_tensor_to_cuda_keeps_the_dtype_argument():
    x = torch.tensor([1.5, 2.5])
    y = x.to("cuda", torch.float64)
    assert y.device.type == "cpu" and y.dtype == torch.float64
    assert torch.equal(y, torch.tensor([1.5, 2.5], dtype=torch.float64))
    z = x.to(torch.float16)
    assert z.dtype == torch.float16


def test_pin_memory_is_a_noop():
    x = torch.randn(3)
    assert x.pin_memory() is x
    y = torch.empty(4, pin_memory=True)
    assert y.device.type == "cpu" and y.shape == (4,)
    z = torch.zeros(2, device="cuda", pin_memory=True)
    assert z.device.type == "cpu"


@pytest.mark.parametrize(
    "dtype, name",
    [
        (torch.float32, "torch.cuda.FloatTensor"),
        (torch.float16, "torch.cuda.HalfTensor"),
        (torch.bfloat16, "torch.cuda.BFloat16Tensor"),
    ],
)
def test_tensor_type_reports_cuda_name_for_floats(dtype, name):
    assert torch.zeros(2, dtype=dtype).type() == name


def test_tensor_type_of_other_dtypes_and_conversion_unchanged():
    assert torch.zeros(2, dtype=torch.int64).type() == "torch.LongTensor"
    assert torch.zeros(2, dtype=torch.float64).type() == "torch.DoubleTensor"
    converted = torch.zeros(2).type(torch.float64)
    assert isinstance(converted, torch.Tensor) and converted.dtype == torch.float64


# --- CUDA runtime stand-ins -------------------------------------------------------------------


def test_current_device_is_cpu():
    assert torch.cuda.current_device() == torch.device("cpu")


def test_runtime_calls_are_noops():
    torch.cuda.set_device(0)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    assert torch.cuda.memory_allocated() == 0
    assert torch.cuda.max_memory_allocated() == 0
    assert torch.cuda.memory_reserved() == 0


def test_streams_and_events_stand_ins():
    """The calls megatron's MoE alltoall dispatcher makes on its side stream."""
    side = torch.cuda.Stream()
    current = torch.cuda.current_stream()
    assert current != side
    side.wait_stream(current)
    current.wait_stream(side)
    with torch.cuda.stream(side):
        t = torch.ones(3, device="cuda") * 2
    assert torch.equal(t, torch.full((3,), 2.0))
    event = side.record_event()
    event.synchronize()
    assert event.query() is True
    ev = torch.cuda.Event()
    ev.record()
    ev.synchronize()
    ev.wait()
    assert ev.query() is True
    torch.cuda.default_stream().synchronize()


def test_megatrons_high_priority_stream_is_created(monkeypatch):
    """megatron 0.19's ``set_streams(high_priority=True)`` (``high_priority_a2a_comm_stream``)
    asks the Stream class for its priority range first."""
    from megatron.core.pipeline_parallel import utils

    monkeypatch.setattr(utils, "_COMM_STREAM", None)
    utils.set_streams(high_priority=True)
    assert isinstance(utils.get_comm_stream(), type(torch.cuda.current_stream()))


def test_stream_context_manager_runs_the_block():
    ran = []
    with torch.cuda.Stream() as s:
        ran.append(s)
    assert len(ran) == 1


# --- CUDA RNG ----------------------------------------------------------------------------------


def test_cuda_manual_seed_seeds_the_cuda_generator():
    torch.cuda.manual_seed(1)
    s1 = torch.cuda.get_rng_state()
    torch.cuda.manual_seed(2)
    s2 = torch.cuda.get_rng_state()
    torch.cuda.manual_seed(1)
    s1_again = torch.cuda.get_rng_state()
    assert not torch.equal(s1, s2)
    assert torch.equal(s1, s1_again)
    assert torch.equal(s1, cpu_emulation.cuda_generator.get_state())
    assert torch.equal(_draws(s1), _seeded_draws(1))


def test_cuda_manual_seed_leaves_default_cpu_generator_alone():
    torch.manual_seed(7)
    cpu_state = torch.get_rng_state()
    torch.cuda.manual_seed(99)
    torch.cuda.manual_seed_all(100)
    torch.cuda.random.manual_seed(101)
    assert torch.equal(torch.get_rng_state(), cpu_state)
    assert torch.equal(_draws(cpu_emulation.cuda_generator.get_state()), _seeded_draws(101))


def test_cuda_set_rng_state_round_trip():
    torch.cuda.manual_seed(5)
    state = torch.cuda.get_rng_state()
    first = torch.rand(4, generator=cpu_emulation.cuda_generator)
    assert not torch.equal(torch.cuda.get_rng_state(), state), "drawing must advance the state"
    torch.cuda.set_rng_state(state)
    assert torch.equal(torch.rand(4, generator=cpu_emulation.cuda_generator), first)
    torch.cuda.random.set_rng_state(state, device="cuda")
    assert torch.equal(torch.cuda.random.get_rng_state(device="cuda"), state)


def test_megatron_private_cuda_rng_state_round_trip():
    from megatron.core.tensor_parallel import random as mrandom

    torch.cuda.manual_seed(11)
    state = mrandom._get_cuda_rng_state()
    assert torch.equal(state, cpu_emulation.cuda_generator.get_state())
    first = torch.rand(4, generator=cpu_emulation.cuda_generator)
    mrandom._set_cuda_rng_state(state)
    assert torch.equal(torch.rand(4, generator=cpu_emulation.cuda_generator), first)
    # megatron calls these with keywords too
    state2 = mrandom._get_cuda_rng_state(device="cuda", clone=True, graph_safe=False)
    torch.rand(2, generator=cpu_emulation.cuda_generator)
    mrandom._set_cuda_rng_state(state2, device=-1, graph_safe=False)
    assert torch.equal(mrandom._get_cuda_rng_state(), state2)


def test_rng_tracker_add_gives_distinct_streams_per_name():
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    torch.cuda.manual_seed(3)
    before = cpu_emulation.cuda_generator.get_state()
    tracker = CudaRNGStatesTracker()
    tracker.add("a", 1000)
    tracker.add("b", 2000)
    assert torch.equal(cpu_emulation.cuda_generator.get_state(), before), "add() must restore the state"
    states = tracker.get_states()
    a, b = _draws(states["a"]), _draws(states["b"])
    assert not torch.equal(a, b)
    assert torch.equal(a, _seeded_draws(1000))
    assert torch.equal(b, _seeded_draws(2000))


def test_rng_tracker_fork_swaps_the_cuda_generator():
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    torch.cuda.manual_seed(3)
    outside = cpu_emulation.cuda_generator.get_state()
    tracker = CudaRNGStatesTracker()
    tracker.add("a", 1000)
    tracker.add("b", 2000)
    with tracker.fork("a"):
        a1 = torch.rand(4, generator=cpu_emulation.cuda_generator)
    assert torch.equal(cpu_emulation.cuda_generator.get_state(), outside), "fork must restore the state"
    with tracker.fork("b"):
        b1 = torch.rand(4, generator=cpu_emulation.cuda_generator)
    with tracker.fork("a"):
        a2 = torch.rand(4, generator=cpu_emulation.cuda_generator)
    expected_a = _seeded_draws(1000, 8)
    assert torch.equal(torch.cat([a1, a2]), expected_a), "the 'a' stream must continue across forks"
    assert torch.equal(b1, _seeded_draws(2000, 4))
    assert not torch.equal(tracker.get_states()["a"], tracker.get_states()["b"])


@pytest.mark.xfail(
    strict=True,
    reason="known gap: ops on rewritten 'cuda' tensors (dropout, randn) draw from the default CPU "
    "generator, so a tracker fork does not change them; only draws that name cuda_generator follow "
    "the forked stream. Harmless while every dropout is 0; XPASS here means the gap was closed.",
)
def test_rng_tracker_fork_drives_dropout():
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    tracker = CudaRNGStatesTracker()
    tracker.add("a", 1000)
    tracker.add("b", 2000)
    x = torch.ones(256, device="cuda")
    torch.manual_seed(0)
    with tracker.fork("a"):
        mask_a = torch.nn.functional.dropout(x, p=0.5) == 0
    torch.manual_seed(0)
    with tracker.fork("b"):
        mask_b = torch.nn.functional.dropout(x, p=0.5) == 0
    assert not torch.equal(mask_a, mask_b), "dropout masks must follow the forked stream"


def test_model_parallel_cuda_manual_seed_seeds_every_stream():
    from megatron.core.tensor_parallel import random as mrandom

    seed = 1234
    mrandom.model_parallel_cuda_manual_seed(seed, tp_rank=1, ep_rank=2, etp_rank=0)
    assert torch.equal(_draws(cpu_emulation.cuda_generator.get_state()), _seeded_draws(seed))
    states = mrandom.get_cuda_rng_tracker().get_states()
    assert torch.equal(_draws(states[mrandom._DATA_PARALLEL_RNG_TRACKER_NAME]), _seeded_draws(seed))
    assert torch.equal(
        _draws(states[mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME]), _seeded_draws(seed + 2718 + 1)
    )
    assert torch.equal(
        _draws(states[mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME]), _seeded_draws(seed + 1024 + 200)
    )


@pytest.fixture
def single_rank_model_parallel():
    """A 1-rank gloo group with megatron's model-parallel groups; torn down afterwards."""
    from megatron.core import parallel_state

    if dist.is_initialized():
        pytest.fail("a process group is already initialized in the test process")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=60),
    )
    try:
        parallel_state.initialize_model_parallel()
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def test_mla_builds_from_megatron_local_spec(single_rank_model_parallel):
    """megatron's own local MLA spec; only its core attention is ours (megatron's local
    DotProductAttention rejects MLA's k_channels != v_channels, upstream issue #1589)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from megatron.core.transformer.spec_utils import ModuleSpec

    from model_providers.glm5.model.config import DSAConfig
    from model_providers.glm5.model.dsa.attention import DSACoreAttention

    model_parallel_cuda_manual_seed(42)
    cfg = MLATransformerConfig(
        num_layers=1,
        hidden_size=64,
        num_attention_heads=4,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_head_dim=16,
        qk_pos_emb_head_dim=8,
        v_head_dim=16,
        rope_type="rope",
        normalization="RMSNorm",
        add_bias_linear=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=False,
        use_cpu_initialization=True,
    )
    spec = get_gpt_layer_local_spec(multi_latent_attention=True, normalization="RMSNorm")
    attn_spec = spec.submodules.self_attention
    assert attn_spec.module is MLASelfAttention
    attn_spec.submodules.core_attention = ModuleSpec(
        module=DSACoreAttention, params={"dsa": DSAConfig(mode="dense")})
    attn = build_module(attn_spec, config=cfg, layer_number=1)
    assert isinstance(attn, MLASelfAttention)

    hidden = torch.randn(5, 2, 64)  # [s, b, h]
    out, _ = attn(hidden, attention_mask=None)
    assert out.shape == (5, 2, 64)
    assert torch.isfinite(out).all()


# --- all_to_all_single split sizes and uneven all_gather (2 real gloo ranks) ------------------


def _all_to_all_worker(rank: int, port: int) -> None:
    from parallel.megatron_compat import cpu_emulation as emu

    emu.install()
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=60),
    )
    try:
        # rank 0 sends 1 row to rank 0 and 2 rows to rank 1; rank 1 sends 3 to rank 0, 1 to rank 1
        send = [[1, 2], [3, 1]]
        input_splits = torch.tensor(send[rank])
        output_splits = torch.tensor([send[0][rank], send[1][rank]])
        rows = int(input_splits.sum())
        inp = (100 * rank + torch.arange(rows, dtype=torch.float32)).unsqueeze(1).repeat(1, 2)
        expected_col = {
            0: torch.tensor([0.0, 100.0, 101.0, 102.0]),
            1: torch.tensor([1.0, 2.0, 103.0]),
        }[rank]
        expected = expected_col.unsqueeze(1).repeat(1, 2)

        out = torch.empty(int(output_splits.sum()), 2)
        dist.all_to_all_single(out, inp, output_splits, input_splits)
        assert torch.equal(out, expected), f"rank {rank} positional: {out.tolist()}"

        out = torch.empty(int(output_splits.sum()), 2)
        dist.all_to_all_single(
            out, inp, output_split_sizes=output_splits, input_split_sizes=input_splits
        )
        assert torch.equal(out, expected), f"rank {rank} keywords: {out.tolist()}"

        # the path megatron's MoE alltoall dispatcher takes
        from megatron.core.tensor_parallel.mappings import all_to_all

        out = all_to_all(dist.group.WORLD, inp, output_splits, input_splits)
        assert torch.equal(out, expected), f"rank {rank} megatron all_to_all: {out.tolist()}"

        # uneven all_gather (MoE dispatcher under TP x EP): rank 0 holds 2 rows, rank 1 holds 3
        mine = (10 * (rank + 1) + torch.arange(2 + rank, dtype=torch.float32)).unsqueeze(1)
        gathered = [torch.empty(2, 1), torch.empty(3, 1)]
        dist.all_gather(gathered, mine)
        assert gathered[0].flatten().tolist() == [10.0, 11.0], gathered
        assert gathered[1].flatten().tolist() == [20.0, 21.0, 22.0], gathered
        from megatron.core.tensor_parallel.mappings import _gather_along_first_dim

        full = _gather_along_first_dim(mine, dist.group.WORLD, output_split_sizes=[2, 3])
        assert full.flatten().tolist() == [10.0, 11.0, 20.0, 21.0, 22.0], full
    finally:
        dist.destroy_process_group()


def _all_to_all_child(_index: int, port: int) -> None:
    _all_to_all_worker(1, port)


@pytest.mark.heavy
@pytest.mark.heavy
def test_all_to_all_split_tensors_and_uneven_all_gather():
    """Rank 0 is this process (megatron is already imported here), rank 1 a spawned child."""
    if dist.is_initialized():
        pytest.fail("a process group is already initialized in the test process")
    port = free_port()
    child = torch.multiprocessing.start_processes(
        _all_to_all_child, args=(port,), nprocs=1, join=False, start_method="spawn"
    )
    try:
        _all_to_all_worker(0, port)
    except BaseException:
        for proc in child.processes:
            proc.kill()
        raise
    if not child.join(timeout=120):
        for proc in child.processes:
            proc.kill()
        pytest.fail("rank 1 did not finish within 120 s")


# --- intra-op threads of helper threads ------------------------------------------------------


def test_threads_started_later_run_torch_ops_on_one_thread_and_this_one_keeps_its_count():
    """gloo's work threads copy gathered tensors with at::parallel_for; with more than one
    intra-op thread each would own an OpenMP team for its life, and libgomp then throttles the
    training thread's spin-waits (every step after the first checkpoint ran 1.7x slower)."""
    import threading

    seen = []

    def worker():
        torch.ones(1 << 16).sum()  # first parallel op of this thread initialises its count
        seen.append(torch.get_num_threads())

    before = torch.get_num_threads()
    cpu_emulation._single_threaded_helper_threads()
    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == [1]
    assert torch.get_num_threads() == before
