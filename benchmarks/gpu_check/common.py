"""What the GPU check's parts share: the environment, error and timing helpers, tolerances."""

from __future__ import annotations

import importlib
import os
import platform

import torch

RESULTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")
KERNEL_MODULES = ("model_providers.glm5.model.dsa.kernels",)  # imported only after TRITON_INTERPRET is set
#: error limits: bf16 on a GPU (sparse MLA: precise=False's measured ~1.45x of the bf16 floor
#: ~1.7e-3; fp8 indexer: the tensor core's reduced-precision accumulation), fp32 in the interpreter
TOL = {"cuda": {"sparse_mla": 3e-3, "indexer_fp8": 1e-3, "indexer_bf16": 2e-3, "indexer_kl": 1e-3,
                "document_attention": 1e-2},
       "cpu": {"sparse_mla": 1e-5, "indexer_fp8": 1e-5, "indexer_bf16": 2e-3, "indexer_kl": 1e-5,
               "document_attention": 1e-5}}


#: the Transformer Engine releases megatron-core 0.19.2 is used with here: pyproject.toml's ``gpu``
#: extra (docs/gpus.md says where the bounds come from)
TE_RANGE = ">=2.14,<2.19"


def container() -> "str | None":
    """The NGC PyTorch image this runs in (its images set ``NVIDIA_PYTORCH_VERSION``), or None."""
    release = os.environ.get("NVIDIA_PYTORCH_VERSION")
    return f"nvcr.io/nvidia/pytorch:{release}-py3" if release else None


def te_in_range(version: str) -> "bool | None":
    """Whether an installed Transformer Engine is in :data:`TE_RANGE` (None: none imports)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version) in SpecifierSet(TE_RANGE, prereleases=True)
    except InvalidVersion:
        return None


def _version(module: str):
    try:
        return getattr(importlib.import_module(module), "__version__", "present")
    except Exception as e:  # noqa: BLE001 -- absent or broken: say which
        return f"unavailable ({type(e).__name__})"


def environment(device: str) -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__,
           "cuda_runtime": torch.version.cuda, "device": device,
           "triton": _version("triton"), "transformer_engine": _version("transformer_engine"),
           "megatron_core": _version("megatron.core"), "apex": _version("apex"),
           "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1", "container": container()}
    env["transformer_engine_range"] = TE_RANGE
    env["transformer_engine_in_range"] = te_in_range(env["transformer_engine"])
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, capability=list(torch.cuda.get_device_capability(0)),
                   gpu_memory_gib=round(props.total_memory / 2**30, 1), sms=props.multi_processor_count)
    else:
        env["gpu"] = "cpu"
    return env


def ieee_fp32_matmuls() -> None:
    """fp32 matmuls in IEEE fp32 (references and timings), set through the legacy flag, as the
    model's own TF32 scope is (:func:`model_providers.glm5.model.dsa.kl._tf32_matmuls`): torch
    keeps its legacy and per-backend TF32 states in agreement only when one API sets both."""
    torch.backends.cuda.matmul.allow_tf32 = False


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _sync(device: str):
    if device == "cuda":
        torch.cuda.synchronize()


def _ms(device: str, fn, reps: int) -> float | None:
    """Median ms of ``fn`` on a GPU (benchmarks.dsa_gpu's CUDA-event timer); None on CPU (the
    interpreter's times mean nothing)."""
    if device != "cuda":
        return None
    from benchmarks.dsa_gpu import _median_ms

    return round(_median_ms(fn, reps), 3)


def _tflops(flop: float, ms: float | None):
    return None if ms is None else round(flop / ms / 1e9, 1)


def _gen(device: str, seed: int):
    return torch.Generator(device=device).manual_seed(seed)
