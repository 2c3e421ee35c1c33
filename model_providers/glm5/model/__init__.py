"""The network: GLM-5's megatron config, layer specs, model chunks, shared MTP and DSA."""
