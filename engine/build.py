"""``python -m engine.build``: a checkpoint (HF directory or GGUF file) -> an engine directory.

    python -m engine.build --checkpoint SmolLM2-135M-Instruct.Q4_1.gguf --output engines/smollm2 \
        --dtype float16 --tp_size 1 --max_batch_size 8 --max_input_len 1024 --max_seq_len 2048

Length limits left out come from the checkpoint (engine.config.resolve_build_limits): max_seq_len
= max_position_embeddings (at most MAX_DEFAULT_SEQ_LEN), max_input_len = max_seq_len; a limit
that contradicts the model (more positions than it has) is an error naming both numbers.

writes ``config.json`` (EngineConfig), ``rank{r}.safetensors`` for every rank (tp_size x pp_size
of them; ``--pp_size N`` splits the decoder layers into N pipeline stages: evenly, or as ``--pp_layers
8,12,14,14`` says, or balanced by cost with ``--pp_layers balanced`` (engine/pipeline/layout.py)), and the
tokenizer files (so ``AutoTokenizer.from_pretrained(engine_dir)`` works).
``--quantization fp8`` stores the decoder blocks' linear weights (and experts) in FP8 E4M3 with
per-output-channel scales (kernels/fp8.py); ``fp8_block`` with one scale per 128 x 128 block
(kernels/fp8_block.py), the scheme block-FP8 checkpoints build with, their codes and scales kept.
``--quantization int8_wo / int4_wo / int4_awq`` stores them as integer codes
with per-group scales and zeros (kernels/wna16.py; engine/weight_only/), as do checkpoints that ship
AWQ, GPTQ or compressed-tensors integer weights (their codes are kept as they are). A checkpoint
with MXFP4 experts (gpt-oss) keeps them as MXFP4 codes and scales (engine/mxfp4.py);
``--mxfp4_experts widen`` widens them to --dtype instead. A vision-language checkpoint
(engine/vision/registry.py: LLaVA) builds its language model as above and writes its image encoder
to ``vision_encoder/`` inside the engine directory (engine/vision/encoder_dir.py).

Host memory: a tensor at a time goes from the checkpoint (read lazily, engine/safetensors_stream.py) through
conversion and quantization into its rank file, so a build holds about one decoder layer's tensors, whatever the
layer count (a checkpoint larger than host memory builds). Calibrated schemes (int4_awq, int8_sq without a W8A8
checkpoint) and GGUF files load the whole model first.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import time

import torch
from tqdm import tqdm

from engine.config import (
    INT8_SQ,
    MAX_DEFAULT_SEQ_LEN,
    BuildConfig,
    MLA_ARCHITECTURES,
    ConfigError,
    EngineConfig,
    ModelConfig,
    check_tp_divides,
    keeps_float32,
    resolve_build_limits,
)
from engine.convert import (
    CheckpointError,
    TensorGetter,
    getter_from_safetensors_dir,
    getter_from_state_dict,
    language_model_getter,
    model_config_from_hf,
    iter_rank_weights,
)
from engine.convert_deepseek import checkpoint_mtp_layers
from engine.encoder_decoder.build import build_encoder_decoder
from engine.encoder_decoder.mllama_build import build_mllama, is_mllama_config
from engine.encoder_decoder.spec import is_encoder_decoder_config
from engine.gguf_header import read_gguf_scalars
from engine.gguf_reader_cache import parsed_once
from engine.fp8_checkpoint import (dequantizing_getter, fp8_checkpoint_strategy, rank_block_scales, rank_row_scales,
                                   rank_source_rows)
from engine.models import MODEL_FAMILIES, get_family, get_model_class
from engine.mxfp4 import MXFP4_EXPERTS, is_mxfp4_checkpoint, mxfp4_checkpoint
from engine.pipeline.layout import balanced_pp_layers, parse_pp_layers, stage_tensor_name, stages_of
from engine.pipeline.stage import check_pipeline_supported
from engine.vision.encoder_dir import VISION_ENCODER_DIR, write_vision_encoder
from engine.vision.registry import vision_family
from engine.weight_only.checkpoint_formats import QuantizedLinearReader, checkpoint_weight_quant
from engine.row_chunks import by_rows
from engine.safetensors_stream import StreamingSafetensorsWriter
from engine.weight_only.convert import (CheckpointStandIns, build_time_quantized, carried_integer_tensors,
                                       integer_tensor_names, resolve_group_size, unquantized_linears)
from kernels.fp8 import quantize_weight
from kernels.int8_sq import quantize_weight_int8
from kernels.fp8_block import BLOCK, blocks, quantize_blocks

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


# Families that take integer weights but not engine/weight_only/awq.py's calibration (its layer plan reads
# transformers' Llama-style ``mlp``; Llama 4's MoE layers hold ``feed_forward`` and stacked experts).
AWQ_UNCALIBRATED = ("Llama4ForCausalLM",)


# Families whose model holds in --dtype the Linears an integer checkpoint left unquantized
# (WeightOnlyScheme.float_linears); elsewhere those are quantized at build, round to nearest.
FLOAT_LINEAR_FAMILIES = ("Llama4ForCausalLM",)


def _first_names(names: list[str], shown: int = 4) -> str:
    """The first ``shown`` of ``names`` for a build note, then ", ..." where there are more."""
    return ", ".join(names[:shown]) + (", ..." if len(names) > shown else "")


def with_float_linears(build: BuildConfig, model: ModelConfig, stand_ins: CheckpointStandIns) -> BuildConfig:
    """``build`` with ``quant_float_linears``: the Linear weights the integer checkpoint left wholly unquantized
    (its ignore list: Llama 4 W4A16's attention), which the engine then holds in --dtype as the checkpoint has
    them instead of rounding them to the scheme's bits (said on stderr)."""
    floats = unquantized_linears(stand_ins, model, build.tp_size, expected_tensor_names(model, build))
    if not floats:
        return build
    print(f"note: {len(floats)} linear weights the checkpoint leaves unquantized keep --dtype {build.dtype}: "
          f"{_first_names(floats)}", file=sys.stderr)
    return dataclasses.replace(build, quant_float_linears=floats).validate()


def check_quantization_supported(model: ModelConfig, build: BuildConfig) -> None:
    """ConfigError naming the families that take ``build.quantization`` when this one does not."""
    if build.quantization is None:
        return
    if build.quantization == INT8_SQ:  # SmoothQuant's layer plan is engine/weight_only/awq.py's, Llama-style
        takes = lambda f: f.module == "engine.models.llama"  # noqa: E731
    else:
        takes = (lambda f: f.weight_only) if build.weight_only else (lambda f: f.fp8)
    if not takes(get_family(model.architecture)):
        raise ConfigError(f"quantization {build.quantization} is not supported for {model.architecture}; it is for "
                          + ", ".join(f.architecture for f in MODEL_FAMILIES if takes(f)))


def expected_tensor_shapes(model: ModelConfig, build: BuildConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor one rank's engine model declares (built on the meta device, no memory)."""
    model_class = get_model_class(model.architecture)
    if build.quantization is None:
        state = model_class(model, tp_size=build.tp_size, device="meta").state_dict()
    else:
        check_quantization_supported(model, build)
        weight_only = build.weight_only
        # The names do not depend on the group size: a per-channel stand-in keeps the meta model from
        # refusing a group size before the quantizer can name the layer it does not divide.
        quantization = dataclasses.replace(weight_only, group_size=0) if weight_only else build.quantization
        state = model_class(model, tp_size=build.tp_size, device="meta", quantization=quantization).state_dict()
    return {name: tuple(t.shape) for name, t in state.items()}


def expected_tensor_names(model: ModelConfig, build: BuildConfig) -> list[str]:
    """The state-dict names one rank's engine model declares."""
    return list(expected_tensor_shapes(model, build))


def fp8_weight_names(names) -> list[str]:
    """The weights an FP8 model declares a ``<name>_scale`` for (linears' ``.weight``, experts' stacks)."""
    names = set(names)
    return sorted(name[:-len("_scale")] for name in names if name.endswith("_scale") and name[:-len("_scale")] in names)


def quantized_rank_tensors(converted, names: list[str], source_scales: dict[str, torch.Tensor] | None = None, *,
                           int8: bool = False, kept: set[str] = frozenset()):
    """FP8: yield (name, tensor) for one rank from ``converted`` (its (name, tensor) pairs as converted), one
    weight at a time: every weight the model declares a ``<name>_scale`` for becomes E4M3 with
    per-output-channel scales (kernels/fp8.py; experts (E, N, K): per row of each expert), quantized from this
    rank's shard; the rest is left as converted. ``source_scales``: row scales of weights that were FP8 in the
    checkpoint (engine/fp8_checkpoint.py), kept as they are so those weights' values are not rounded a
    second time. ``kept``: weights an FP8 checkpoint left unquantized, which stay as converted (the model
    dtype) with ones as their unread scales (the model runs them unquantized: their dtype says so).
    ``int8``: int8 codes per output channel instead (int8_sq, kernels/int8_sq.py)."""
    scaled = set(fp8_weight_names(names))
    source_scales = source_scales or {}

    def outputs(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        if name in scaled and name in kept:
            return [(name, tensor), (name + "_scale", torch.ones(tensor.shape[:-1]))]
        if name not in scaled:
            return [(name, tensor)]
        scale = source_scales.get(name)
        scale = None if scale is None else scale.reshape(-1)
        codes, row_scales = by_rows(quantize_weight_int8 if int8 else quantize_weight,
                                    tensor.reshape(-1, tensor.shape[-1]), scale)
        return [(name, codes.view(tensor.shape)), (name + "_scale", row_scales.view(tensor.shape[:-1]))]

    yield from each_handed_on(converted, outputs)


def block_quantized_rank_weights(converted, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype,
                                 source_scales: dict[str, torch.Tensor | None] | None = None, architecture: str = ""):
    """fp8_block: yield (name, tensor) for one rank, from ``converted`` (its (name, float32 tensor)
    pairs): every weight with a declared scale becomes E4M3 codes with 128 x 128 block scales
    (kernels/fp8_block.py), the checkpoint's own where ``source_scales`` (rank_block_scales) has
    them, so its codes come back exactly; a weight the checkpoint left unquantized (None there) stays
    in ``dtype`` with ones as its unread scales; the rest is cast to ``dtype`` (but engine/config.py's
    keeps_float32 tensors of ``architecture``)."""
    scaled = set(fp8_weight_names(shapes))

    def outputs(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        if name not in scaled:
            return [(name, tensor if keeps_float32(architecture, name) else tensor.to(dtype))]
        if source_scales is not None and source_scales[name] is None:
            return [(name, tensor.to(dtype)), (name + "_scale", torch.ones(shapes[name + "_scale"]))]
        codes, scale = _block_quantized(tensor, None if source_scales is None else source_scales[name])
        return [(name, codes), (name + "_scale", scale)]

    yield from each_handed_on(converted, outputs)


def each_handed_on(converted, outputs):
    """Yield, for each (name, tensor) of ``converted``, the (name, tensor) pairs ``outputs(name, tensor)`` returns,
    the input dropped before they go on: a weight's conversion (float32 before quantization) is not held while
    the next weight converts (handed_on)."""
    for name, tensor in converted:
        done = outputs(name, tensor)
        del tensor
        yield from handed_on(done)


def handed_on(outputs: list[tuple[str, torch.Tensor]]):
    """Yield ``outputs``' (name, tensor) pairs, dropping each from the list as it goes: a generator that yields
    a tensor keeps it referenced until it resumes, so one that yielded the last tensor of a weight would hold
    it while the next weight is read and converted (Scout's gate_up block in float32, 5.4 GB, beside its down
    block's conversion). Callers drop their input before yielding from here."""
    while outputs:
        yield outputs.pop(0)


def _block_quantized(weight: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_blocks of a weight (..., N, K), one matrix of a stack (experts) at a time and each in chunks of
    128-row blocks (engine/row_chunks.py: the same codes and scales, a chunk's temporaries)."""
    if weight.dim() == 2:
        return by_rows(quantize_blocks, weight, scale, align=BLOCK, arg_rows_per_row=BLOCK)
    parts = [_block_quantized(weight[i], None if scale is None else scale[i]) for i in range(weight.shape[0])]
    return torch.stack([codes for codes, _ in parts]), torch.stack([scales for _, scales in parts])


def _with_expert_pairs_alike(scales: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
    """Block scales with a sparse layer's gate_up and down both carried or both left in the model
    dtype (the FP8 expert kernels take the two projections in one format)."""
    scales = dict(scales)
    for name in [n for n in scales if n.endswith(".moe.gate_up_proj")]:
        down = name.replace(".moe.gate_up_proj", ".moe.down_proj")
        if scales[name] is None or scales[down] is None:
            scales[name] = scales[down] = None
    return scales


def _expert_pairs_kept_alike(kept: set[str]) -> set[str]:
    """Unquantized weights to keep in the model dtype, with a sparse layer's gate_up and down kept together
    when either is (the FP8 expert kernels take the two projections in one format; the other one, FP8 in
    the checkpoint, then holds its dequantized values), as _with_expert_pairs_alike does for block scales."""
    kept = set(kept)
    for name in [n for n in kept if n.endswith(".moe.gate_up_proj") or n.endswith(".moe.down_proj")]:
        kept |= {name.rsplit(".", 1)[0] + ".gate_up_proj", name.rsplit(".", 1)[0] + ".down_proj"}
    return kept


def write_engine(output_dir: str, model: ModelConfig, build: BuildConfig, get: TensorGetter, *,
                 tokenizer=None, extra: dict | None = None, progress: bool = True,
                 fp8_source: TensorGetter | None = None,
                 integer_source: CheckpointStandIns | None = None) -> EngineConfig:
    """Convert every rank's weights through ``get`` and write a complete engine directory.
    ``fp8_source``: the raw getter of an FP8 checkpoint (``get`` dequantizes it), whose scales the
    engine keeps. ``integer_source``: the stand-ins of a checkpoint with integer weights (``get``
    dequantizes it), whose codes, scales and zeros the engine keeps."""
    engine_config = EngineConfig(model=model, build=build, extra=dict(extra or {})).validate()
    shapes = expected_tensor_shapes(model, build)
    names = list(shapes)
    block_scales = None
    if build.quantization == "fp8_block" and fp8_source is not None:  # checked for every rank before writing
        weights_with_scales = {name: shapes[name] for name in fp8_weight_names(names)}
        block_scales = [_with_expert_pairs_alike(rank_block_scales(fp8_source, model, rank, build.tp_size,
                                                                   weights_with_scales))
                        for rank in range(build.tp_size)]
        kept = [name for name, scale in block_scales[0].items() if scale is None]
        if kept:
            print(f"note: {len(kept)} weights the checkpoint leaves unquantized (wholly or in part) keep --dtype "
                  f"{build.dtype}: {_first_names(kept)}", file=sys.stderr)
    _clear_old_engine(output_dir)
    bar = tqdm(total=len(names) * build.tp_size, unit="tensor", desc="converting", disable=not progress)
    for rank in range(build.tp_size):
        # One tensor at a time from the checkpoint to the rank's files: the build holds what the converter
        # and the quantizer hold for the tensor at hand (a layer's stacked experts at most), whatever the
        # model's size (tests/engine/test_streaming_build.py bounds it).
        files = _RankFiles(output_dir, rank, model, build, names)
        try:
            for name, tensor in _rank_tensors(get, model, build, rank, names, shapes, fp8_source, integer_source,
                                              None if block_scales is None else block_scales[rank]):
                files.add(name, tensor)
                del tensor  # written: not held while the next one converts
                bar.update(1)
            files.close()
        except BaseException:
            files.abort()
            raise
    bar.close()
    if tokenizer is not None:
        tokenizer.save_pretrained(output_dir)
    engine_config.save(output_dir)  # last: a directory with config.json is complete
    return engine_config


def _rank_tensors(get: TensorGetter, model: ModelConfig, build: BuildConfig, rank: int, names: list[str],
                  shapes: dict[str, tuple[int, ...]], fp8_source: TensorGetter | None,
                  integer_source: CheckpointStandIns | None, block_scales: dict | None):
    """Yield (engine name, tensor) of tensor-parallel rank ``rank``, each converted and quantized as the build's
    scheme says, one weight at a time (write_engine's arguments)."""
    dtype = TORCH_DTYPES[build.dtype]
    if build.quantization == "fp8_block":
        converted = iter_rank_weights(get, model, rank, build.tp_size, torch.float32)
        yield from block_quantized_rank_weights(converted, shapes, dtype, block_scales, model.architecture)
        return
    converted = iter_rank_weights(get, model, rank, build.tp_size, dtype)
    if build.quantization == "fp8":
        source_scales, kept = rank_source_rows(fp8_source, model, rank, build.tp_size) if fp8_source else ({}, set())
        kept = _expert_pairs_kept_alike(kept & set(fp8_weight_names(names)))
        if kept and rank == 0:
            print(f"note: {len(kept)} weights the checkpoint leaves unquantized keep --dtype {build.dtype}: "
                  f"{_first_names(sorted(kept))}", file=sys.stderr)
        yield from quantized_rank_tensors(converted, names, source_scales, kept=kept)
    elif build.quantization == INT8_SQ:
        source_scales = rank_row_scales(fp8_source, model, rank, build.tp_size) if fp8_source else None
        yield from quantized_rank_tensors(converted, names, source_scales, int8=True)
    elif build.weight_only is not None:
        yield from _weight_only_tensors(converted, model, build, rank, names, integer_source)
    else:
        yield from converted


def _weight_only_tensors(converted, model: ModelConfig, build: BuildConfig, rank: int, names: list[str],
                         integer_source: CheckpointStandIns | None):
    """Integer weight-only: each integer weight's codes, scales and zeros carried from the checkpoint where it
    quantized all of the weight's parts, else quantized at build from ``converted``'s tensor; the rest as
    converted. The carried stand-ins are converted beside ``converted``, in the same order."""
    integer = set(integer_tensor_names(names))
    carried = (carried_integer_tensors(integer_source, model, build, rank, names) if integer_source is not None
               else None)

    def outputs(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        held = None
        if carried is not None:
            carried_name, held = next(carried)
            if carried_name != name:  # the same conversion over two getters: a converter bug, never a user error
                raise AssertionError(f"stand-in conversion yielded {carried_name} beside {name}")
        if held is not None:
            return list(held.items())
        if name in integer:
            return list(build_time_quantized(name, tensor, build.weight_only).items())
        return [(name, tensor)]

    yield from each_handed_on(converted, outputs)


class _RankFiles:
    """Tensor-parallel rank ``tp_rank``'s files, written a tensor at a time: one, rank{tp_rank}, or with
    pipeline stages one per stage, rank{stage * tp_size + tp_rank}, each holding its stage's tensors under
    their stage-local names (engine/pipeline/layout.py; a tied embedding goes to the first and the last)."""

    def __init__(self, output_dir: str, tp_rank: int, model: ModelConfig, build: BuildConfig, names: list[str]):
        self._names = set(names)
        if build.pp_size == 1:
            stages, local_names = [0], [{name: name for name in names}]
        else:
            stages = [stage.index for stage in stages_of(model, build)]
            local_names = [{name: local for name in names
                            if (local := stage_tensor_name(name, stage, model.tie_word_embeddings)) is not None}
                           for stage in stages_of(model, build)]
        self._files = []
        for stage, local in zip(stages, local_names):
            path = os.path.join(output_dir, f"rank{stage * build.tp_size + tp_rank}.safetensors")
            self._files.append((local, StreamingSafetensorsWriter(path, local.values(), {"format": "pt"})))

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name not in self._names:  # a converter bug, never a user error
            raise AssertionError(f"converter produced {name}, which the model does not declare")
        for local, writer in self._files:
            if name in local:
                writer.add(local[name], tensor)

    def close(self) -> None:
        for _, writer in self._files:
            writer.close()

    def abort(self) -> None:
        for _, writer in self._files:
            writer.abort()


def _clear_old_engine(output_dir: str) -> None:
    """Remove a previous build's config and rank files, so no stale rank of another tp_size survives."""
    os.makedirs(output_dir, exist_ok=True)
    for name in os.listdir(output_dir):
        if name == "config.json" or (name.startswith("rank") and name.endswith(".safetensors")):
            os.remove(os.path.join(output_dir, name))


# ---- sources --------------------------------------------------------------------------------

def load_gguf(path: str):
    """(hf_model, tokenizer) of a GGUF file, dequantized to float32 by transformers (~8 CPU-s for 135M)."""
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(os.path.abspath(path))
    with parsed_once():  # the file's metadata parsed once, not three times (engine/gguf_reader_cache.py)
        try:
            hf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        except (OSError, ValueError, KeyError) as err:
            raise CheckpointError(f"cannot load GGUF file {path}: {err}") from None
        return hf_model, load_gguf_tokenizer(path)


def load_gguf_tokenizer(path: str):
    """The tokenizer of a GGUF file, its special tokens as the file names them."""
    from transformers import AutoTokenizer

    folder, name = os.path.split(os.path.abspath(path))
    try:
        with parsed_once():  # (inside load_gguf's already; alone, the file parsed without memmap's per-index cost)
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except (OSError, ValueError, KeyError) as err:
        raise CheckpointError(f"cannot load GGUF file {path}: {err}") from None
    _set_gguf_special_tokens(path, tokenizer)
    return tokenizer


# GGUF metadata key -> tokenizer attribute of the special tokens the file names by id.
_GGUF_SPECIAL_TOKENS = {"bos": "bos_token", "eos": "eos_token", "unknown": "unk_token", "padding": "pad_token"}


def _set_gguf_special_tokens(path: str, tokenizer) -> None:
    """The special tokens as the file's ``tokenizer.ggml.<kind>_token_id`` names them. Why: the
    tokenizer transformers makes from a GGUF depends on its version (5.17 gave SmolLM2's eos as
    '<|im_start|>', id 1, where the file says id 2, '<|im_end|>'; 5.24 reads it right), and the
    served end_id is the engine tokenizer's eos."""
    keys = {f"tokenizer.ggml.{kind}_token_id": attribute for kind, attribute in _GGUF_SPECIAL_TOKENS.items()}
    for key, token_id in read_gguf_scalars(path, set(keys)).items():
        if isinstance(token_id, int) and 0 <= token_id < len(tokenizer):
            setattr(tokenizer, keys[key], tokenizer.convert_ids_to_tokens(token_id))


def load_hf_dir(path: str):
    """(hf_config, lazy tensor getter, tokenizer or None) of a HF safetensors directory."""
    from transformers import AutoConfig, AutoTokenizer

    from engine.convert_decoder import remote_code_config
    from engine.tiktoken_vocab import qwen1_tokenizer

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise CheckpointError(
            f"checkpoint directory {path!r} has no config.json; allowed inputs: a HF directory with "
            "config.json + *.safetensors, or a .gguf file"
        )
    try:
        hf_config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as err:
        # Baichuan 2, Qwen (v1): remote-code configs, read as data (engine/convert_decoder.py)
        hf_config = remote_code_config(os.path.join(path, "config.json"))
        if hf_config is None:
            raise CheckpointError(f"cannot read {os.path.join(path, 'config.json')}: {err}") from None
    get = getter_from_safetensors_dir(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, KeyError, TypeError):
        tokenizer = qwen1_tokenizer(path)  # Qwen (v1): its remote-code tokenizer's qwen.tiktoken, read as data
        if tokenizer is None:
            print(f"warning: no tokenizer found in {path}; the engine directory will have none", file=sys.stderr)
    return hf_config, get, tokenizer


def build_engine(checkpoint: str, output_dir: str, build: BuildConfig, *, progress: bool = True,
                 calibration_tokens: int = 512, mxfp4_experts: str = "keep", moe_ep_size: int = 1,
                 max_encoder_input_len: int | None = None, balance_pp_layers: bool = False) -> EngineConfig:
    """Build ``output_dir`` from a HF directory or a ``.gguf`` file. An encoder-decoder checkpoint
    (T5, BART) writes ``output_dir/encoder`` and ``output_dir/decoder`` (engine/encoder_decoder/build.py).
    ``balance_pp_layers`` (``--pp_layers balanced``) records the split balanced by cost instead of the even one."""
    build.validate()
    if os.path.isfile(checkpoint) and checkpoint.endswith(".gguf"):
        hf_model, tokenizer = load_gguf(checkpoint)
        hf_config, get = hf_model.config, getter_from_state_dict(hf_model.state_dict(), checkpoint)
    elif os.path.isdir(checkpoint):
        hf_config, get, tokenizer = load_hf_dir(checkpoint)
        if is_encoder_decoder_config(hf_config):
            return build_encoder_decoder(hf_config, get, tokenizer, output_dir, build, source=checkpoint,
                                         max_encoder_input_len=max_encoder_input_len)
        if is_mllama_config(hf_config):  # Llama 3.2 Vision: cross-attention layers over the vision states
            return build_mllama(hf_config, get, tokenizer, output_dir, build, source=checkpoint,
                                max_encoder_input_len=max_encoder_input_len)
    else:
        raise CheckpointError(
            f"checkpoint {checkpoint!r} does not exist or is neither a directory nor a .gguf file; "
            "allowed inputs: a HF directory with config.json + *.safetensors, or a .gguf file"
        )
    return build_from_hf(hf_config, get, tokenizer, output_dir, build, source=checkpoint, progress=progress,
                         calibration_tokens=calibration_tokens, mxfp4_experts=mxfp4_experts,
                         moe_ep_size=moe_ep_size, balance_pp_layers=balance_pp_layers)


def build_from_hf(hf_config, get: TensorGetter, tokenizer, output_dir: str, build: BuildConfig, *,
                  source: str = "", progress: bool = True, calibration_tokens: int = 512,
                  mxfp4_experts: str = "keep", moe_ep_size: int = 1, balance_pp_layers: bool = False) -> EngineConfig:
    """Build from an already-loaded HF config + tensor getter (lets callers reuse a loaded model).
    ``calibration_tokens``: tokens of the built-in text ``int4_awq`` calibrates on. ``mxfp4_experts``:
    an MXFP4 checkpoint's experts kept as MXFP4 ("keep") or widened to --dtype ("widen").
    ``moe_ep_size``: 1, or tp_size for whole routed experts per rank (DeepSeek; ModelConfig.moe_ep_size).
    ``balance_pp_layers``: with pp_size > 1 and no pp_layers, the split balanced by cost, not the even one."""
    vision, vision_config, checkpoint_get = vision_family(hf_config), hf_config, get
    if vision is not None:  # a vision-language checkpoint: its language model here, its encoder below
        hf_config, get = vision.text_config(hf_config), vision.language_getter(get)
    model = model_config_from_hf(hf_config)
    get = language_model_getter(hf_config, get)  # a multimodal checkpoint: its language model's tensors
    if model.architecture in MLA_ARCHITECTURES:  # DeepSeek's MTP module, where the checkpoint holds one
        model = checkpoint_mtp_layers(model, get)
    if moe_ep_size != 1:
        if model.architecture not in MLA_ARCHITECTURES:
            raise ConfigError(f"moe_ep_size {moe_ep_size}: expert parallelism is built for "
                              f"{', '.join(MLA_ARCHITECTURES)}, not {model.architecture}; leave it at 1")
        model = dataclasses.replace(model, moe_ep_size=moe_ep_size).validate()
    check_tp_divides(model, build.tp_size)
    if build.pp_size > 1:  # before any weight is read: the family, and the split
        check_pipeline_supported(model)
        if vision is not None:
            raise ConfigError("pipeline parallelism (pp_size > 1) is not supported for vision-language models yet")
    build = resolve_build_limits(build, model)
    EngineConfig(model=model, build=build).validate()  # the layer split, named, before any weight is converted
    extra = {"source": os.path.abspath(source) if source else "", "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if is_mxfp4_checkpoint(hf_config):  # gpt-oss's experts: kept as MXFP4, or widened exactly (engine/mxfp4.py)
        hf_config, get, model, extra["source_quantization"] = mxfp4_checkpoint(hf_config, get, model, build.tp_size,
                                                                               mxfp4_experts)
    fp8_source = integer_source = None
    integer_quant = checkpoint_weight_quant(hf_config)
    strategy = None if integer_quant is not None else fp8_checkpoint_strategy(hf_config)
    if strategy is not None and build.weight_only is not None:
        raise ConfigError(f"{source or 'the checkpoint'} holds {_scaled_weights(strategy)}; --quantization "
                          f"{build.quantization} would round them again: leave --quantization out")
    if integer_quant is not None:
        # Codes, scales and zeros are carried into the engine exactly; requantizing them into
        # another scheme would round the weights a second time.
        build = with_checkpoint_scheme(build, integer_quant, source)
        extra["source_quantization"] = integer_quant.describe()
        reader = QuantizedLinearReader(get, integer_quant)
        integer_source = CheckpointStandIns(reader, get, build.weight_only, build.tp_size)
        if model.architecture in FLOAT_LINEAR_FAMILIES and build.pp_size == 1:
            build = with_float_linears(build, model, integer_source)
        get = reader.dequantized_getter()
    else:
        build = resolve_group_size(build, model)
    check_quantization_supported(model, build)  # before any calibration runs
    if build.quantization == "int4_awq" and integer_quant is None:
        if model.architecture in AWQ_UNCALIBRATED:
            raise ConfigError(f"int4_awq calibration is not built for {model.architecture}; use --quantization int4_wo "
                              "(round to nearest), or build an AWQ / GPTQ / compressed-tensors checkpoint as shipped")
        get = awq_getter(hf_config, get, tokenizer, build, calibration_tokens, source)
        extra["source_quantization"] = "AWQ scales calibrated at build (engine/weight_only/awq.py)"
    if build.quantization == INT8_SQ and strategy is None:
        get = smoothquant_getter(hf_config, get, tokenizer, calibration_tokens, source)
        extra["source_quantization"] = "SmoothQuant scales calibrated at build (engine/weight_only/smoothquant.py)"
    if strategy is not None:
        # An FP8 checkpoint builds an FP8 engine: its weights exist only as E4M3 values, and
        # widening them to --dtype would double the bytes without adding a digit.
        build = with_fp8_checkpoint_scheme(build, strategy, source)
        check_quantization_supported(model, build)
        extra["source_quantization"] = "int8 W8A8 per channel and token" if strategy == "int8" else \
            "fp8 per 128 x 128 block" if strategy == "block" else f"fp8 per {strategy}"
        fp8_source, get = get, dequantizing_getter(get, strategy)
    if vision is not None:
        extra["vision_encoder"] = VISION_ENCODER_DIR
    # Opt-in, not the default: on two H200s it gained 1.7% at best (14,18 against 16,16, 128/128, Llama-3.1-8B), and
    # every rank's KV pool is sized by its fullest stage, so an uneven split gives up KV room (pp 4: 5,10,10,7 holds
    # 8/10 of the even split's). After the scheme: quantized layers cost less than the head.
    if balance_pp_layers and build.pp_size > 1 and build.pp_layers is None:
        build = dataclasses.replace(build, pp_layers=balanced_pp_layers(model, build))
    engine_config = write_engine(output_dir, model, build, get, tokenizer=tokenizer, extra=extra, progress=progress,
                                 fp8_source=fp8_source, integer_source=integer_source)
    encoder_dir = os.path.join(output_dir, VISION_ENCODER_DIR)
    if vision is not None:
        write_vision_encoder(vision, vision_config, checkpoint_get, encoder_dir, build.dtype, source)
    elif os.path.isdir(encoder_dir):  # a previous build's: this engine has none
        shutil.rmtree(encoder_dir)
    return engine_config


def _scaled_weights(strategy: str) -> str:
    """What a checkpoint of fp8_checkpoint_strategy ``strategy`` holds, for messages."""
    if strategy == "int8":
        return "W8A8 INT8 weights (per channel, activations per token)"
    return f"FP8 weights ({'per 128 x 128 block' if strategy == 'block' else f'per {strategy}'})"


def with_fp8_checkpoint_scheme(build: BuildConfig, strategy: str, source: str) -> BuildConfig:
    """``build`` with the scheme of a checkpoint of scaled 8-bit codes: fp8_block for block-wise FP8
    scales, fp8 for per-channel and per-tensor ones, int8_sq for W8A8 INT8; another scheme asked for
    is an error naming both."""
    quantization = {"block": "fp8_block", "int8": INT8_SQ}.get(strategy, "fp8")
    if build.quantization not in (None, quantization):
        raise ConfigError(f"{source or 'the checkpoint'} holds {_scaled_weights(strategy)}, which build as "
                          f"--quantization {quantization}; --quantization {build.quantization} would round them "
                          "again: leave --quantization out")
    if build.quantization is None:
        print(f"note: {source or 'the checkpoint'} holds {_scaled_weights(strategy)}; building with "
              f"--quantization {quantization}", file=sys.stderr)
    return dataclasses.replace(build, quantization=quantization)


def with_checkpoint_scheme(build: BuildConfig, quant, source: str) -> BuildConfig:
    """``build`` with the integer scheme of a checkpoint that ships one (checkpoint_formats.py);
    a different --quantization or --group_size asked for is an error naming both."""
    quantization = "int8_wo" if quant.bits == 8 else ("int4_awq" if quant.method == "awq" else "int4_wo")
    if build.quantization not in (None, quantization):
        raise ConfigError(f"{source or 'the checkpoint'} holds {quant.describe()} weights, which build as "
                          f"--quantization {quantization}; --quantization {build.quantization} would round them "
                          "again: leave --quantization out")
    if build.quant_group_size not in (None, quant.group_size):
        raise ConfigError(f"{source or 'the checkpoint'} holds {quant.describe()} weights; --group_size "
                          f"{build.quant_group_size} cannot change that: leave --group_size out")
    if build.quantization is None:
        print(f"note: {source or 'the checkpoint'} holds {quant.describe()} weights; building with "
              f"--quantization {quantization}", file=sys.stderr)
    return dataclasses.replace(build, quantization=quantization, quant_group_size=quant.group_size,
                               quant_act_order=quant.act_order).validate()


def awq_getter(hf_config, get: TensorGetter, tokenizer, build: BuildConfig, calibration_tokens: int,
               source: str = "") -> TensorGetter:
    """The float weights with AWQ's activation-aware scales folded in (engine/weight_only/awq.py),
    calibrated on the model itself in float32 (``_calibration_model``)."""
    from engine.weight_only.awq import awq_transform

    if build.weight_only.group_size == 0:
        raise ConfigError("--quantization int4_awq searches scales per group; give --group_size 32, 64, 128 or 256")
    if tokenizer is None:
        raise ConfigError("--quantization int4_awq calibrates on text, and the checkpoint has no tokenizer; "
                          "add the tokenizer files, or use --quantization int4_wo")
    hf_model, device = _calibration_model(hf_config, get, source)
    transformed = awq_transform(hf_model, tokenizer, bits=4, group_size=build.weight_only.group_size,
                                max_tokens=calibration_tokens, device=device)
    return getter_from_state_dict({k: v.cpu() for k, v in transformed.items()}, "AWQ-scaled weights")


def smoothquant_getter(hf_config, get: TensorGetter, tokenizer, calibration_tokens: int,
                       source: str = "") -> TensorGetter:
    """The float weights with SmoothQuant's smoothing scales folded in (alpha 0.5,
    engine/weight_only/smoothquant.py), calibrated like AWQ's on the built-in text."""
    from engine.weight_only.smoothquant import smoothquant_transform

    if tokenizer is None:
        raise ConfigError("--quantization int8_sq calibrates on text, and the checkpoint has no tokenizer; "
                          "add the tokenizer files, or use --quantization fp8 or int8_wo")
    hf_model, device = _calibration_model(hf_config, get, source)
    transformed = smoothquant_transform(hf_model, tokenizer, max_tokens=calibration_tokens, device=device)
    return getter_from_state_dict({k: v.cpu() for k, v in transformed.items()}, "SmoothQuant-scaled weights")


def _calibration_model(hf_config, get: TensorGetter, source: str):
    """(transformers' float32 model of the checkpoint, the device to calibrate on: the GPU when there
    is one). A checkpoint directory loads through transformers (which stacks per-expert tensors as
    its MoE modules hold them); other sources (a GGUF's model, a state dict) fill a model of
    ``hf_config`` through ``get``."""
    from transformers import AutoModelForCausalLM

    if source and os.path.isdir(source):
        hf_model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    else:
        hf_model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
        state = {}
        for name in hf_model.state_dict():
            try:
                state[name] = get(name).float()
            except CheckpointError:
                if name != "lm_head.weight":  # tied embeddings store no lm_head
                    raise
        hf_model.load_state_dict(state, strict=False)
        hf_model.tie_weights()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return hf_model.to(device), device


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = BuildConfig()
    p = argparse.ArgumentParser(prog="python -m engine.build", description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True, help="HF directory (config.json + safetensors) or .gguf file")
    p.add_argument("--output", required=True, help="engine directory to write")
    p.add_argument("--dtype", default=defaults.dtype, choices=sorted(TORCH_DTYPES))
    for name in ("tp_size", "max_batch_size", "tokens_per_block"):
        p.add_argument(f"--{name}", type=int, default=getattr(defaults, name))
    p.add_argument("--pp_size", type=int, default=defaults.pp_size,
                   help="pipeline stages: the decoder layers split over pp_size groups of tp_size ranks "
                        "(world size = tp_size x pp_size); Llama-family and MoE models")
    p.add_argument("--pp_layers", type=str, default=None,
                   help="layers per stage, comma-separated in stage order (e.g. 8,12,14,14), or 'balanced': by cost, the "
                        "LM head on the last stage and rank 0's sampling and step on the first counted (Llama-3.1-8B "
                        "at pp 2: 15,17; the fullest stage sizes every rank's KV pool); default: even; recorded in "
                        "config.json")
    p.add_argument("--max_seq_len", type=int, default=None,
                   help="longest sequence (prompt + output); default: the checkpoint's max_position_embeddings, "
                        f"at most {MAX_DEFAULT_SEQ_LEN}")
    p.add_argument("--max_input_len", type=int, default=None, help="longest prompt; default: max_seq_len")
    p.add_argument("--max_num_tokens", type=int, default=None,
                   help="tokens per forward step; default: max(8192, max_input_len), at most "
                        "max_batch_size * max_seq_len")
    p.add_argument("--quantization", choices=["fp8", "fp8_block", "int8_wo", "int4_wo", "int4_awq", "int8_sq"],
                   default=None,
                   help="fp8: FP8 E4M3 weights with per-output-channel scales for every linear layer of the "
                        "decoder blocks and the experts, activations quantized per token at run time (Llama "
                        "family, mixture-of-experts models); fp8_block: FP8 E4M3 with one scale per 128 x 128 "
                        "block, activations per token and 128-column group (what block-FP8 checkpoints build "
                        "as); "
                        "int8_wo: INT8 weight-only, per output channel, symmetric; int4_wo: INT4 weight-only, "
                        "groups of 128 input columns with zero points, round to nearest; int4_awq: int4_wo after "
                        "AWQ's activation-aware scaling, calibrated on a built-in text (Llama family and "
                        "mixture-of-experts models). Embeddings, norms and lm_head stay in --dtype. A checkpoint "
                        "that ships AWQ, GPTQ or compressed-tensors integer weights builds in its own scheme. "
                        "int8_sq: SmoothQuant W8A8 INT8 (int8 weights per output channel after smoothing scales "
                        "calibrated on the built-in text with alpha 0.5, int8 activations per token; Llama-style "
                        "dense families)")
    p.add_argument("--group_size", type=int, default=None,
                   help="int8_wo/int4_wo/int4_awq: input columns per scale group (32, 64, 128, 256) or 0 for one "
                        "group per output channel; default: 128 for int4 (64 or 32 where 128 does not divide a "
                        "layer's width), per channel for int8")
    p.add_argument("--calib_tokens", type=int, default=512,
                   help="int4_awq / int8_sq: tokens of the built-in calibration text the scales are calibrated on")
    p.add_argument("--moe_ep_size", type=int, default=1,
                   help="expert parallelism (DeepSeek-V2/V3): 1, each rank a slice of every routed expert's width; "
                        "tp_size, each rank num_experts / tp_size whole experts")
    p.add_argument("--mxfp4_experts", choices=MXFP4_EXPERTS, default="keep",
                   help="a checkpoint with MXFP4 experts (gpt-oss): keep them as MXFP4 codes and scales "
                        "(~4.25 bits a weight, kernels/fused_moe_mxfp4.py), or widen them to --dtype, exactly")
    p.add_argument("--max_encoder_input_len", type=int, default=None,
                   help="encoder-decoder checkpoints (T5, BART): the longest encoder input; default: the model's "
                        "positions (T5: n_positions, BART: max_position_embeddings)")
    p.add_argument("--kv_cache_dtype", choices=["auto", "fp8"], default="auto",
                   help="fp8: the paged KV pool in FP8 E4M3 (scale 1, saturating), half the bytes per block; "
                        "the tensorrt_llm model parameter kv_cache_dtype may override it")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    build = BuildConfig(
        dtype=args.dtype, max_batch_size=args.max_batch_size, max_input_len=args.max_input_len,
        max_seq_len=args.max_seq_len, max_num_tokens=args.max_num_tokens,
        tokens_per_block=args.tokens_per_block, tp_size=args.tp_size, pp_size=args.pp_size,
        quantization=args.quantization,
        quant_group_size=args.group_size,
        kv_cache_dtype=None if args.kv_cache_dtype == "auto" else args.kv_cache_dtype,
    )
    try:
        balanced = args.pp_layers == "balanced"
        build = dataclasses.replace(build, pp_layers=None if balanced else parse_pp_layers(args.pp_layers))
        build_engine(args.checkpoint, args.output, build, calibration_tokens=args.calib_tokens, balance_pp_layers=balanced,
                     mxfp4_experts=args.mxfp4_experts, max_encoder_input_len=args.max_encoder_input_len,
                     moe_ep_size=args.moe_ep_size)
    except (ConfigError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"engine written to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
