"""The megatron-core release every patch in this package was written against and tested with."""

from __future__ import annotations

MEGATRON_CORE_VERSION = "0.16.1"


def check_megatron_core(*patch_files: str) -> None:
    """Refuse to patch another megatron-core: each patch replaces or wraps upstream code of this
    exact release, and on another one may silently do the wrong thing. The message names the
    files whose patches to re-check."""
    from megatron.core import package_info

    found = package_info.__version__
    if found != MEGATRON_CORE_VERSION:
        files = ", ".join(patch_files)
        raise RuntimeError(
            f"parallel.megatron_compat was written for megatron-core {MEGATRON_CORE_VERSION}, "
            f"found {found}: re-check each patch in {files} against it (then update "
            f"MEGATRON_CORE_VERSION in {__file__})")
