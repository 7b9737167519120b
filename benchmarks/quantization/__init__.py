"""benchmarks/quantization: see benchmarks/README.md."""
