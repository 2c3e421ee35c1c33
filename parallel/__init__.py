"""How ranks cooperate: layout config + validation, process-group init, context parallelism, and
every change to megatron-core (`megatron_compat`: fixes on every backend, CPU emulation)."""
