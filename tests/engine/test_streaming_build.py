"""engine.build writes a checkpoint larger than host memory: safetensors read and written a tensor at a time
(engine/safetensors_stream.py), and write_engine holding at most about a decoder layer's tensors whatever the
layer count, for every scheme and split. benchmarks/build_peak_rss.py measures the RSS itself."""
from __future__ import annotations

import json
import struct
import weakref

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import engine.build
import engine.row_chunks
from engine.build import _block_quantized, build_engine, quantized_rank_tensors
from engine.config import BuildConfig, WeightOnlyScheme
from engine.safetensors_stream import (DTYPE_NAMES, SafetensorsFormatError, SafetensorsReader,
                                       StreamingSafetensorsWriter)
from engine.weight_only.convert import build_time_quantized
from kernels.fp8 import quantize_weight
from kernels.fp8_block import quantize_blocks
from kernels.int8_sq import quantize_weight_int8
from kernels.wna16 import quantize
from quantized_checkpoints import write_gptq

SHAPES = [(3, 5), (7,), (), (2, 0, 3), (1, 3, 3)]


def _every_dtype() -> dict[str, torch.Tensor]:
    """One random tensor of every storable dtype, scalar and empty shapes among them."""
    torch.manual_seed(0)
    out = {}
    for i, dtype in enumerate(DTYPE_NAMES):
        values = torch.randn(SHAPES[i % len(SHAPES)]) * 10
        out[f"t{i}.{str(dtype).removeprefix('torch.')}"] = values > 0 if dtype == torch.bool else values.to(dtype)
    return out


def _same(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN-safe, and defined for the FP8 and unsigned dtypes)."""
    return (got.dtype == expected.dtype and got.shape == expected.shape
            and torch.equal(got.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8)))


def test_streamed_file_loads_as_save_file_wrote_it(tmp_path):
    tensors = _every_dtype()
    writer = StreamingSafetensorsWriter(str(tmp_path / "s.safetensors"), list(tensors), {"format": "pt"})
    for name, tensor in tensors.items():
        writer.add(name, tensor)
    writer.close()
    save_file(tensors, tmp_path / "reference.safetensors", metadata={"format": "pt"})
    streamed, reference = load_file(tmp_path / "s.safetensors"), load_file(tmp_path / "reference.safetensors")
    assert sorted(streamed) == sorted(reference) == sorted(tensors)
    assert all(_same(streamed[name], reference[name]) for name in tensors)
    raw = (tmp_path / "s.safetensors").read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    header = raw[8:8 + header_len]
    assert header_len % 8 == 0 and header.startswith(b"{") and header.endswith(b" ")  # padded, as the spec allows
    assert json.loads(header)["__metadata__"] == {"format": "pt"}
    for path in (tmp_path / "s.safetensors", tmp_path / "reference.safetensors"):  # the reader takes both
        reader = SafetensorsReader(str(path))
        assert reader.metadata == {"format": "pt"}
        assert all(_same(reader.get_tensor(name), tensors[name]) for name in tensors)


def test_writer_refuses_names_it_was_not_told_of(tmp_path):
    writer = StreamingSafetensorsWriter(str(tmp_path / "a.safetensors"), ["a", "b"])
    writer.add("a", torch.ones(2))
    writer.add("c", torch.ones(2))
    with pytest.raises(AssertionError, match=r"missing \['b'\], not declared \['c'\]"):
        writer.close()


def test_reader_names_a_truncated_file(tmp_path):
    save_file({"w": torch.ones(64, 64)}, tmp_path / "w.safetensors")
    data = (tmp_path / "w.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-100])
    with pytest.raises(SafetensorsFormatError, match=r"cut.safetensors: w spans bytes \[0, 16384\)"):
        SafetensorsReader(str(tmp_path / "cut.safetensors"))


# ---- quantizers over row chunks give the whole weight's tensors ---------------------------------

def test_quantizers_over_row_chunks_give_the_whole_weights_codes_and_scales(monkeypatch):
    monkeypatch.setattr(engine.row_chunks, "VALUES_PER_CALL", 16384)  # chunks of 64 rows (128 for blocks)
    torch.manual_seed(0)
    experts = torch.randn(3, 300, 256)  # 300 rows: the last 128-row block of each expert is partial
    source_blocks = torch.rand(3, 3, 2) + 0.1
    codes, scales = _block_quantized(experts, None)
    want = quantize_blocks(experts, None)
    assert _same(codes, want[0]) and _same(scales, want[1])
    codes, scales = _block_quantized(experts, source_blocks)
    want = quantize_blocks(experts, source_blocks)
    assert _same(codes, want[0]) and _same(scales, want[1])
    rows, source_rows = experts.reshape(-1, 256), torch.rand(900) + 0.1
    names = ["moe.gate_up_proj", "moe.gate_up_proj_scale"]
    for int8, quantizer in ((False, quantize_weight), (True, quantize_weight_int8)):
        for source in (None, {"moe.gate_up_proj": source_rows}):
            got = dict(quantized_rank_tensors([("moe.gate_up_proj", experts)], names, source, int8=int8))
            want = quantizer(rows, None if source is None else source_rows)
            assert _same(got["moe.gate_up_proj"], want[0].view(experts.shape))
            assert _same(got["moe.gate_up_proj_scale"], want[1].view(3, 300))
    for bits, group in ((4, 32), (8, 256)):
        got = build_time_quantized("moe.gate_up_proj", experts, WeightOnlyScheme(bits=bits, group_size=group))
        want = quantize(experts, bits, group, symmetric=bits == 8)
        assert all(_same(got[name], tensor) for name, tensor in
                   zip(("moe.gate_up_proj", "moe.gate_up_proj_scale", "moe.gate_up_proj_zero"), want))


# ---- write_engine holds a layer, not a model ---------------------------------------------------

LAYERS = 12


@pytest.fixture(scope="module")
def deep_checkpoints(tmp_path_factory) -> dict[bool, str]:
    """Tiny Llama checkpoints of LAYERS layers on disk (read lazily, as a large one is), untied and tied."""
    out = {}
    for tied in (False, True):
        config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128,
                                          num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=128, tie_word_embeddings=tied)
        torch.manual_seed(0)
        path = tmp_path_factory.mktemp("deep_tied" if tied else "deep")
        transformers.LlamaForCausalLM(config).save_pretrained(path)
        out[tied] = str(path)
    return out


@pytest.fixture(scope="module")
def deep_gptq_moe(tmp_path_factory) -> str:
    """A GPTQ checkpoint (4-bit codes carried into the engine) of a tiny Qwen3-MoE of LAYERS sparse layers (2 experts)."""
    config = transformers.Qwen3MoeConfig(vocab_size=96, hidden_size=64, intermediate_size=128,
                                         moe_intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=16, num_experts=2, num_experts_per_tok=1,
                                         max_position_embeddings=128)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("deep_gptq_moe")
    write_gptq(str(path), transformers.Qwen3MoeForCausalLM(config).eval())
    return str(path)


@pytest.fixture(scope="module")
def deep_llama4(tmp_path_factory) -> str:
    """A tiny Llama 4 text model of LAYERS layers, every one with 4 stacked experts (Scout's layout), on disk."""
    config = transformers.Llama4TextConfig(vocab_size=96, hidden_size=64, intermediate_size=32, intermediate_size_mlp=96,
                                           num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                           head_dim=16, num_local_experts=4, num_experts_per_tok=1,
                                           max_position_embeddings=128, attention_chunk_size=8)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("deep_llama4")
    transformers.Llama4ForCausalLM(config).save_pretrained(path)
    return str(path)


def _held_while_writing(monkeypatch) -> list[int]:
    """Record, at every tensor the build hands its rank files, the bytes of the tensors it handed before that are
    still alive (the tensor or the tensor it views): what the build holds besides the tensor at hand."""
    held, handed = [], []
    original = engine.build._RankFiles.add

    def add(self, name, tensor):
        held.append(sum(t.nbytes for ref in handed if (t := ref()) is not None))
        handed.extend(weakref.ref(t) for t in (tensor, tensor._base) if t is not None)
        original(self, name, tensor)

    monkeypatch.setattr(engine.build._RankFiles, "add", add)
    return held


@pytest.mark.parametrize("tied,overrides", [
    (False, {}),
    (False, {"quantization": "fp8"}),
    (False, {"quantization": "fp8_block"}),
    (False, {"quantization": "int4_wo", "quant_group_size": 32}),
    (False, {"quantization": "int8_wo", "tp_size": 2}),
    (True, {"pp_size": 2}),
], ids=["plain", "fp8", "fp8_block", "int4_wo", "int8_wo-tp2", "tied-pp2"])
def test_build_holds_about_one_layer(deep_checkpoints, tmp_path, monkeypatch, tied, overrides):
    _assert_holds_about_one_layer(deep_checkpoints[tied], tmp_path, monkeypatch,
                                  BuildConfig(dtype="float32", max_seq_len=128, max_input_len=64, **overrides))


def test_carried_integer_codes_hold_about_one_layer(deep_gptq_moe, tmp_path, monkeypatch, capsys):
    _assert_holds_about_one_layer(deep_gptq_moe, tmp_path, monkeypatch,
                                  BuildConfig(dtype="float32", max_seq_len=128, max_input_len=64))
    assert "quantizing it to" not in capsys.readouterr().err  # every weight's codes carried, none quantized afresh


@pytest.mark.parametrize("quantization", [None, "fp8_block"])
def test_llama4_experts_hold_about_one_layer(deep_llama4, tmp_path, monkeypatch, quantization):
    _assert_holds_about_one_layer(deep_llama4, tmp_path, monkeypatch,
                                  BuildConfig(dtype="float32", max_seq_len=128, max_input_len=64,
                                              quantization=quantization))


def _assert_holds_about_one_layer(checkpoint: str, tmp_path, monkeypatch, build: BuildConfig) -> None:
    held = _held_while_writing(monkeypatch)
    build_engine(checkpoint, str(tmp_path / "engine"), build, progress=False)
    files = sorted(tmp_path.joinpath("engine").glob("rank*.safetensors"))
    assert len(files) == build.tp_size * build.pp_size
    written = [load_file(f) for f in files]
    layer = max(sum(t.nbytes for name, t in w.items() if name.startswith("layers.0.")) for w in written)
    total = sum(t.nbytes for w in written for t in w.values())
    assert total > 8 * layer  # the bound below means something: the model is many layers
    assert max(held) <= layer, (max(held), layer)  # one file's first layer (a stage's, a rank's)
