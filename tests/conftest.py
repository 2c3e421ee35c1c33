"""Session set-up shared by every test directory."""


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
