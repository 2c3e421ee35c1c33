"""The Triton kernels' row offsets are int64 where positions x heads x dims pass 2^31 (GLM-5:
202,752 tokens x 64 heads x 256 dense dims, x 576 latent dims): the helpers every kernel forms
those offsets with (``document_attention_triton._row_offsets``, ``sparse_mla_triton._query_rows``
and ``_head_probs_offset``), called with the values of the last row and head at that length, give
Python's exact integers. triton reads TRITON_INTERPRET when ``@triton.jit`` runs, so the probe
kernel runs in the interpreter in a fresh subprocess (:func:`_collect`); the interpreter wraps
int32 arithmetic as the GPU does (the probe's own int32 product shows it)."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")
tl = triton.language

from model_providers.glm5.model.dsa.kernels.document_attention_triton import _row_offsets
from model_providers.glm5.model.dsa.kernels.sparse_mla_triton import _head_probs_offset, _query_rows
from tests.support.triton_interpreter import collect_in_interpreter

pytestmark = pytest.mark.heavy  # the Triton interpreter in a subprocess (~5 s)

TOKENS, HEADS, DENSE_DIM, MLA_DIM, TOPK = 202_752, 64, 256, 512 + 64, 2048
ROW_STRIDES = {"batch 1": HEADS * DENSE_DIM, "batch 8": 8 * HEADS * DENSE_DIM}  # [s, b, n, d] rows
BATCH = 8
GROUPS = (0, HEADS - 1, 2047)  # one head group; one head per group (the last); far past 2^31 / (B S)


@triton.jit
def _probe(out_ptr, row0, stride, b, t, S, NH, g, B, K, HEADS: tl.constexpr, DIM: tl.constexpr):
    rows = row0 + tl.arange(0, 2)  # int32, as a kernel's block start + arange
    tl.store(out_ptr + tl.arange(0, 2), _row_offsets(rows, stride))
    tl.store(out_ptr + 2 + tl.arange(0, 2), (rows * stride).to(tl.int64))  # int32: wraps
    row, hrow = _query_rows(b, t, S, NH, g, HEADS)
    tl.store(out_ptr + 4, row)
    tl.store(out_ptr + 5, hrow * DIM)
    tl.store(out_ptr + 6, _head_probs_offset(g, B, S, row, K))


def _collect() -> dict:
    import torch
    from triton.runtime.interpreter import InterpretedFunction

    res = {"interpreted": isinstance(_probe, InterpretedFunction)}
    for name, stride in ROW_STRIDES.items():
        for g in GROUPS:
            out = torch.zeros(7, dtype=torch.int64)
            # the last two positions, the last batch's last query, head group g
            _probe[(1,)](out, TOKENS - 2, stride, BATCH - 1, TOKENS - 1, TOKENS, HEADS, g, BATCH, TOPK,
                         HEADS=HEADS, DIM=MLA_DIM)
            res[f"{name} g={g}"] = out.tolist()
    return res


def _exact(stride: int, g: int) -> list[int]:
    rows = [TOKENS - 2, TOKENS - 1]
    row = (BATCH - 1) * TOKENS + TOKENS - 1
    hrow = row * HEADS + g * HEADS
    return [r * stride for r in rows] + [row, hrow * MLA_DIM, (g * BATCH * TOKENS + row) * TOPK]


@pytest.fixture(scope="module")
def results() -> dict:
    return collect_in_interpreter("tests.unit.model.test_kernel_offsets")


@pytest.mark.parametrize("name", list(ROW_STRIDES))
@pytest.mark.parametrize("g", GROUPS)
def test_row_offsets_are_exact_past_int32(results, name, g):
    got, exact = results[f"{name} g={g}"], _exact(ROW_STRIDES[name], g)
    assert got[:2] == exact[:2], ("document attention rows x stride", got, exact)
    assert got[4:] == exact[2:], ("sparse MLA query rows, head rows x 576, head_probs offset", got, exact)
    assert max(exact[:2]) >= 2**31 and exact[3] >= 2**31  # the values do pass int32
    # the same product in int32 wraps in this interpreter (as on a GPU): the check can see the bug
    assert got[2:4] != exact[:2], got
