"""Test support for Triton kernels run by the CPU interpreter (TRITON_INTERPRET=1)."""


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
