"""The strict CUDA emulation on real training runs: it changes no number (losses bit-identical to
the plain emulation), counts the step's host syncs, and fails -- naming the op -- where a GPU run
would: a batch left on the host, a host tensor handed to a collective, a parameter built on the
host. (Every parallel layout runs under it in the parity tests.)"""

import subprocess
import sys

import pytest

from tests.support.launch import QUIET, REPO, read_metrics, run_train, train_env

COMMON = ["trainer.steps=2", "trainer.seq_length=64", "trainer.global_batch_size=4",
          "trainer.micro_batch_size=2", "model.dsa.topk=16", "checkpoint.save_at_end=false"]
MODES = {
    "dense": [],
    # kernels=torch: the strict run's tensors are on the tracked device, where auto picks the
    # torch path (a GPU's kernels, not the fused CPU one: sparse MLA, the sparse KL and the dense
    # KL's row work); the plain run must take the same path
    "warmup": ["model.dsa.mode=warmup", "model.dsa.kernels=torch"],
    "sparse_fp8_indexer": ["model.dsa.mode=sparse", "model.dsa.indexer_dtype=fp8",
                           "model.dsa.index_head_dim=128", "model.dsa.kernels=torch"],
}


@pytest.mark.heavy
@pytest.mark.parametrize("mode", list(MODES))
def test_strict_run_equals_plain_bit_for_bit_and_counts_host_syncs(tmp_path, mode):
    runs = {}
    for emulation in ("plain", "strict"):
        run_dir = tmp_path / emulation
        run_train([*COMMON, *MODES[mode], f"trainer.run_dir={run_dir}",
                   f"parallel.cpu_emulation={emulation}"])
        runs[emulation] = read_metrics(str(run_dir))
    plain, strict = runs["plain"], runs["strict"]
    assert len(plain) == len(strict) == 2
    for a, b in zip(plain, strict):
        for key in ("loss", "lm_loss", "mtp_loss", "grad_norm", "moe_load_imbalance"):
            assert a[key] == b[key], (mode, a["step"], key)
        assert "host_syncs" not in a
        # our step syncs once to decide a skip and once for its metrics, megatron's grad clip
        # once; the rest is megatron's unfused MoE permutation and alltoall sync points
        assert b["host_syncs"] >= 3, b


def _mutated(tmp_path, mutation: str, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "tests.support.strict_mutations", mutation, *QUIET, *COMMON,
           f"trainer.run_dir={tmp_path / (mutation + '_' + extra[-1].split('=')[-1] if extra else mutation)}",
           "parallel.cpu_emulation=strict", *extra]
    return subprocess.run(cmd, cwd=REPO, env=train_env(1), capture_output=True, text=True, timeout=600)


@pytest.mark.heavy
@pytest.mark.parametrize("mutation, extra, message", [
    ("batch_on_host", [], r"cuda:0 and cpu! \(when checking arguments for aten::embedding"),
    ("host_collective", [], r"No backend type associated with device type cpu: c10d::allreduce_"),
    # warm-up trains the indexer, whose projections are plain torch.nn.Linear
    ("host_parameter", ["model.dsa.mode=warmup"], r"cuda:0 and cpu! \(when checking arguments for aten::"),
])
def test_strict_emulation_fails_where_a_gpu_would(tmp_path, mutation, extra, message):
    import re

    proc = _mutated(tmp_path, mutation, *extra)
    assert proc.returncode != 0
    assert re.search(message, proc.stderr), proc.stderr[-3000:]
    # the same mistake passes unnoticed under the plain emulation
    plain = _mutated(tmp_path, mutation, *extra, "parallel.cpu_emulation=plain")
    assert plain.returncode == 0, plain.stderr[-3000:]
