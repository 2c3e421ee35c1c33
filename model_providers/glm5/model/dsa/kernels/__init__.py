"""GPU kernels for DeepSeek Sparse Attention. Importing needs no GPU (and no triton).

- :func:`sparse_mla_triton`: sparse MLA (absorbed form) forward + backward, the Triton
  counterpart of ``sparse_attention.sparse_latent_attention``.
- :func:`index_logits_triton`: causal indexer logits in bf16 or fp8 for any ascending query
  positions (context-parallel zigzag runs included).
- :func:`fp8_index_logits_triton`: the fp8 indexer on pre-quantised inputs, one query offset.
- :func:`sparse_kl_triton`: the indexer's sparse KL with its gradients (``kl.sparse_kl(...,
  triton=True)``), one launch per chunk of queries, key gradients without atomics.

The CPU ranks' fused sparse MLA and indexer KL (C++, built on first use) are in
:mod:`.dsa_cpu`, imported by name: importing this package builds nothing.
"""

from .indexer_fp8_triton import HAVE_TRITON, fp8_index_logits_triton
from .indexer_kl_triton import sparse_kl_triton
from .indexer_triton import index_logits_triton
from .sparse_mla_triton import sparse_mla_triton

__all__ = ["HAVE_TRITON", "fp8_index_logits_triton", "index_logits_triton", "sparse_kl_triton",
           "sparse_mla_triton"]
