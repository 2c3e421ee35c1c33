"""The GPU check (``python -m benchmarks.gpu_check``, ``make gpu-check``) runs on CPU too: the
training steps under the strict CUDA emulation, the Triton kernels in the interpreter, the tiny
GLM-5 as the slice. So the one command a new GPU node runs cannot rot: every part is present and
ok, the tiny model's losses are finite and falling in dense, warm-up and sparse DSA mode, every
kernel matches its torch reference within the entry's tolerance, and the slice has a planner
prediction beside its measurement."""

import json
import math
import subprocess
import sys

import pytest

from tests.support.launch import REPO, train_env

KERNELS = ("kernel_sparse_mla", "kernel_indexer_fp8", "kernel_indexer_bf16", "kernel_indexer_kl",
           "kernel_document_attention")
PARTS = ("tiny_dense", "tiny_warmup", "tiny_sparse", "tiny_te_dense", "flash_sdpa", *KERNELS,
         "slice_dense_4k", "slice_sparse_32k")


@pytest.mark.heavy
def test_gpu_check_runs_on_cpu(tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--device", "cpu", "--json", str(out)],
                          cwd=REPO, env=train_env(1), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ALL OK" in proc.stdout and str(out) in proc.stdout, proc.stdout[-3000:]
    report = json.loads(out.read_text())
    env = report["environment"]
    assert report["ok"] and env["device"] == "cpu" and env["triton_interpret"], env
    for part in PARTS:
        assert report[part]["ok"] is True and "error" not in report[part], (part, report[part])
    for run in ("tiny_dense", "tiny_warmup", "tiny_sparse"):
        r = report[run]
        losses = [s[r["watched"]] for s in r["steps"]]
        assert len(losses) == 3 and all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], (run, r)
        assert not any(s["skipped"] for s in r["steps"]) and all(s["host_syncs"] >= 3 for s in r["steps"])
    assert report["tiny_warmup"]["watched"] == "indexer_kl"  # the frozen network: only the KL falls
    for name in KERNELS:  # fp32 in the interpreter (the bf16 indexer: bf16 math) under each tolerance
        r = report[name]
        errors = [r[key] for key in ("rel_err", "fwd_rel_err", "bwd_rel_err") if key in r]
        assert errors and max(errors) <= r["tol"] <= 2e-3, (name, r)
    assert report["kernel_sparse_mla"]["fast"]["bitwise"] and report["kernel_sparse_mla"]["precise"]["bitwise"]
    for name in ("slice_dense_4k", "slice_sparse_32k"):
        r = report[name]
        assert math.isfinite(r["lm_loss"]) and r["fwd_bwd_s"] > 0 and r["planner"]["fwd_bwd_s"] > 0, r
    assert report["slice_sparse_32k"]["dsa_mode"] == "sparse" and report["slice_dense_4k"]["dsa_mode"] == "dense"
