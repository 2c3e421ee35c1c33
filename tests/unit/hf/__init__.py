"""The Hugging Face tool: config and weight mapping, interop, memory, safety."""
