"""The GPU check (``python -m benchmarks.gpu_check``, ``make gpu-check``) runs on CPU too: the
training steps under the strict CUDA emulation, the Triton kernels in the interpreter, the tiny
GLM-5 as the slice. So the one command a new GPU node runs cannot rot: every part is present and
ok, the tiny model's losses are finite and falling in dense, warm-up and sparse DSA mode, every
kernel matches its torch reference within the entry's tolerance, and the slice has a planner
prediction beside its measurement. The JSON is there after every part (a run killed at its
limit keeps what finished); ``--budget-s`` skips what does not fit; bad arguments get one line."""

import json
import math
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from tests.support.launch import REPO, train_env

KERNELS = ("kernel_sparse_mla", "kernel_indexer_fp8", "kernel_indexer_bf16", "kernel_indexer_kl",
           "kernel_document_attention")
PARTS = ("tiny_dense", "tiny_warmup", "tiny_sparse", "tiny_te_dense", "flash_sdpa", *KERNELS,
         "slice_dense_4k", "slice_sparse_32k")


def _run_watching(cmd: list, out) -> tuple:
    """Run ``cmd`` to its end, reading ``out`` as it goes: (process, stdout, the JSON snapshots
    seen before the end, each a set of the parts it held)."""
    log = out.with_suffix(".log")
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, env=train_env(1), stdout=f, stderr=subprocess.STDOUT, text=True)
        snapshots, deadline = [], time.monotonic() + 600
        while proc.poll() is None and time.monotonic() < deadline:
            if out.exists():
                report = json.loads(out.read_text())  # never half-written: replaced atomically
                if not report["finished"]:
                    snapshots.append(frozenset(k for k, v in report.items() if isinstance(v, dict) and "ok" in v))
            time.sleep(0.5)
        proc.wait(timeout=max(1, deadline - time.monotonic()))
    return proc, log.read_text(), snapshots


@pytest.mark.heavy
def test_gpu_check_runs_on_cpu(tmp_path):
    out = tmp_path / "gpu.json"
    proc, stdout, snapshots = _run_watching(
        [sys.executable, "-m", "benchmarks.gpu_check", "--device", "cpu", "--json", str(out)], out)
    assert proc.returncode == 0, stdout[-6000:]
    assert "ALL OK" in stdout and str(out) in stdout, stdout[-3000:]
    # written after every part: snapshots with the first parts and not yet the last
    assert any("tiny_dense" in s and "slice_sparse_32k" not in s for s in snapshots), snapshots
    report = json.loads(out.read_text())
    assert report["finished"] and not list(tmp_path.glob("gpu.json.tmp*"))
    env = report["environment"]
    assert report["ok"] and env["device"] == "cpu" and env["triton_interpret"], env
    # the TE range it checks is the gpu extra's; no NGC image here, no TE
    extra = tomllib.loads((Path(REPO) / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    assert extra == [f"transformer-engine[pytorch]{env['transformer_engine_range']}"], (extra, env)
    assert env["container"] is None and env["transformer_engine_in_range"] is None, env
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


@pytest.mark.heavy
def test_budget_skips_and_records_what_does_not_fit(tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--device", "cpu", "--budget-s", "0.5",
                           "--json", str(out)], cwd=REPO, env=train_env(1), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["finished"] and report["budget_s"] == 0.5
    for part in PARTS:
        if part != "tiny_te_dense":
            assert report[part]["skipped"].startswith("budget: needs ~"), (part, report[part])
    assert "OK, 11 skipped" in proc.stdout


@pytest.mark.parametrize("args, message", [
    (["--steps", "0"], "error: --steps 0: at least 2"),
    (["--seq", "100000"], "error: --seq 100000: between 16 and 4096"),
    (["--budget-s", "-5"], "error: --budget-s -5.0: a positive number of seconds"),
    (["--json", "."], "error: --json .: a folder"),
    (["--json", "/nonexistent-dir/r.json"], "error: --json /nonexistent-dir/r.json: /nonexistent-dir is not a writable"),
])
def test_bad_arguments_get_one_line_before_any_work(capsys, args, message):
    from benchmarks.gpu_check.__main__ import main

    assert main(["--device", "cpu", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err


def test_slice_fits_an_h100_with_a_tenth_free():
    """The 32K sparse slice (the larger) by the planner's model, layers with and without TE."""
    from benchmarks.gpu_check.slice import SLICE_MEMORY_SHARE, planner_prediction, slice_overrides
    from pretrain.config.schema import compose, to_run_config

    rc = to_run_config(compose(slice_overrides("cuda", "sparse", 32768)))
    for backend in ("local", "te"):
        p = planner_prediction(rc, "h100_80gb", backend)
        assert p["gpu_memory_gib"] == 79.6
        assert p["peak_memory_gib"] <= SLICE_MEMORY_SHARE * p["gpu_memory_gib"], (backend, p)
        assert p["peak_memory_gib"] > 40, p  # the real-width slice: the logits alone take 30 GiB


def test_the_image_and_whether_its_te_is_supported_are_recorded(monkeypatch):
    """An NGC image names itself (``NVIDIA_PYTORCH_VERSION``); a TE outside the supported range
    (megatron-core 0.19.2's lock is 2.18.0, its grouped-MLP paths need 2.14) is flagged."""
    from benchmarks.gpu_check.common import container, te_in_range

    monkeypatch.setenv("NVIDIA_PYTORCH_VERSION", "26.06")
    assert container() == "nvcr.io/nvidia/pytorch:26.06-py3"
    monkeypatch.delenv("NVIDIA_PYTORCH_VERSION")
    assert container() is None
    assert [te_in_range(v) for v in ("2.18.0+27486e03", "2.14.0", "2.9.0", "2.19.0", "2.13.1")] == [
        True, True, False, False, False]
    assert te_in_range("unavailable (ModuleNotFoundError)") is None
