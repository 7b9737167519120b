"""LoRA adapters on the host: read from a PEFT directory or from TensorRT-LLM's ``lora_weights`` /
``lora_config`` arrays into one ``LoraAdapter`` (engine/lora/adapter.py is the public API)."""
