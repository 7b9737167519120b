"""State-space and hybrid models: Mamba-2 layers with a per-request state (engine/executor/state_cache.py)."""
