"""How ranks cooperate: layout config + validation, process-group init, CPU emulation."""
