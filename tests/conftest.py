"""Session set-up shared by every test directory."""


def pytest_sessionstart(session):
    """Build the fused CPU sparse MLA kernel once before any test (a few tens of seconds on a
    fresh machine): the ranks the multi-rank tests spawn then load it instead of waiting on one
    build inside a timed test. Then say which of its vector widths, and which of torch's CPU
    kernels, this run uses (even under -q): numerical results differ in their last bits between
    them (the kernel's own tests run both widths whatever this says)."""
    import torch

    from model_providers.glm5.model.dsa.kernels.sparse_mla_cpu import cpu_kernel, describe_lanes, kernel_lanes

    cpu_kernel()
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"fused CPU kernel: {describe_lanes(kernel_lanes())}; torch CPU kernels: "
                            f"{torch.backends.cpu.get_cpu_capability()} (ATEN_CPU_CAPABILITY chooses)")
