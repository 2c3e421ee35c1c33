"""Test support for Triton kernels run by the CPU interpreter (TRITON_INTERPRET=1)."""


def bf16_as_on_gpu() -> None:
    """triton 3.9's interpreter holds bf16 as raw uint16 bits and (1) ``tl.dot`` multiplies
    those bits as integers, (2) casts fp32 -> bf16 by truncation. A GPU multiplies the values
    (exact products, fp32 sums) and rounds to nearest even: make the interpreter do that. Test
    only; the kernels carry no interpreter branches. (triton-lang/triton#11584: the interpreter
    does not support bf16 arithmetic; loads, stores, transposes and casts are what we use.)"""
    import numpy as np
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    dot, cast = InterpreterBuilder.create_dot, InterpreterBuilder.cast_impl

    def widen(h):
        if h.dtype.scalar != tl.bfloat16:
            return h
        return TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            u = np.asarray(src.data, dtype=np.float32).view(np.uint32).astype(np.uint64)
            return TensorHandle(((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16), tl.bfloat16)
        return cast(self, src, dst_type)

    InterpreterBuilder.create_dot, InterpreterBuilder.cast_impl = create_dot, cast_impl


def autotune_first_config() -> None:
    """triton's autotuner times every config with the active GPU driver's benchmarker, which the
    interpreter lacks: keep each autotuned kernel's first config (its results are what the test
    checks; a config only changes the blocking). Test only: megatron's fused MLA RoPE kernels
    are autotuned."""
    from triton.runtime.autotuner import Autotuner

    Autotuner.prune_configs = lambda self, kwargs: self.configs[:1]
    Autotuner.do_bench = property(lambda self: lambda kernel_call, quantiles: [1.0] * len(quantiles))


def collect_in_interpreter(module: str) -> dict:
    """``module._collect()``'s JSON-able result, computed in a fresh process with
    TRITON_INTERPRET=1: triton reads the variable when ``@triton.jit`` runs (the kernel modules'
    import), so a test process that imported them without it cannot interpret them. The result
    must say ``"interpreted": True`` (the kernels did run in the interpreter)."""
    import json
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": repo, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}
    code = f"import json; from {module} import _collect; print(json.dumps(_collect()))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["interpreted"], "the kernels did not run in the Triton interpreter"
    return res
