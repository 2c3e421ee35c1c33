"""Run megatron-core 0.19.2's real parallel code on CPU ranks (gloo).

megatron-core assumes CUDA everywhere. Everything that makes it run without CUDA lives here, one
patch per behaviour (see docs/cpu_ranks.md), and is installed only when CUDA is
absent (fixes that hold on GPUs too are in ``fixes.py``). Each patch has its own test in
``tests/unit/parallel/test_cpu_emulation.py`` so a megatron-core upgrade shows exactly which one broke.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from parallel.megatron_compat import strict_cuda
from parallel.megatron_compat.version import check_megatron_core

_CPU = torch.device("cpu")
_INSTALLED = False
_MODE: "CudaDeviceToCpuMode | None" = None

#: The emulated CUDA generator. megatron's RNG tracker seeds and swaps its state; it is a real
#: generator so ``torch.cuda.manual_seed`` really seeds it (a no-op would give the tracker
#: identical streams for every name).
cuda_generator = torch.Generator(device="cpu")


def _cpu_device(device):
    """Map a CUDA device spec (``"cuda"``, ``"cuda:1"``, ``torch.device("cuda")``, a bare ordinal)
    to the CPU; leave anything else alone."""
    if isinstance(device, torch.device):
        return _CPU if device.type == "cuda" else device
    if isinstance(device, str):
        return "cpu" if device.startswith("cuda") else device
    if isinstance(device, int) and not isinstance(device, bool):
        return _CPU
    return device


#: the methods :class:`CudaDeviceToCpuMode` rewrites beyond ``device`` / ``pin_memory`` arguments
_REWRITTEN_METHODS = frozenset({torch.Tensor.cuda, torch.Tensor.pin_memory, torch.Tensor.type, torch.Tensor.to})


class CudaDeviceToCpuMode(TorchFunctionMode):
    """Rewrites CUDA devices to CPU in every torch call, makes ``.cuda()`` and ``pin_memory()``
    no-ops and reports CPU float tensors with CUDA type names (megatron asserts on them)."""

    _TYPE_NAMES = {
        "torch.FloatTensor": "torch.cuda.FloatTensor",
        "torch.HalfTensor": "torch.cuda.HalfTensor",
        "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
    }

    strict = False  #: strict CUDA emulation (:mod:`.strict_cuda`) on top of the rewriting

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.strict:
            return strict_cuda.handle_function(func, args, kwargs,
                                               lambda a, k: self._rewritten(func, a, k))
        return self._rewritten(func, args, kwargs)

    def _rewritten(self, func, args, kwargs):
        if kwargs:
            if "device" in kwargs:
                kwargs = dict(kwargs, device=_cpu_device(kwargs["device"]))
            if "pin_memory" in kwargs:
                kwargs = dict(kwargs, pin_memory=False)
        if func not in _REWRITTEN_METHODS:  # nearly every call: nothing more to rewrite
            return func(*args, **kwargs)
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return self._TYPE_NAMES.get(name, name) if self._on_device(args[0]) else name
        if func is torch.Tensor.to and len(args) > 1:
            args = (args[0], _cpu_device(args[1]), *args[2:])
        return func(*args, **kwargs)

    def _on_device(self, t) -> bool:
        """Plain mode: every tensor is on the (emulated) device; strict mode tracks it."""
        if not self.strict:
            return True
        return strict_cuda.on_device(t)


class _NullStream:
    """Stand-in for ``torch.cuda.Stream`` / ``Event``: CPU work is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __getattr__(self, name):
        return lambda *args, **kwargs: None

    def record_event(self, *args, **kwargs):
        return _NullStream()

    def query(self):
        return True

    def synchronize(self, *args, **kwargs):
        _count_strict_sync()

    @staticmethod
    def priority_range():
        """(least, greatest) stream priority, as CUDA's; megatron 0.19 asks the class for it
        (``high_priority_a2a_comm_stream``)."""
        return 0, -1


def _count_strict_sync(*args, **kwargs) -> None:
    """Under strict emulation a wait for the device is a host sync (counted, not raised)."""
    if strict_cuda.is_active():
        strict_cuda._count_sync()


def _all_to_all_single_with_list_splits(original):
    """gloo's binding wants split sizes as lists; megatron's MoE dispatcher passes tensors."""

    @functools.wraps(original)
    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, *a, **k):
        if isinstance(output_split_sizes, torch.Tensor):
            output_split_sizes = output_split_sizes.tolist()
        if isinstance(input_split_sizes, torch.Tensor):
            input_split_sizes = input_split_sizes.tolist()
        return original(output, input, output_split_sizes, input_split_sizes, *a, **k)

    return all_to_all_single


def _all_gather_uneven(original):
    """gloo's all_gather needs equal shapes; megatron's MoE dispatcher (TP x EP) gathers
    per-rank token blocks of different lengths along dim 0, as NCCL allows. Pad to the longest
    block, gather, and copy each rank's rows out."""

    @functools.wraps(original)
    def all_gather(tensor_list, tensor, group=None, async_op=False):
        if all(t.shape == tensor.shape for t in tensor_list):
            return original(tensor_list, tensor, group=group, async_op=async_op)
        rows = max(t.shape[0] for t in tensor_list)
        padded_in = tensor.new_zeros((rows, *tensor.shape[1:]))
        padded_in[: tensor.shape[0]] = tensor
        padded_out = [tensor.new_zeros((rows, *tensor.shape[1:])) for _ in tensor_list]
        original(padded_out, padded_in, group=group)
        for out, full in zip(tensor_list, padded_out):
            out.copy_(full[: out.shape[0]])
        return _CompletedWork() if async_op else None

    return all_gather


class _CompletedWork:
    def wait(self, *args, **kwargs):
        return True

    def is_completed(self):
        return True


def _device_mode_in_backward() -> None:
    """The autograd engine runs custom functions' ``backward`` without the torch-function mode
    stack, so a ``device="cuda"`` there reached the real (absent) CUDA: enter the device mode
    around each of them."""
    from torch.autograd.function import BackwardCFunction

    apply = BackwardCFunction.apply

    @functools.wraps(apply)
    def apply_in_device_mode(self, *args):
        if _MODE is None or _MODE in torch.overrides._get_current_function_mode_stack():
            return apply(self, *args)
        with _MODE:
            return apply(self, *args)

    BackwardCFunction.apply = apply_in_device_mode


def _patch_cuda_runtime() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: _CPU
    cuda.set_device = lambda *a, **k: None
    cuda.synchronize = _count_strict_sync
    cuda.empty_cache = lambda *a, **k: None
    cuda.Stream = _NullStream
    cuda.Event = _NullStream
    cuda.current_stream = lambda *a, **k: _NullStream()
    cuda.default_stream = lambda *a, **k: _NullStream()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.memory_allocated = lambda *a, **k: 0
    cuda.max_memory_allocated = lambda *a, **k: 0
    cuda.memory_reserved = lambda *a, **k: 0
    cuda.reset_peak_memory_stats = lambda *a, **k: None
    cuda.nvtx.range_push = lambda *a, **k: None  # profiler ranges (the combined 1F1B's nodes)
    cuda.nvtx.range_pop = lambda *a, **k: None


def _patch_cuda_rng() -> None:
    """The CUDA RNG gets its own generator; megatron's tracker state get/set go through it."""
    from megatron.core.tensor_parallel import random as mrandom

    def get_rng_state(device="cuda", *args, **kwargs):
        return cuda_generator.get_state()

    def set_rng_state(new_state, device=-1, *args, **kwargs):
        cuda_generator.set_state(new_state)

    def manual_seed(seed):
        cuda_generator.manual_seed(int(seed))

    torch.cuda.get_rng_state = get_rng_state
    torch.cuda.random.get_rng_state = get_rng_state
    torch.cuda.set_rng_state = set_rng_state
    torch.cuda.random.set_rng_state = set_rng_state
    torch.cuda.manual_seed = manual_seed
    torch.cuda.manual_seed_all = manual_seed
    torch.cuda.random.manual_seed = manual_seed
    mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: (
        cuda_generator.get_state()
    )
    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: (
        cuda_generator.set_state(new_state)
    )


def _single_threaded_helper_threads() -> None:
    """Keep the intra-op thread count for the calling (training) thread, and make every thread
    started later -- gloo's per-group work threads above all -- run torch ops on one thread.

    gloo copies gathered tensors on its own work threads with ``at::parallel_for``, so each work
    thread that ever ran an all-gather owns an OpenMP team for the rest of its life. libgomp counts
    the threads of every team in the process; once that count exceeds the cores it throttles
    its spin-wait, and every parallel region of the training thread then sleeps and wakes its
    workers through the kernel: steps ran 1.7x slower after the first checkpoint load or save
    (a stage change does both). torch initialises a new thread's OpenMP thread count from the
    process-wide value that ``torch.set_num_threads`` stores, while each thread keeps its own
    once set: store 1 from a short-lived thread, after the training thread has fixed its own.
    """
    import threading

    torch.set_num_threads(torch.get_num_threads())  # pin this thread's own count first
    helper = threading.Thread(target=torch.set_num_threads, args=(1,), name="omp-one-thread")
    helper.start()
    helper.join()


def _eager_jit_fusers() -> None:
    """Run megatron's ``jit_fuser`` functions (``torch.compile``: the router's score and expert-bias
    update, the experts' activations, the dispatcher's permutation helpers) eagerly.

    Their fusion is a GPU optimisation; on CPU ranks each process traced and compiled them at its
    first step (~5 s of CPU per rank warm, more with a cold inductor cache: a C++ build) for
    tensors of a few thousand elements. Eager runs the same ops; every run on CPU ranks is eager
    alike, so runs stay comparable with each other.
    """
    torch.compiler.set_stance("force_eager")


def install(strict: bool = False) -> bool:
    """Install every patch once, when CUDA is unavailable. Returns whether emulation is active.
    ``strict``: also track device residency and fail where CUDA would (:mod:`.strict_cuda`);
    can be switched on after a plain install, not off (one-process tests: :func:`strict_mode`)."""
    global _INSTALLED, _MODE
    if torch.cuda.is_available():
        return False
    if _INSTALLED:
        if strict:
            _enable_strict()
        return True
    check_megatron_core(__file__)
    _patch_cuda_runtime()
    _patch_cuda_rng()
    _device_mode_in_backward()
    dist.all_to_all_single = _all_to_all_single_with_list_splits(dist.all_to_all_single)
    dist.all_gather = _all_gather_uneven(dist.all_gather)
    _single_threaded_helper_threads()
    _eager_jit_fusers()
    _MODE = CudaDeviceToCpuMode()
    _MODE.__enter__()
    _INSTALLED = True
    if strict:
        _enable_strict()
    return True


def _enable_strict() -> None:
    strict_cuda.install()
    _MODE.strict = True


@contextlib.contextmanager
def strict_mode():
    """Strict CUDA emulation for a block (one-process tests); training runs switch it on for the
    whole process with ``parallel.cpu_emulation=strict``."""
    install()
    was = strict_cuda.is_active()
    _enable_strict()
    try:
        yield
    finally:
        if not was:
            _MODE.strict = False
            strict_cuda.uninstall()


def is_active() -> bool:
    return _INSTALLED


@contextlib.contextmanager
def device_mode_suspended():
    """Run a block without the device-rewriting mode (used to measure its overhead)."""
    if _MODE is None:
        yield
        return
    _MODE.__exit__(None, None, None)
    try:
        yield
    finally:
        _MODE.__enter__()
