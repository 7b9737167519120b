"""benchmarks/engine: see benchmarks/README.md."""
