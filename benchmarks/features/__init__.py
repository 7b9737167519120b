"""benchmarks/features: see benchmarks/README.md."""
