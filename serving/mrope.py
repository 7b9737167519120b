"""M-RoPE tensors (Qwen2-VL) at the Triton edge: the anchor's layout <-> the executor's ``Mrope``.

The anchor's wire layout (multimodal_encoders' MROPE_ROTARY_COS_SIN -> tensorrt_llm's
mrope_rotary_cos_sin, FP32 [-1] per item; tensorrtllm_backend's Qwen2VLUtils.compute_mrope): per position p
(padded to max_position_embeddings) the head's head_dim / 2 frequencies as interleaved pairs
(cos_f, sin_f), i.e. an item is (positions, head_dim / 2, 2) flattened. MROPE_POSITION_DELTAS /
mrope_position_deltas: INT64 [1] per item.

The executor's (engine/executor/mrope_rotary.py ``Mrope``): (rows, head_dim) float32, each row
[cos of the head_dim / 2 frequencies | their sin] (kernels/rotary.py's table layout), and the delta.
Conversion happens here and nowhere else; rows past the prompt (the anchor's padding) are dropped.

Checked against the anchor's source (not from memory): triton-inference-server/tensorrtllm_backend
@89ee0f20d5066dc9e2da9af33f0825841eb7d906, all_models/multimodal/multimodal_encoders/1/multimodal_utils.py
(Qwen2VLUtils.compute_mrope) builds each item as (max_position_embeddings, head_dim / 2, 2) flattened, the
last axis (cos, sin) of one frequency, from RopeEmbeddingUtils' mrope table with head_dim = hidden_size /
num_attention_heads; positions past the prompt take position id 0, i.e. cos 1 and sin 0 (to_wire pads the
same way). multimodal_encoders/config.pbtxt and tensorrt_llm/config.pbtxt there: MROPE_ROTARY_COS_SIN /
mrope_rotary_cos_sin TYPE_FP32 dims [-1], MROPE_POSITION_DELTAS / mrope_position_deltas TYPE_INT64 dims [1].
NVIDIA/TensorRT-LLM@879039f6d58336c8208f082550757686ece29ae7 cpp/include/tensorrt_llm/executor/executor.h
(MropeConfig: "[maxPositionEmbeddings*rotaryEmbeddingDim]", float32, delta an int32) and
@2a9abd9536aa62ad3e4b9314be9286b1b1be523b cpp/tensorrt_llm/batch_manager/runtimeBuffers.cpp (a size other
than max_position_embeddings * rotary_dim is refused; a whole item is copied per context request). One
deliberate difference: TRT-LLM wants exactly max_position_embeddings rows per item, we accept any count
>= input_lengths (the anchor's full tensor included) and our multimodal_encoders / OpenAI frontend send
only the prompt's rows.
"""
from __future__ import annotations

import numpy as np

MROPE_INPUTS = ("mrope_rotary_cos_sin", "mrope_position_deltas")


def to_wire(rows: np.ndarray, num_positions: int | None = None) -> np.ndarray:
    """(rows, head_dim) [cos | sin] -> the anchor's flat (max(num_positions, rows) * head_dim,) float32,
    padded past the rows with position 0's (cos 1, sin 0) pairs."""
    rows = np.asarray(rows, np.float32)
    count, width = rows.shape
    pairs = rows.reshape(count, 2, width // 2).transpose(0, 2, 1)  # (rows, head_dim / 2, [cos, sin])
    out = np.zeros((max(num_positions or 0, count), width // 2, 2), np.float32)
    out[count:, :, 0] = 1.0  # padding = position id 0's rotation (cos 1, sin 0), as the anchor pads
    out[:count] = pairs
    return out.reshape(-1)


def from_wire(flat: np.ndarray, width: int, num_rows: int) -> np.ndarray:
    """The anchor's flat item -> its first ``num_rows`` rows (num_rows, width) [cos | sin] float32.
    The caller checked that ``flat`` holds at least num_rows * width values."""
    pairs = np.asarray(flat, np.float32).reshape(-1)[:num_rows * width].reshape(num_rows, width // 2, 2)
    return np.ascontiguousarray(pairs.transpose(0, 2, 1).reshape(num_rows, width))


def _present(array) -> bool:
    return array is not None and np.asarray(array).size > 0


def mrope_fields(tensors, batch_size: int, row: int, prompt_len: int, width: int) -> dict | None:
    """Item ``row``'s Mrope fields {"rotary_cos_sin", "position_delta"} or None (neither sent, or
    deltas 0 without rows: the anchor's "no M-RoPE"). ``width``: the engine's head_dim (0: a model
    without M-RoPE). Raises ValueError naming the input."""
    rows_sent, deltas = tensors.get("mrope_rotary_cos_sin"), tensors.get("mrope_position_deltas")
    delta = 0
    if _present(deltas):
        deltas = np.asarray(deltas).reshape(batch_size if np.asarray(deltas).size == batch_size else 1, -1)
        delta = int(deltas[min(row, len(deltas) - 1), 0])
    if not _present(rows_sent):
        if delta:
            raise ValueError("mrope_position_deltas was sent without mrope_rotary_cos_sin; send both (Qwen2-VL's "
                             "M-RoPE, from multimodal_encoders) or neither")
        return None
    if not _present(deltas):
        raise ValueError("mrope_rotary_cos_sin was sent without mrope_position_deltas; send both (Qwen2-VL's "
                         "M-RoPE, from multimodal_encoders) or neither")
    if not width:
        raise ValueError("mrope_rotary_cos_sin / mrope_position_deltas are not supported for this model's "
                         "architecture (M-RoPE: Qwen2-VL's language model, one rank); send the request without them")
    flat = np.asarray(rows_sent).reshape(batch_size, -1)[row]
    if flat.size < prompt_len * width:
        raise ValueError(f"mrope_rotary_cos_sin holds {flat.size} values per item; send at least "
                         f"input_lengths x head_dim = {prompt_len} x {width} float32 values (per position, "
                         f"{width // 2} interleaved (cos, sin) pairs)")
    return {"rotary_cos_sin": from_wire(flat, width, prompt_len), "position_delta": delta}
