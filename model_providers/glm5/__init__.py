"""GLM-5 (MLA + DSA attention, 256-expert MoE, shared MTP) on megatron-core.

- ``model/``: the network: config -> megatron TransformerConfig, layer specs, this rank's model
  chunks, the shared MTP, DeepSeek Sparse Attention (``model/dsa/``).
- ``counting/``: parameters and training FLOPs of a config, without building the model.
- ``hf/``: ``python -m model_providers.glm5.hf``: HF checkpoints to and from megatron ones.
"""
