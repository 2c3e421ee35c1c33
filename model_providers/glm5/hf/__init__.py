"""The Hugging Face tool: GLM-5 HF checkpoints to and from megatron dist checkpoints, and parity evaluation."""
