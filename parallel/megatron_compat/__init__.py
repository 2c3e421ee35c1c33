"""Changes to megatron-core's behaviour that hold on every backend (CPU and GPU).

Each fix names the upstream behaviour it changes and the megatron-core version it was written
for; :func:`install` refuses another version, so an upgrade shows which fix to re-check.
(The CPU-only emulation lives in :mod:`parallel.cpu_emulation`.)
"""

from parallel.megatron_compat.fixes import install, release_cached_modules

__all__ = ["install", "release_cached_modules"]
