"""``python -m benchmarks.gpu_check``: runs the parts, prints the table, writes the JSON (see the
package docstring)."""

from __future__ import annotations

from parallel.megatron_compat import bootstrap

bootstrap()  # before megatron-core's first import

import argparse
import datetime
import importlib
import json
import math
import os
import re
import sys
import time
import traceback

# read by CUDA's caching allocator at its first allocation: before torch is imported here. The 32K
# slice allocates and frees logits-sized blocks; expandable segments keep them from fragmenting
if "PYTORCH_CUDA_ALLOC_CONF" not in os.environ and "PYTORCH_ALLOC_CONF" not in os.environ:
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.gpu_check import __doc__ as DOC  # noqa: E402
from benchmarks.gpu_check.common import KERNEL_MODULES, RESULTS_DIR, environment, ieee_fp32_matmuls  # noqa: E402
from benchmarks.gpu_check.kernels import (_sparse_shapes, flash_sdpa, kernel_document_attention,  # noqa: E402
                                          kernel_indexer, kernel_indexer_kl, kernel_sparse_mla)
from benchmarks.gpu_check.slice import run_slice  # noqa: E402
from benchmarks.gpu_check.tiny import train_tiny  # noqa: E402


def _fmt(v, spec=".3g"):
    return "-" if v is None else format(v, spec) if isinstance(v, (int, float)) else str(v)


def table(report: dict) -> str:
    env = report["environment"]
    te_ok = {True: "yes", False: "NO", None: "-"}[env["transformer_engine_in_range"]]
    lines = [f"environment: torch {env['torch']}, CUDA {env['cuda_runtime']}, triton {env['triton']}, "
             f"TE {env['transformer_engine']} (supported {env['transformer_engine_range']}: {te_ok}), "
             f"megatron-core {env['megatron_core']}, "
             f"GPU {env['gpu']}, container {_fmt(env['container'])}",
             f"{'part':<26} {'ok':<4} details"]
    skipped = [n for n, r in report.items() if isinstance(r, dict) and r.get("skipped", "").startswith("budget")]
    for name, r in report.items():
        if not isinstance(r, dict) or name == "environment":
            continue
        ok = "skip" if name in skipped else "ok" if r.get("ok", "error" not in r) else "FAIL"
        if "error" in r:
            detail = r["error"][:110]
        elif "skipped" in r:
            detail = "skipped: " + r["skipped"]
        elif name.startswith("tiny_"):
            detail = (f"{r['watched']} " + " -> ".join(f"{s[r['watched']]:.4f}" for s in r["steps"])
                      + f", {r['steps'][-1]['seconds']:.2f} s/step")
        elif name == "flash_sdpa":
            detail = (f"L={r.get('L')}: fwd {_fmt(r.get('fwd_ms'))} ms ({_fmt(r.get('fwd_tflops'))} TFLOP/s), "
                      f"fwd+bwd {_fmt(r.get('fwd_bwd_ms'))} ms ({_fmt(r.get('fwd_bwd_tflops'))})")
        elif name.startswith("kernel_"):
            err = r.get("rel_err", max(r.get("fwd_rel_err", 0), r.get("bwd_rel_err", 0)))
            speed = ""
            if r.get("fwd_ms") is not None and r.get("bwd_ms") is not None:
                speed = (f"; fwd {r['fwd_ms']:.2f} ms ({_fmt(r['fwd_tflops'])} TFLOP/s), bwd {r['bwd_ms']:.2f} ms "
                         f"({_fmt(r['bwd_tflops'])}), vs flash fwd+bwd {_fmt(r.get('vs_flash_fwd_bwd'))}x")
            elif r.get("fwd_bwd_ms") is not None:
                speed = f"; fwd+bwd {r['fwd_bwd_ms']:.2f} ms ({_fmt(r['fwd_bwd_tflops'])} TFLOP/s)"
            elif r.get("ms") is not None:
                speed = f"; {r['ms']:.2f} ms ({_fmt(r['tflops'])} TFLOP/s)"
            detail = f"err {err:.2e} (tol {r['tol']:.0e}){speed}"
        elif name.startswith("slice_"):
            p = r["planner"]
            detail = (f"{r['dsa_mode']} L={r['seq']}: fwd+bwd {r['fwd_bwd_s']:.3f} s (planner {p['fwd_bwd_s']:.3f}), "
                      f"{_fmt(r['tflops'])} TFLOP/s, peak {_fmt(r.get('peak_memory_gib'))} GiB (planner "
                      f"{_fmt(p['peak_memory_gib'])} of {_fmt(p['gpu_memory_gib'])}, {p['cluster']}); "
                      f"measured/planner {_fmt(r['measured_over_planner'])}")
        else:
            detail = r.get("skipped", "")
        lines.append(f"{name:<26} {ok:<4} {detail}")
    verdict = "FAILED" if not report["ok"] else f"OK, {len(skipped)} skipped" if skipped else "ALL OK"
    lines.append(f"total {report['total_wall_s']:.1f} s: {verdict}")
    return "\n".join(lines)


def _default_json(device: str) -> str:
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")
    return os.path.join(RESULTS_DIR, f"gpu-{datetime.date.today().isoformat()}-{slug}.json")


#: seconds a part takes at most, as far as measured (CPU: this machine's 2 cores; CUDA: to be
#: replaced by the first GPU run's wall_s): --budget-s skips a part whose estimate exceeds the
#: time left. The first part also pays for the imports and process-group start.
ESTIMATE_S = {"cpu": {"tiny_dense": 45, "tiny_warmup": 25, "tiny_sparse": 70, "kernel_sparse_mla": 10,
                      "slice_dense_4k": 10, "slice_sparse_32k": 15},
              "cuda": {"tiny_dense": 60, "tiny_warmup": 20, "tiny_sparse": 30, "tiny_te_dense": 30,
                       "flash_sdpa": 10, "kernel_sparse_mla": 60, "kernel_indexer_kl": 30,
                       "kernel_document_attention": 30, "slice_dense_4k": 60, "slice_sparse_32k": 120}}
DEFAULT_ESTIMATE_S = 5
TINY_SEQ = (16, 4096)  #: --seq bounds: the tiny GLM-5's sequence on one device


#: each numeric option: (argparse name, what it must be, the test); None (the default) passes.
#: Kept here rather than in pretrain.config.numbers: importing the run's packages would load
#: megatron before --device cpu sets TRITON_INTERPRET
NUMERIC_ARGS = (
    ("steps", "at least 2 (the losses must be seen to fall)", lambda v: v >= 2),
    ("seq", f"between {TINY_SEQ[0]} and {TINY_SEQ[1]} (the tiny model's sequence)",
     lambda v: TINY_SEQ[0] <= v <= TINY_SEQ[1]),
    ("reps", "at least 1", lambda v: v >= 1),
    ("budget_s", "a positive number of seconds", lambda v: math.isfinite(v) and v > 0),
)


def _bad_arguments(args) -> str | None:
    """The first argument error, named with its value (checked before any work)."""
    for name, must, ok in NUMERIC_ARGS:
        value = getattr(args, name)
        if value is not None and not ok(value):
            return f"--{name.replace('_', '-')} {value}: {must}"
    if args.json is not None:
        folder = os.path.dirname(os.path.abspath(args.json)) or "."
        if os.path.isdir(args.json):
            return f"--json {args.json}: a folder (give a file path)"
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            return f"--json {args.json}: {folder} is not a writable folder"
    return None


def write_report(path: str, report: dict) -> None:
    """The report as it stands, atomically (a kill leaves the last complete one)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(json.dumps(report, indent=1, default=str))
    os.replace(tmp, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=DOC.splitlines()[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=None, help="tiny-model steps (default: cuda 4, cpu 3)")
    ap.add_argument("--seq", type=int, default=None, help="tiny-model sequence (default: cuda 256, cpu 64)")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions (medians)")
    ap.add_argument("--json", default=None, help="output path (default: benchmarks/results/gpu-<date>-<gpu>.json); "
                    "rewritten after every part")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="wall-clock budget: parts that would not fit the time left are skipped (and recorded)")
    args = ap.parse_args(argv)
    bad = _bad_arguments(args)
    if bad:
        print(f"error: {bad}", file=sys.stderr)
        return 2
    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda: no CUDA device visible (use --device cpu)", file=sys.stderr)
        return 2
    if dev == "cpu":  # before any kernel module is imported: @triton.jit reads it then
        loaded = [m for m in sys.modules if m.startswith(KERNEL_MODULES)]
        if loaded and os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit(f"--device cpu: kernel modules imported before TRITON_INTERPRET=1: {loaded}")
        os.environ["TRITON_INTERPRET"] = "1"
        torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    steps = args.steps or (4 if dev == "cuda" else 3)
    seq = args.seq or (256 if dev == "cuda" else 64)
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    path = args.json or _default_json(dev)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    report = {"environment": environment(dev), "ok": True, "finished": False, "budget_s": args.budget_s,
              "json": path}
    if dev == "cuda":
        ieee_fp32_matmuls()

    def interpreter_bf16():  # the interpreter's bf16 dot/cast made the GPU's
        if dev == "cpu":
            from model_providers.glm5.model.dsa.kernels.interpreter import bf16_as_on_gpu

            bf16_as_on_gpu()

    flash: dict = {}
    te = dev == "cuda" and importlib.util.find_spec("transformer_engine") is not None
    sparse_L = _sparse_shapes(dev)["time_L"] or 0
    parts = [
        ("tiny_dense", lambda: train_tiny(dev, "local", "dense", steps, seq)),
        ("tiny_warmup", lambda: train_tiny(dev, "local", "warmup", steps, seq)),
        ("tiny_sparse", lambda: train_tiny(dev, "local", "sparse", steps, seq)),
        ("tiny_te_dense", (lambda: train_tiny(dev, "te", "dense", steps, seq)) if te else None),
        ("flash_sdpa", lambda: flash.update(flash_sdpa(dev, sparse_L, args.reps)) or flash),
        ("kernel_sparse_mla", lambda: kernel_sparse_mla(dev, args.reps, flash)),
        ("kernel_indexer_fp8", lambda: kernel_indexer(dev, args.reps, "fp8")),
        ("kernel_indexer_bf16", lambda: (interpreter_bf16(), kernel_indexer(dev, args.reps, "bf16"))[1]),
        ("kernel_indexer_kl", lambda: kernel_indexer_kl(dev, args.reps)),
        ("kernel_document_attention", lambda: kernel_document_attention(dev, args.reps, flash)),
        ("slice_dense_4k", lambda: run_slice(dev, "dense", 4096 if dev == "cuda" else 64, args.reps)),
        ("slice_sparse_32k", lambda: run_slice(dev, "sparse", 32768 if dev == "cuda" else 128, args.reps)),
    ]
    failed = False
    t_start = time.perf_counter()
    for name, part in parts:
        report["total_wall_s"] = round(time.perf_counter() - t_start, 2)
        if part is None:
            report[name] = {"ok": True, "skipped": "transformer_engine does not import (or no GPU)"}
            continue
        need = ESTIMATE_S[dev].get(name, DEFAULT_ESTIMATE_S)
        left = None if args.budget_s is None else args.budget_s - (time.perf_counter() - t_start)
        if left is not None and need > left:
            report[name] = {"ok": True, "skipped": f"budget: needs ~{need} s, {max(left, 0):.0f} s left"}
            write_report(path, report)
            continue
        t0 = time.perf_counter()
        try:
            report[name] = dict(part())
            report[name].setdefault("ok", True)
        except Exception as e:  # noqa: BLE001 -- record (import errors too) and go on
            report[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000],
                            "traceback": traceback.format_exc()[-4000:]}
        failed |= not report[name]["ok"]
        report[name]["wall_s"] = round(time.perf_counter() - t0, 2)
        report["ok"] = not failed
        report["total_wall_s"] = round(time.perf_counter() - t_start, 2)
        write_report(path, report)
        print(f"{name}: {'ok' if report[name]['ok'] else 'FAILED'} ({report[name]['wall_s']} s)", flush=True)
        if dev == "cuda":
            torch.cuda.empty_cache()
    report["total_wall_s"] = round(time.perf_counter() - t_start, 2)
    report["finished"] = True
    write_report(path, report)
    print(table(report), flush=True)
    print(f"wrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
