"""GPU kernels for DeepSeek Sparse Attention. Importing needs no GPU (and no triton)."""

from .indexer_fp8_triton import HAVE_TRITON, fp8_index_logits_triton

__all__ = ["HAVE_TRITON", "fp8_index_logits_triton"]
