"""engine/gguf_header.py against gguf's own reader and writer: every scalar of the embedded model's
header, a file written with each value type (arrays of numbers and of strings skipped in between),
and a clear error for a file that is not GGUF."""
from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from engine.gguf_header import GGUFHeaderError, read_gguf_scalars  # noqa: E402


def _scalar(field):
    value = field.parts[field.data[0]]
    if field.types[0] == gguf.GGUFValueType.STRING:
        return bytes(value).decode("utf-8")
    return value[0].item()


def test_every_scalar_of_the_embedded_model_as_gguf_reads_it(smollm2_gguf):
    from engine.gguf_reader_cache import parsed_once

    # gguf's own parse, over a plain read-only ndarray of the file rather than its np.memmap (the same
    # bytes; engine/gguf_reader_cache.py): 4.9 -> 2.8 CPU-s, the memmap ran Python on each of ~3.7
    # million indexes of the tokenizer's arrays
    with parsed_once():
        fields = gguf.GGUFReader(smollm2_gguf).fields
    scalars = {key: _scalar(field) for key, field in fields.items()
               if len(field.types) == 1 and key.count(".") and not key.startswith("GGUF.")}
    assert "tokenizer.ggml.eos_token_id" in scalars and len(scalars) > 10
    assert read_gguf_scalars(smollm2_gguf, set(scalars)) == pytest.approx(scalars)


def test_each_value_type_between_arrays(tmp_path):
    path = str(tmp_path / "kinds.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_array("a.tokens", ["<s>", "é", "a longer token"])  # strings to skip
    writer.add_uint8("k.u8", 7)
    writer.add_int16("k.i16", -300)
    writer.add_uint32("k.u32", 4_000_000_000)
    writer.add_array("a.numbers", [1.5, 2.5, 3.5])  # fixed-size elements to skip
    writer.add_int64("k.i64", -(1 << 40))
    writer.add_float32("k.f32", 0.25)
    writer.add_float64("k.f64", 1e-300)
    writer.add_bool("k.bool", True)
    writer.add_string("k.str", "ünïcode")
    writer.add_tensor("w", np.zeros((2, 2), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    wanted = {"k.u8": 7, "k.i16": -300, "k.u32": 4_000_000_000, "k.i64": -(1 << 40), "k.f32": 0.25, "k.f64": 1e-300,
              "k.bool": True, "k.str": "ünïcode"}
    assert read_gguf_scalars(path, set(wanted) | {"a.tokens", "a.numbers", "k.absent"}) == wanted


def test_a_file_that_is_not_gguf_is_refused_by_name(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(GGUFHeaderError, match="model.safetensors is not a GGUF file"):
        read_gguf_scalars(str(path), {"general.name"})


def test_inside_parsed_once_a_file_is_parsed_once_and_gguf_is_restored_after(tmp_path):
    """engine/gguf_reader_cache.py: transformers opens a GGUF three times per load (config, weights,
    tokenizer) and rebuilds gguf's tensor-name map per submodule; inside parsed_once both are made
    once, the same fields and tensors come back, and outside it gguf is untouched (also when nested)."""
    from engine.gguf_reader_cache import parsed_once

    path = str(tmp_path / "tiny.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_array("tokenizer.ggml.tokens", ["<s>", "a", "b"])
    writer.add_tensor("token_embd.weight", np.arange(6, dtype=np.float32).reshape(3, 2))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    plain = gguf.GGUFReader(path)
    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with parsed_once():
        first = gguf.GGUFReader(path)
        with parsed_once():
            assert gguf.GGUFReader(tmp_path / "tiny.gguf") is first
        assert gguf.GGUFReader(path) is first and gguf.GGUFReader(path, "c") is not first
        arch = gguf.MODEL_ARCH.LLAMA
        assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)
        assert list(first.fields) == list(plain.fields)
        assert [bytes(first.fields["tokenizer.ggml.tokens"].parts[i]) for i in first.fields["tokenizer.ggml.tokens"].data] == \
            [b"<s>", b"a", b"b"]
        assert np.array_equal(first.tensors[0].data, plain.tensors[0].data)
        # parsed over a plain read-only ndarray of the file, not gguf's np.memmap (the module says why)
        assert type(first.data) is np.ndarray and not first.data.flags.writeable
        assert isinstance(gguf.GGUFReader(path, "c").data, np.memmap)
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader_class, name_map)
    assert gguf.GGUFReader(path) is not gguf.GGUFReader(path)


def test_a_writable_reader_made_while_a_read_only_one_parses_gets_numpys_memmap(tmp_path):
    """While parsed_once builds a read-only reader, gguf's module np is the stand-in for every thread: another
    thread's writable reader made meanwhile still gets numpy's memmap (its writes reach the file)."""
    from engine.gguf_reader_cache import _NumpyWithPlainMaps

    path = tmp_path / "bytes.bin"
    path.write_bytes(bytes(8))
    data = _NumpyWithPlainMaps.memmap(path, mode="r+")
    assert isinstance(data, np.memmap)
    data[0] = 7
    data.flush()
    del data
    assert path.read_bytes()[0] == 7
    assert not _NumpyWithPlainMaps.memmap(path).flags.writeable  # mode "r": the plain read-only map
