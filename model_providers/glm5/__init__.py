"""GLM-5 (MLA + DSA attention, 256-expert MoE, shared MTP) on megatron-core."""
