"""DSA's fused ops for CPU ranks, one C++ extension (``dsa_cpu.cpp`` says how it is organised)
exporting six: the sparse MLA forward and backward, the C++ counterpart of
``sparse_attention.sparse_latent_attention`` (same shapes, semantics and precision; :func:`sparse_mla_cpu`
wraps them in autograd), the indexer's sparse KL with its
gradients (``kl.sparse_kl(..., fused=True)`` calls ``cpu_kernel().sparse_kl``), of the dense KL's
row work between its GEMMs (``kl.dense_kl(..., fused=True)``: ``attention_target`` and
``dense_kl_rows``) and of the indexer's top-k (``topk``).

The kernel is compiled on first use with torch's extension builder (g++ and ninja; a few tens of
seconds once) into torch's extensions directory (``TORCH_EXTENSIONS_DIR``), under a name keyed by
this CPU's instruction-set flags and the vector width: it is built with ``-march=native``, so a
home directory shared by a login node and compute nodes of another CPU type keeps one build per CPU
type. Where it cannot be built (no compiler), :func:`cpu_kernel` warns once and returns None, and
the caller keeps the op-by-op torch path.

The vector width (8 floats: the AVX2 path; 16: the AVX-512 path) is the CPU's own unless
``GLM5_CPU_KERNEL_LANES`` names one. The two widths sum in different orders, so their results
differ by rounding; each width computes the same bits on any x86 CPU with AVX2 (the source says
why), so ``GLM5_CPU_KERNEL_LANES=16`` on an AVX2 machine runs the AVX-512 machines' arithmetic (at
about half its speed) and ``=8`` on an AVX-512 machine the AVX2 machines'. The kernel's tests run
both widths; the test session's header names the one every other test ran.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import sys
import time
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("dsa_cpu.cpp")
#: selected keys per block: the block's latent rows (128 x 576 x 4 B = 0.3 MiB) stay in a 512 KiB
#: L2 between the block's GEMMs (measured at 16K on an AVX2 EPYC, fwd+bwd: 128 beat 256 in each of
#: 3 alternating runs, by 5-12%, 64 was slower; rechecked once fp32 rows went without software
#: prefetches, 8K and 32K: 64 and 256 within 5% of 128 either way)
KEY_BLOCK = 128
#: seconds after which a build lock is stale (a build takes well under a minute)
STALE_LOCK_S = 600
#: forces the kernel's vector width (see the module's docstring)
LANES_ENV = "GLM5_CPU_KERNEL_LANES"
#: the instruction set whose machines run each width natively
ISA_OF_LANES = {8: "AVX2", 16: "AVX-512"}


@functools.cache
def _cpu_flags() -> str:
    """/proc/cpuinfo's flags line, read once: ``cpu_kernel()`` asks for the width on every call."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return next((line for line in text.splitlines() if line.startswith(("flags", "Features"))), "")


def native_lanes() -> int:
    """This CPU's own vector width in floats: 16 with AVX-512, else 8."""
    return 16 if "avx512f" in _cpu_flags().split() else 8


def kernel_lanes() -> int:
    """The vector width the kernel is built and run with: ``GLM5_CPU_KERNEL_LANES`` or the CPU's own."""
    value = os.environ.get(LANES_ENV, "").strip()
    if not value:
        return native_lanes()
    if value not in ("8", "16"):
        raise ValueError(f"{LANES_ENV}={value!r}: the fused CPU kernel's vector width is 8 (the AVX2 path) "
                         "or 16 (the AVX-512 path), or unset for this CPU's own")
    return int(value)


def describe_lanes(lanes: int) -> str:
    """Which path a width is, and whether it is this CPU's own, for logs and the test header."""
    own = native_lanes()
    how = "this CPU's own" if lanes == own else f"forced by {LANES_ENV} on a CPU whose own is {own}"
    return f"{lanes}-lane vectors, the {ISA_OF_LANES[lanes]} path ({how})"


def _name(lanes: int) -> str:
    key = hashlib.sha1(f"{platform.machine()} {_cpu_flags()}".encode()).hexdigest()[:10]
    return f"glm5_dsa_cpu_{key}_{lanes}lanes"


def _clear_stale_lock(name: str) -> None:
    """torch's builder waits forever on the lock file of a build that was killed (a timed-out
    job, a Ctrl-C): a lock older than any real build is removed first."""
    from torch.utils.cpp_extension import _get_build_directory

    lock = Path(_get_build_directory(name, verbose=False)) / "lock"
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink(missing_ok=True)
            warnings.warn(f"removed a stale build lock {lock}", stacklevel=3)
    except FileNotFoundError:
        pass


def cpu_kernel():
    """The compiled extension module at :func:`kernel_lanes`' width, or None (with one warning)
    where it cannot be built."""
    return _built(kernel_lanes())


@functools.cache
def _built(lanes: int):
    from torch.utils.cpp_extension import load

    bin_dir = os.path.dirname(sys.executable)  # the venv's ninja, when the venv is not activated
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    try:
        _clear_stale_lock(_name(lanes))
        return load(name=_name(lanes), sources=[str(SOURCE)],
                    extra_cflags=["-O3", "-march=native", "-fopenmp", f"-DSPARSE_MLA_LANES={lanes}"],
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as err:  # no compiler, no ninja, an unsupported platform
        warnings.warn(f"the fused CPU sparse MLA kernel did not build ({type(err).__name__}: {err}); "
                      "DSA sparse attention on CPU falls back to the op-by-op torch path", stacklevel=2)
        return None


def fits_cpu_kernel(q: torch.Tensor) -> bool:
    """CPU tensors in fp32/bf16/fp16 (fp64 stays on the torch path, which computes in fp64)."""
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16, torch.float16)


class SparseLatentAttentionCPU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_lat, q_pe, kv, idx, valid, scale: float):
        out, lse, head_probs = cpu_kernel().forward(q_lat, q_pe, kv, idx, valid, scale, KEY_BLOCK)
        ctx.save_for_backward(q_lat, q_pe, kv, idx, valid, out, lse)
        ctx.scale = scale
        ctx.mark_non_differentiable(head_probs)
        ctx.set_materialize_grads(False)  # no zero-filled [b, s, k] gradient for head_probs
        return out, head_probs

    @staticmethod
    def backward(ctx, grad_out, _grad_head_probs):
        if grad_out is None:
            return (None,) * 6
        q_lat, q_pe, kv, idx, valid, out, lse = ctx.saved_tensors
        if grad_out.stride(-1) != 1:
            grad_out = grad_out.contiguous()
        grad_lat, grad_pe, grad_kv = cpu_kernel().backward(q_lat, q_pe, kv, idx, valid, ctx.scale, KEY_BLOCK,
                                                           grad_out, out, lse)
        return grad_lat, grad_pe, grad_kv, None, None, None


def sparse_mla_cpu(q_lat, q_pe, kv, idx, valid, scale: float):
    """``sparse_latent_attention`` for the absorbed query given as its two pieces, never
    concatenated: the latent part q_lat [b, s, n, dv] (dv = the values' width) and the rope part
    q_pe [b, s, n, D - dv], each in any layout whose last dim is contiguous (the absorption GEMM's
    head-major output and a slice of the query are read in place; d q_lat comes head-major too).
    kv [b, L, D] contiguous; valid may be None when every selected key is visible. Returns
    (o [b, s, n, dv] in q's dtype, a view of head-major storage [n, b, s, dv]; head_probs
    [b, s, k] fp32). o is kept for the backward (delta = rowsum(dO o)); a per-head GEMM on
    ``o.permute(2, 0, 1, 3)`` reads and keeps that same storage."""
    return SparseLatentAttentionCPU.apply(q_lat, q_pe, kv, idx, valid, scale)


def _build_both_widths() -> None:
    """What ``make`` runs once per machine: this CPU's width (every run uses it) and, in a second
    process beside it, the other width (only the kernel's tests use it). One source file is one
    compiler process, so on a 2-core machine the second build costs no wall time; left to the
    tests, it held a core of the busy suite for a minute."""
    import subprocess

    other = None
    if LANES_ENV not in os.environ:
        env = dict(os.environ, **{LANES_ENV: str(16 if native_lanes() == 8 else 8)})
        other = subprocess.Popen([sys.executable, "-m", __spec__.name], env=env)
    lanes = kernel_lanes()
    started = time.perf_counter()
    built = _built(lanes)
    print(f"fused CPU kernel: {describe_lanes(lanes)}: "
          f"{'ready' if built is not None else 'not built (the torch path is used)'} "
          f"in {time.perf_counter() - started:.1f} s")
    if other is not None:
        other.wait()


if __name__ == "__main__":  # `make` builds it once per machine: no test or run waits on the compiler
    _build_both_widths()
