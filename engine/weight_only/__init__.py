"""Weight-only quantization at engine build: calibration transforms applied before round-to-nearest."""
