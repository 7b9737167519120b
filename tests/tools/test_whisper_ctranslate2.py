"""tools/whisper/convert_ctranslate2.py: a CTranslate2 Whisper directory written here from the tiny
random Whisper (format 6, the fused q/k/v and cross k/v of CTranslate2's Whisper spec, float16)
converts back to transformers' weights and config."""
import json
import struct
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "whisper"))

from convert_ctranslate2 import convert  # noqa: E402


def _string(text: str) -> bytes:
    data = text.encode() + b"\0"
    return struct.pack("<H", len(data)) + data


def write_ct2(model, tokenizer_json: str, out: Path) -> None:
    """CTranslate2's Whisper layout of ``model`` (the inverse of the converter's mapping)."""
    sd = {k: v.detach().numpy().astype(np.float16) for k, v in model.state_dict().items()}
    v = {"encoder/num_heads": np.array(model.config.encoder_attention_heads, np.int16),
         "decoder/num_heads": np.array(model.config.decoder_attention_heads, np.int16)}
    for conv in ("conv1", "conv2"):
        v[f"encoder/{conv}/weight"], v[f"encoder/{conv}/bias"] = sd[f"model.encoder.{conv}.weight"], sd[f"model.encoder.{conv}.bias"]
    v["encoder/position_encodings/encodings"] = sd["model.encoder.embed_positions.weight"]
    v["decoder/embeddings/weight"] = sd["model.decoder.embed_tokens.weight"]
    v["decoder/position_encodings/encodings"] = sd["model.decoder.embed_positions.weight"]
    norm = lambda dst, src: v.update({f"{dst}/gamma": sd[f"{src}.weight"], f"{dst}/beta": sd[f"{src}.bias"]})  # noqa: E731
    lin = lambda dst, src: v.update({f"{dst}/weight": sd[f"{src}.weight"], f"{dst}/bias": sd[f"{src}.bias"]})  # noqa: E731

    def fused(dst, srcs):
        v[f"{dst}/weight"] = np.concatenate([sd[f"{s}.weight"] for s in srcs])
        v[f"{dst}/bias"] = np.concatenate([sd.get(f"{s}.bias", np.zeros(sd[f"{s}.weight"].shape[0], np.float16))
                                           for s in srcs])
    for stack, layers in (("encoder", model.config.encoder_layers), ("decoder", model.config.decoder_layers)):
        norm(f"{stack}/layer_norm", f"model.{stack}.layer_norm")
        for i in range(layers):
            d, s = f"{stack}/layer_{i}", f"model.{stack}.layers.{i}"
            norm(f"{d}/self_attention/layer_norm", f"{s}.self_attn_layer_norm")
            fused(f"{d}/self_attention/linear_0", [f"{s}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")])
            lin(f"{d}/self_attention/linear_1", f"{s}.self_attn.out_proj")
            if stack == "decoder":
                norm(f"{d}/attention/layer_norm", f"{s}.encoder_attn_layer_norm")
                lin(f"{d}/attention/linear_0", f"{s}.encoder_attn.q_proj")
                fused(f"{d}/attention/linear_1", [f"{s}.encoder_attn.k_proj", f"{s}.encoder_attn.v_proj"])
                lin(f"{d}/attention/linear_2", f"{s}.encoder_attn.out_proj")
            norm(f"{d}/ffn/layer_norm", f"{s}.final_layer_norm")
            lin(f"{d}/ffn/linear_0", f"{s}.fc1")
            lin(f"{d}/ffn/linear_1", f"{s}.fc2")
    codes = {np.dtype(np.float16): 4, np.dtype(np.int16): 2}
    blob = struct.pack("<I", 6) + _string("WhisperSpec") + struct.pack("<II", 3, len(v))
    for name, array in v.items():
        blob += _string(name) + struct.pack("<B", array.ndim) + struct.pack(f"<{array.ndim}I", *array.shape)
        blob += struct.pack("<BI", codes[array.dtype], array.nbytes) + array.tobytes()
    blob += struct.pack("<I", 1) + _string("decoder/projection/weight") + _string("decoder/embeddings/weight")
    out.mkdir(parents=True)
    (out / "model.bin").write_bytes(blob)
    (out / "config.json").write_text(json.dumps({"suppress_ids": [5], "suppress_ids_begin": [1], "lang_ids": [18]}))
    (out / "tokenizer.json").write_text(tokenizer_json)


def test_ctranslate2_whisper_converts_to_transformers(tmp_path):
    from safetensors.torch import load_file

    from tiny_encdec import hf_model, tokenizer

    model = hf_model("whisper")
    tokenizer().save_pretrained(tmp_path / "tok")
    # Whisper's end token is <|endoftext|> (the tiny tokenizer calls it </s>)
    write_ct2(model, (tmp_path / "tok" / "tokenizer.json").read_text().replace("</s>", "<|endoftext|>"),
              tmp_path / "ct2")
    convert(str(tmp_path / "ct2"), str(tmp_path / "hf"))
    expected = {k: v.half().float() for k, v in model.state_dict().items() if k != "proj_out.weight"}  # (tied)
    got = load_file(tmp_path / "hf" / "model.safetensors")
    assert set(got) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["d_model"], config["encoder_layers"], config["decoder_attention_heads"], config["num_mel_bins"],
            config["max_source_positions"], config["eos_token_id"]) == (32, 2, 4, 8, 50, 1)
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert generation["no_timestamps_token_id"] == 20 and generation["decoder_start_token_id"] == 17
    assert generation["suppress_tokens"] == [5] and generation["is_multilingual"] is False
