"""The Triton kernels compiled for sm_90a (H100/H200) at GLM-5 shapes without a GPU, as
``python -m benchmarks.kernel_resources`` compiles them (the launches' own specialisation, the
ptxas Triton uses): the sparse MLA backward does not spill and fits the 227 KiB of shared memory
a block may use, and each kernel module's stated resource use (its ``RESOURCES``, which its
comments refer to) is what ptxas reports."""

from __future__ import annotations

import pytest

from benchmarks.kernel_resources import SHARED_LIMIT_KIB, all_specs, as_stated, resources, stated

pytestmark = pytest.mark.heavy  # Triton compiles and ptxas runs: a few seconds a kernel

BACKWARD = "sparse MLA backward"


def _spec(name: str):
    return next(spec for spec in all_specs() if spec.name == name)


def test_sparse_mla_backward_has_no_spills_and_fits_shared_memory():
    row = resources(_spec(BACKWARD))
    assert row["arch"] == "sm_90a"
    assert (row["spill_stores"], row["spill_loads"]) == (0, 0), row
    assert row["shared_kib"] <= SHARED_LIMIT_KIB, row
    assert as_stated(row) == stated()[BACKWARD], (row, stated()[BACKWARD])


def test_every_launched_kernel_states_its_resources():
    assert sorted(stated()) == sorted(spec.name for spec in all_specs())


@pytest.mark.parametrize("name", sorted(set(stated()) - {BACKWARD}))
def test_stated_resources_are_the_compiled_ones(name):
    row = resources(_spec(name))
    assert as_stated(row) == stated()[name], (name, row)
    assert row["shared_kib"] <= SHARED_LIMIT_KIB, row
