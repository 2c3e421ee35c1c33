"""DeepSeek Sparse Attention for GLM-5: lightning indexer, deterministic top-k, O(L*k) sparse
MLA (absorbed / MQA form), the indexer KL loss, and the dense / warmup / sparse modes."""
