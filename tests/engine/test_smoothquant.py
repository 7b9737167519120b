"""engine/weight_only/smoothquant.py: SmoothQuant's closed-form smoothing folded into a tiny random
transformers model keeps its float function, flattens the activations' channel outliers, and makes
the W8A8 INT8 scheme (kernels/int8_sq.py's reference) closer to the float model."""
from __future__ import annotations

import pytest
import torch
from test_awq_calibration import TEST_IDS, ByteTokenizer, logits_with, tiny_model

from engine.weight_only.smoothquant import smoothing_scale, smoothquant_transform
from kernels.int8_sq import int8_linear_ref, quantize_weight_int8


@pytest.fixture(scope="module")
def outlier_model():
    """Llama with 4 outlier channels of the hidden state (norm weights x 30): what SmoothQuant is for."""
    model = tiny_model("llama")
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight[:4] *= 30.0
    return model


@pytest.fixture(scope="module")
def smoothed(outlier_model):
    return smoothquant_transform(outlier_model, ByteTokenizer())


def w8a8_logits(model, state, ids) -> torch.Tensor:
    """Logits with every decoder linear run as W8A8 INT8 (per-channel weights, per-token activations)."""
    import copy

    clone = copy.deepcopy(model)
    clone.load_state_dict(state)

    def int8_product(module, args, output):
        codes, scale = quantize_weight_int8(module.weight.data)
        return int8_linear_ref(args[0], codes, scale, module.bias)

    handles = [m.register_forward_hook(int8_product) for name, m in clone.named_modules()
               if isinstance(m, torch.nn.Linear) and ".layers." in name]
    with torch.no_grad():
        logits = clone(ids).logits
    for handle in handles:
        handle.remove()
    return logits


def test_closed_form():
    x = torch.tensor([[4.0, -1.0, 0.0], [-16.0, 0.5, 0.0]])
    w = torch.tensor([[1.0, 4.0, 0.0], [-0.25, -1.0, 0.0]])
    assert torch.allclose(smoothing_scale(x, w, 0.5), torch.tensor([4.0, 0.5, 1.0]))  # sqrt(16 / 1), sqrt(1 / 4)
    assert torch.allclose(smoothing_scale(x, w, 1.0), torch.tensor([16.0, 1.0, 1e-5]))


def test_smoothing_keeps_the_float_model(outlier_model, smoothed):
    with torch.no_grad():
        reference = outlier_model(TEST_IDS).logits
    torch.testing.assert_close(logits_with(outlier_model, smoothed, TEST_IDS), reference, atol=1e-3, rtol=1e-3)
    norm = "model.layers.0.input_layernorm.weight"
    original = outlier_model.state_dict()[norm]
    peak = lambda w: (w.abs().max() / w.abs().median()).item()  # noqa: E731
    assert peak(smoothed[norm]) < peak(original) / 3  # the outlier channels' range moved into the weights


def test_smoothing_brings_w8a8_closer_to_float(outlier_model, smoothed):
    with torch.no_grad():
        reference = outlier_model(TEST_IDS).logits
    plain = outlier_model.state_dict()
    error = lambda state: ((w8a8_logits(outlier_model, state, TEST_IDS) - reference).norm() /  # noqa: E731
                           reference.norm()).item()
    assert error(smoothed) < 0.7 * error(plain)


def test_alpha_outside_zero_one_is_refused(outlier_model):
    with pytest.raises(ValueError, match="alpha"):
        smoothquant_transform(outlier_model, ByteTokenizer(), alpha=1.5)
