"""Registers, spills and shared memory of every Triton kernel the model launches, compiled for
sm_90a (H100/H200) at GLM-5 shapes, without a GPU.

Each kernel is compiled offline (``triton.compile`` of an ``ASTSource`` for
``GPUTarget("cuda", 90, 32)``) with the signature, specialisation and constexprs its real launch
gives it at GLM-5 shapes (the kernels' own config constants and launch helpers), then its PTX goes
through the ptxas Triton uses, with Triton's flags and ``-v``. Per kernel: registers per thread,
spill stores / loads (bytes per thread), shared memory (Triton's dynamic allocation plus any
static ``smem``), warps, pipeline stages and the tile. Shapes: 64 heads per program (one TP
rank's heads), MLA latent 512 + rope 64, k = 2048 selected keys, dense MLA head q/k 192 + 64 =
256 and v 256, indexer 32 heads x 128, sequences of 202,752 tokens, bf16 where the GPU path is.

    python -m benchmarks.kernel_resources [--json PATH] [--only SUBSTRING]

An H100/H200 block may use 227 KiB of shared memory; ``tests/unit/model/test_kernel_resources.py``
holds the sparse MLA backward to no spills within that, and every kernel module's stated
numbers (its ``RESOURCES``) to what this reports.
"""

from __future__ import annotations

from parallel.megatron_compat import bootstrap

bootstrap()  # before megatron-core's first import

import argparse
import dataclasses
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile

import torch

ARCH = 90  # sm_90a: Triton compiles capability 90 for the "a" features (wgmma)
SHARED_LIMIT_KIB = 227  # shared memory one block may use on an H100/H200
SEQ = 202_752  # tokens (GLM-5's context)
HEADS, LATENT, ROPE, TOPK = 64, 512, 64, 2048  # sparse MLA per TP rank
DENSE_QK, DENSE_V = 192 + 64, 256  # dense MLA head
INDEX_HEADS, INDEX_DIM = 32, 128

KERNELS = "model_providers.glm5.model.dsa.kernels"


def _module(name: str):
    # kernels/__init__ binds a function named like its module (sparse_mla_triton): import by path
    return importlib.import_module(f"{KERNELS}.{name}")


@dataclasses.dataclass
class Spec:
    """One launch: the kernel, its arguments by name (meta-device tensors for pointers, ints,
    floats, constexprs; names the kernel lacks are ignored) and the launch options (None:
    Triton's defaults, as a launch that passes none)."""

    name: str
    kernel: object
    args: dict
    num_warps: int | None
    num_stages: int | None
    tile: str


def _t(dtype, *shape):
    return torch.empty(*shape, dtype=dtype, device="meta")


def compile_spec(spec: Spec):
    """The CompiledKernel the launch would build on an sm_90a GPU: Triton's own binder gives the
    signature, the 16-byte divisibility attributes and the constexprs, as ``JITFunction.run``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = spec.kernel
    target = GPUTarget("cuda", ARCH, 32)
    backend = make_backend(target)
    args = {name: spec.args[name] for name in fn.arg_names if name in spec.args}
    options = {key: v for key, v in (("num_warps", spec.num_warps), ("num_stages", spec.num_stages))
               if v is not None}
    options["debug"] = False
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, opts = binder(**args, **options)
    opts, signature, constexprs, attrs = fn._pack_args(backend, options, bound, specialization, opts)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=opts.__dict__)


def ptxas_usage(compiled) -> dict:
    """ptxas -v on the kernel's PTX, with the ptxas and flags Triton compiled its cubin with."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    arch = sm_arch_from_capability(ARCH)
    flags = ["-lineinfo", "-v", "--regAllocOptLevel=2", f"--gpu-name={arch}"]
    if not compiled.metadata.enable_fp_fusion:
        flags.append("--fmad=false")
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        log = subprocess.run([get_ptxas(ARCH).path, *flags, ptx, "-o", ptx + ".cubin"], check=True,
                             capture_output=True, text=True).stderr
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    smem = re.search(r"(\d+) bytes smem", log)
    return {"arch": arch, "registers": int(re.search(r"Used (\d+) registers", log).group(1)),
            "spill_stores": int(spills.group(1)), "spill_loads": int(spills.group(2)),
            "static_smem": int(smem.group(1)) if smem else 0}


def resources(spec: Spec) -> dict:
    """Compile ``spec`` and report its row of the table."""
    compiled = compile_spec(spec)
    use = ptxas_usage(compiled)
    shared = compiled.metadata.shared + use.pop("static_smem")
    return {"kernel": spec.name, "function": spec.kernel.__name__, **use, "shared_bytes": shared,
            "shared_kib": round(shared / 1024, 2), "num_warps": compiled.metadata.num_warps,
            "num_stages": compiled.metadata.num_stages, "tile": spec.tile}


# --------------------------------------------------------------------------------- the kernels
def sparse_mla_specs() -> list[Spec]:
    m = _module("sparse_mla_triton")
    bf16, f32, i64, u8 = torch.bfloat16, torch.float32, torch.int64, torch.uint8
    b, s, n, dim, k = 1, SEQ, HEADS, LATENT + ROPE, TOPK
    q = _t(bf16, b, s, n, dim)
    chunk, _ = m.backward_chunk_plan(b, s, n, dim, k)
    specs = []
    for precise in (False, True):
        mode = " precise" if precise else ""
        meta = m._meta(q, LATENT, m.HEAD_GROUP, precise)
        for part, cfg, kernel in (("forward", m.FWD_CONFIG, m._sparse_mla_fwd_kernel),
                                  ("backward", m.BWD_CONFIG, m._sparse_mla_bwd_kernel)):
            launch = m._launch(cfg, k, None, None, None)
            args = dict(q_ptr=q, kv_ptr=_t(bf16, b, s, dim), idx_ptr=_t(i64, b, s, k),
                        valid_ptr=_t(u8, b, s, k), o_ptr=_t(bf16, b, s, n, LATENT),
                        do_ptr=_t(bf16, b, s, n, LATENT), delta_ptr=_t(f32, b, s, n), lse_ptr=_t(f32, b, s, n),
                        hp_ptr=_t(f32, 1, b, s, k), dq_ptr=_t(bf16, b, s, n, dim),
                        part_ptr=_t(f32, chunk * k, dim), dest_ptr=_t(i64, chunk * k),
                        T0=0, C=chunk, S=s, NH=n, K=k, L=s, scale=dim ** -0.5, **meta, **launch)
            specs.append(Spec(f"sparse MLA {part}{mode}", kernel, args, launch["num_warps"], launch["num_stages"],
                              f"{meta['BLOCK_H']} heads x {launch['BLOCK_N']} keys, {LATENT}+{ROPE}"))
        if not precise:  # fast mode's delta = rowsum(dO * O) before the backward
            specs.append(Spec("sparse MLA delta", m._sparse_mla_delta_kernel,
                              dict(o_ptr=_t(bf16, b, s, n, LATENT), do_ptr=_t(bf16, b, s, n, LATENT),
                                   delta_ptr=_t(f32, b, s, n), S=s, NH=n, **meta),
                              m.DELTA_CONFIG["num_warps"], None, f"{meta['BLOCK_H']} heads x {LATENT}"))
    return specs


def ordered_rows_specs() -> list[Spec]:
    m = _module("ordered_rows")
    rows = _module("sparse_mla_triton").backward_chunk_plan(1, SEQ, HEADS, LATENT + ROPE, TOPK)[0] * TOPK
    args = dict(keys_ptr=_t(torch.int64, rows), part_ptr=_t(torch.float32, rows, LATENT + ROPE),
                acc_ptr=_t(torch.float32, SEQ, LATENT + ROPE), N=rows, NKEYS=SEQ, D=LATENT + ROPE,
                BLOCK_P=m.REDUCE_BLOCK_P, BLOCK_D=m.REDUCE_BLOCK_D)
    return [Spec("ordered-rows reduction", m._ordered_rows_kernel, args, None, None,
                 f"{m.REDUCE_BLOCK_P} rows x {m.REDUCE_BLOCK_D} dims")]


def indexer_specs() -> list[Spec]:
    m, f = _module("indexer_triton"), _module("indexer_fp8_triton")
    b, s, H, d = 1, SEQ, INDEX_HEADS, INDEX_DIM
    bm, bn, nw, ns = f.DEFAULT_BLOCK_M, f.DEFAULT_BLOCK_N, f.DEFAULT_NUM_WARPS, f.DEFAULT_NUM_STAGES
    chunk = 256  # the indexer's query chunk (conf dsa.query_chunk): q and w are its slices
    strides = dict(s_qb=s * H * d, s_qm=H * d, s_qh=d, s_qsb=chunk * H, s_qsm=H, s_kb=s * d, s_kn=d,
                   s_ksb=s, s_wb=s * H, s_wm=H, s_ob=chunk * s, s_om=s)
    specs = []
    for name, dt, fp8 in (("bf16", torch.bfloat16, False), ("fp8", torch.float8_e4m3fn, True)):
        args = dict(q_ptr=_t(dt, b, chunk, H, d), qs_ptr=_t(torch.float32, b, chunk, H),
                    k_ptr=_t(dt, b, s, d), ks_ptr=_t(torch.float32, b, s), w_ptr=_t(torch.float32, b, chunk, H),
                    pos_ptr=_t(torch.int64, chunk), o_ptr=_t(torch.float32, b, chunk, s), SQ=chunk, SK=s,
                    **strides, H=H, D=d, BLOCK_D=d, BLOCK_M=bm, BLOCK_N=bn, FP8=fp8, PRECISE_ACC=False)
        specs.append(Spec(f"indexer logits {name}", m._index_logits_kernel, args, nw, ns,
                          f"{bm} queries x {bn} keys, {H} heads x {d}"))
    args = dict(q_ptr=_t(torch.float8_e4m3fn, b, chunk, H, d), qs_ptr=_t(torch.float32, b, chunk, H),
                k_ptr=_t(torch.float8_e4m3fn, b, s, d), ks_ptr=_t(torch.float32, b, s),
                w_ptr=_t(torch.float32, b, chunk, H), o_ptr=_t(torch.float32, b, chunk, s), SQ=chunk, SK=s,
                q_offset=0, **strides, H=H, D=d, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=False, PRECISE_ACC=False)
    specs.append(Spec("indexer fp8 (quantised keys)", f._fp8_index_kernel, args, nw, ns,
                      f"{bm} queries x {bn} keys, {H} heads x {d}"))
    return specs


def indexer_kl_specs() -> list[Spec]:
    m = _module("indexer_kl_triton")
    b, s, H, d, k = 1, SEQ, INDEX_HEADS, INDEX_DIM, TOPK
    cfg = m.KL_CONFIG
    chunk = max(1, min(s, m.PARTIAL_BUDGET // (b * k * d * 4)))
    specs = []
    for name, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        fp32 = dt == torch.float32
        args = dict(q_ptr=_t(dt, b, s, H, d), k_ptr=_t(dt, b, s, d), w_ptr=_t(torch.float32, b, s, H),
                    idx_ptr=_t(torch.int64, b, s, k), valid_ptr=_t(torch.uint8, b, s, k),
                    t_ptr=_t(torch.float32, b, s, k), kl_ptr=_t(torch.float32, b, s),
                    dq_ptr=_t(torch.float32, b, s, H, d), dw_ptr=_t(torch.float32, b, s, H),
                    part_ptr=_t(torch.float32, b * chunk * k, d), dest_ptr=_t(torch.int64, b * chunk * k),
                    T0=0, C=chunk, S=s, H=H, K=k, L=s, D=d, HAS_VALID=True, WANT_GRADS=True,
                    BLOCK_H=H, BLOCK_D=d, BLOCK_N=cfg["block_n"], DOT_PREC="ieee" if fp32 else "tf32",
                    SPLIT=not fp32)
        specs.append(Spec(f"indexer KL {name} (with gradients)", m._indexer_kl_kernel, args,
                          cfg["num_warps"], cfg["num_stages"], f"{H} heads x {cfg['block_n']} keys x {d}"))
    return specs


def document_attention_specs() -> list[Spec]:
    m = _module("document_attention_triton")
    s, b, n = SEQ, 1, HEADS
    q, v = _t(torch.bfloat16, s, b, n, DENSE_QK), _t(torch.bfloat16, s, b, n, DENSE_V)
    dims = m._dims(q, v)

    def st(p: str, d: int) -> dict:  # strides of a contiguous [s, b, n, d] tensor, named as the kernels do
        return {f"s{p}_s": b * n * d, f"s{p}_b": n * d, f"s{p}_h": d}

    common = dict(q_ptr=q, k_ptr=_t(torch.bfloat16, s, b, n, DENSE_QK), v_ptr=v, o_ptr=v, do_ptr=v,
                  lse_ptr=_t(torch.float32, b * n, s), delta_ptr=_t(torch.float32, b * n, s),
                  pos_ptr=_t(torch.int64, s), first_ptr=_t(torch.int64, b, s), row_lo_ptr=_t(torch.int64, s),
                  row_hi_ptr=_t(torch.int64, b, s), dq_ptr=q, dk_ptr=q, dv_ptr=v,
                  **st("q", DENSE_QK), **st("k", DENSE_QK), **st("v", DENSE_V), **st("o", DENSE_V),
                  **st("d", DENSE_V), **st("dq", DENSE_QK), **st("dk", DENSE_QK), **st("dv", DENSE_V),
                  S=s, L=s, H=n, NKB=s // m.BWD_KV_CONFIG["block_n"], qk_scale=0.1, scale=0.07, **dims)
    specs = []
    for name, kernel, cfg in (("forward", m._fwd_kernel, m.FWD_CONFIG),
                              ("dK/dV", m._bwd_kv_kernel, m.BWD_KV_CONFIG),
                              ("dQ", m._bwd_q_kernel, m.BWD_Q_CONFIG)):
        specs.append(Spec(f"document attention {name}", kernel,
                          dict(common, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"]),
                          cfg["num_warps"], cfg["num_stages"],
                          f"{cfg['block_m']} queries x {cfg['block_n']} keys, {DENSE_QK}/{DENSE_V}"))
    delta_rows = m.DELTA_BLOCK_M
    specs.insert(1, Spec("document attention delta", m._delta_kernel, dict(common, BLOCK_M=delta_rows),
                         None, None, f"{delta_rows} rows x {DENSE_V}"))
    return specs


def all_specs() -> list[Spec]:
    return (sparse_mla_specs() + ordered_rows_specs() + indexer_specs() + indexer_kl_specs()
            + document_attention_specs())


MODULES = ("sparse_mla_triton", "ordered_rows", "indexer_triton", "indexer_fp8_triton", "indexer_kl_triton",
           "document_attention_triton")


def stated() -> dict:
    """What the kernel modules state (their ``RESOURCES``), by kernel name."""
    return {name: use for mod in MODULES for name, use in _module(mod).RESOURCES.items()}


def as_stated(row: dict) -> dict:
    """A row of :func:`resources` in the form the modules state it."""
    return {key: row[key] for key in ("registers", "spill_stores", "spill_loads", "shared_kib")}


def table(rows: list[dict]) -> str:
    head = ("kernel", "regs", "spill st/ld B", "shared KiB", "warps", "stages", "tile")
    body = [(r["kernel"], str(r["registers"]), f"{r['spill_stores']}/{r['spill_loads']}",
             f"{r['shared_kib']:g}", str(r["num_warps"]), str(r["num_stages"]), r["tile"]) for r in rows]
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]

    def line(cells) -> str:  # names and tiles left-aligned, numbers right-aligned
        return "  ".join(c.ljust(w) if i in (0, 6) else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([line(head), line(["-" * w for w in widths]), *map(line, body)])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--only", help="kernels whose name contains this")
    args = ap.parse_args(argv)
    import triton

    specs = [s for s in all_specs() if not args.only or args.only in s.name]
    rows = [resources(s) for s in specs]
    print(f"Triton {triton.__version__}, sm_{ARCH}a, GLM-5 shapes; an H100/H200 block may use "
          f"{SHARED_LIMIT_KIB} KiB of shared memory\n")
    print(table(rows))
    over = [r["kernel"] for r in rows if r["shared_kib"] > SHARED_LIMIT_KIB]
    if over:
        print(f"\nover {SHARED_LIMIT_KIB} KiB of shared memory (would not launch): {', '.join(over)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
