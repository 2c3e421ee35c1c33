"""Session set-up shared by every test directory."""


def pytest_report_header(config):
    """Which of the fused CPU kernel's vector widths, and which of torch's CPU kernels, this run
    uses: numerical results differ in their last bits between them (the kernel's own tests run both
    widths whatever this says)."""
    import torch

    from model_providers.glm5.dsa.kernels.sparse_mla_cpu import describe_lanes, kernel_lanes

    return [f"fused CPU kernel: {describe_lanes(kernel_lanes())}",
            f"torch CPU kernels: {torch.backends.cpu.get_cpu_capability()} (ATEN_CPU_CAPABILITY to choose)"]


def pytest_sessionstart(session):
    """Build the fused CPU sparse MLA kernel once before any test (a few tens of seconds on a
    fresh machine): the ranks the multi-rank tests spawn then load it instead of waiting on one
    build inside a timed test."""
    from model_providers.glm5.dsa.kernels.sparse_mla_cpu import cpu_kernel

    cpu_kernel()
