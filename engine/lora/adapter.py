"""The public LoRA API: one ``LoraAdapter`` on the host, from either format users bring.

- a PEFT directory (``load_peft_adapter``; ``read_peft_config`` for the cheap checks alone):
  engine/lora/peft_format.py;
- TensorRT-LLM's ``lora_weights`` / ``lora_config`` arrays (``adapter_from_trtllm``), and the
  converter from PEFT to them (``peft_to_trtllm``): engine/lora/trtllm_format.py;
- the adapter itself, its modules and their shapes: engine/lora/host_adapter.py.
"""
from engine.lora.host_adapter import MODULES, LoraAdapter, LoraError, module_shape
from engine.lora.peft_format import load_peft_adapter, read_peft_config
from engine.lora.trtllm_format import adapter_from_trtllm, peft_to_trtllm

__all__ = ["MODULES", "LoraAdapter", "LoraError", "module_shape", "load_peft_adapter", "read_peft_config",
           "adapter_from_trtllm", "peft_to_trtllm"]
