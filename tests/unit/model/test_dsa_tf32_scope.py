"""The warm-up KL's TF32 scope (``kl._tf32_matmuls``) leaves torch's TF32 state readable.

torch keeps two TF32 states, the legacy matmul precision and the per-backend ``fp32_precision``,
and every getter that compares them raises ("you have used mix of the legacy and new APIs") once
they disagree -- cuBLAS's ``allowTF32CuBLAS`` among them, at the first fp32 matmul on a GPU. The
getters below are all that torch 2.13 has, read inside and after the scope, starting from
gpu-check's own setting, the legacy flag on, and the per-backend API used alone."""

from __future__ import annotations

import pytest
import torch

from benchmarks.gpu_check.common import ieee_fp32_matmuls
from model_providers.glm5.model.dsa.kl import _tf32_matmuls

matmul = torch.backends.cuda.matmul

GETTERS = {
    "cuda.matmul.allow_tf32": lambda: matmul.allow_tf32,
    "cuda.matmul.fp32_precision": lambda: matmul.fp32_precision,
    "_C._get_cublas_allow_tf32 (cuBLAS)": torch._C._get_cublas_allow_tf32,
    "get_float32_matmul_precision": torch.get_float32_matmul_precision,
    "_C._get_float32_matmul_precision": torch._C._get_float32_matmul_precision,
    "backends.fp32_precision": lambda: torch.backends.fp32_precision,
    "cudnn.allow_tf32": lambda: torch.backends.cudnn.allow_tf32,
    "_C._get_cudnn_allow_tf32": torch._C._get_cudnn_allow_tf32,
    "_C._get_onednn_allow_tf32": torch._C._get_onednn_allow_tf32,
    **{f"{backend}.{op}.fp32_precision": (lambda b=backend, o=op: torch._C._get_fp32_precision_getter(b, o))
       for backend, op in (("generic", "all"), *((b, o) for b in ("cuda", "mkldnn")
                                                  for o in ("all", "matmul", "conv", "rnn")))},
}


def _read_all() -> dict:
    values = {}
    for name, get in GETTERS.items():
        try:
            values[name] = get()
        except RuntimeError as e:
            pytest.fail(f"{name} raises: {str(e)[:160]}")
    return values


@pytest.fixture
def restore_tf32():
    allowed, precision = matmul.allow_tf32, matmul.fp32_precision
    yield
    matmul.allow_tf32 = allowed
    matmul.fp32_precision = precision


def _gpu_check_setting():
    ieee_fp32_matmuls()


def _legacy_on():
    matmul.allow_tf32 = True


def _per_backend_api_only():
    matmul.allow_tf32 = False
    matmul.fp32_precision = "ieee"


@pytest.mark.parametrize("start", [_gpu_check_setting, _legacy_on, _per_backend_api_only],
                         ids=["gpu_check", "legacy_on", "per_backend_only"])
def test_every_tf32_getter_reads_inside_and_after_the_scope(restore_tf32, start):
    start()
    before = _read_all()
    with _tf32_matmuls():
        inside = _read_all()
        assert inside["cuda.matmul.allow_tf32"] is True and inside["_C._get_cublas_allow_tf32 (cuBLAS)"] is True
        assert inside["cuda.matmul.fp32_precision"] == "tf32"
    assert _read_all() == before


def test_scope_restores_after_an_error(restore_tf32):
    _gpu_check_setting()
    before = _read_all()
    with pytest.raises(ValueError):
        with _tf32_matmuls():
            raise ValueError
    assert _read_all() == before and matmul.allow_tf32 is False
