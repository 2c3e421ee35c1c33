"""megatron-core on CPU ranks and the compat patches; CP splitting."""
