"""Session set-up shared by every test directory."""


def pytest_sessionstart(session):
    """Build the fused CPU sparse MLA kernel once before any test (a few tens of seconds on a
    fresh machine): the ranks the multi-rank tests spawn then load it instead of waiting on one
    build inside a timed test."""
    from model_providers.glm5.dsa.kernels.sparse_mla_cpu import cpu_kernel

    cpu_kernel()
