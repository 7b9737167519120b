#!/usr/bin/env python3
"""Convert a PEFT LoRA directory to TensorRT-LLM's two arrays (the backend's lora_weights and
lora_config inputs), with the flags of TensorRT-LLM's examples/hf_lora_convert.py:

    python3 tools/hf_lora_convert.py -i PEFT_DIR -o OUT_DIR [--storage-type float16] [--verbose]

writes OUT_DIR/model.lora_weights.npy ([1, rows, len], the storage type) and
OUT_DIR/model.lora_config.npy ([1, rows, 3] int32), the names inflight_batcher_llm_client.py
--lora-path reads. Layout and module ids: engine/lora/trtllm_format.py.
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # engine

from engine.lora.adapter import LoraError, peft_to_trtllm  # noqa: E402
from engine.lora.trtllm_format import MODULE_IDS  # noqa: E402

STORAGE_TYPES = ("float32", "float16", "bfloat16")  # TensorRT-LLM's choices; bfloat16 is refused


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Convert a PEFT LoRA directory to TensorRT-LLM's "
                                     "model.lora_weights.npy and model.lora_config.npy.")
    parser.add_argument("-i", "--in-file", required=True, help="PEFT adapter directory (adapter_config.json + weights)")
    parser.add_argument("-o", "--out-dir", required=True, help="where model.lora_weights.npy and model.lora_config.npy go")
    parser.add_argument("--storage-type", choices=STORAGE_TYPES, default="float16",
                        help="dtype of lora_weights (numpy has no bfloat16: use float16 or float32)")
    parser.add_argument("--verbose", action="store_true", help="print one line per row")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        weights, config = peft_to_trtllm(args.in_file, args.storage_type)
    except LoraError as err:
        print(f"hf_lora_convert: {err}", file=sys.stderr)
        return 2
    os.makedirs(args.out_dir, exist_ok=True)
    np.save(os.path.join(args.out_dir, "model.lora_weights.npy"), weights)
    np.save(os.path.join(args.out_dir, "model.lora_config.npy"), config)
    if args.verbose:
        names = {i: name for name, i in MODULE_IDS.items()}
        for module_id, layer, rank in config[0].tolist():
            print(f"layer {layer:3d} {names[module_id]:<12} rank {rank}")
    print(f"wrote {config.shape[1]} rows: lora_weights {list(weights.shape)} {weights.dtype}, "
          f"lora_config {list(config.shape)} int32 -> {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
