"""Session set-up shared by every test directory, and the rank slot multi-rank tests hold under
pytest-xdist (:mod:`tests.support.core_gate`)."""

from parallel.megatron_compat import bootstrap

bootstrap()  # before megatron-core's first import

import os
import sys

import pytest

from tests.support import core_gate

if core_gate.active():  # two workers on two cores: a one-rank run, like each test, keeps one busy
    os.environ["OMP_NUM_THREADS"] = "1"


@pytest.fixture(autouse=True)
def _no_megatron_loss_scale_left():
    """megatron keeps the MoE aux loss's (and DSA's indexer loss's) backward scale in a class
    attribute whose shape its first user sets: a backward outside megatron's schedule makes it
    ``[]``, the schedule copies ``[1]`` into it and fails. Each test leaves none behind, whatever
    ran before it in its worker."""
    yield
    for module, cls in (("megatron.core.transformer.moe.moe_utils", "MoEAuxLossAutoScaler"),
                        ("megatron.core.transformer.experimental_attention_variant.dsa",
                         "DSAIndexerLossAutoScaler")):
        if module in sys.modules:
            getattr(sys.modules[module], cls).main_loss_backward_scale = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Set-up, call and teardown of a test marked ``all_cores`` hold the rank slot (one multi-rank
    run at a time across workers); a multi-rank run inside any other test holds it for its
    duration (the launch helpers and the rank pools call :func:`.core_gate.whole_machine`)."""
    with core_gate.hold(all_cores=item.get_closest_marker("all_cores") is not None):
        return (yield)


def pytest_sessionstart(session):
    """Say which vector width of the fused CPU kernel, and which of torch's CPU kernels, this run
    uses (even under -q): numerical results differ in their last bits between them (the kernel's
    own tests run both widths whatever this says). The kernel is built once per machine by the
    bootstrap (``make``); a run without it builds it on first use."""
    import torch

    from model_providers.glm5.model.dsa.kernels.dsa_cpu import describe_lanes, kernel_lanes

    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"fused CPU kernel: {describe_lanes(kernel_lanes())}; torch CPU kernels: "
                            f"{torch.backends.cpu.get_cpu_capability()} (ATEN_CPU_CAPABILITY chooses)")
