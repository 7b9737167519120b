"""benchmarks/serving: see benchmarks/README.md."""
