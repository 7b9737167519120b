"""benchmarks/speculative: see benchmarks/README.md."""
