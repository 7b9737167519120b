"""FP8 (E4M3) weights for a Qwen vision tower's linear layers: an option (``TRITONLLM_TOWER_FP8=1``, or
``=mlp`` for the MLPs' products only, at load: engine/vision/encoder_dir.py; vlm_bench's ``fp8`` and
``fp8-mlp`` tower variants and ``fp8-tower`` / ``fp8-mlp-tower`` offline rows).

Why: the tower's forwards are mostly products of (patches, 1280)-wide activations (32 images at
448 x 448 are 32,768 patches: ~42 TFLOP of products, most of the 82 ms such a forward takes in bf16
on an H200). Offline, every forward takes the GPU from the language model's prefill steps (128
images: ~0.33 s of the image run's ~0.38 s over text-only, benchmarks/results/engine.md). E4M3
products run on the tensor cores at twice bf16's peak rate.

Scheme: kernels/fp8.py's W8A8: each weight (N, K) quantized per output channel at load, the
activations per row (patch) at run time, the product and its scales in cuBLASLt / CUTLASS
(``torch._scaled_mm``, row-wise scales) with the bias in the same kernel where torch takes it there
(bf16 output), else added after. Elsewhere (the CPU, another dtype) the plain-torch reference
``fp8_linear_ref`` of the same scheme. What is quantized (scope ``all``): every block's products (qkv,
proj, the MLP's) and the merger's two; not the patch embedding (K = 3 * 2 * 14 * 14 = 1,176 is no
multiple of 16, and it is one product of 32). Scope ``mlp``: the blocks' MLP products alone (2/3 of
the tower's FLOPs at Qwen2.5-VL's widths), attention and merger in the model dtype. Qwen2.5-VL's
blocks hand an FP8 product its input quantized by the kernel that makes it (the norm before qkv or
gate_up, the SiLU-and-product before down_proj: no pass of its own, the same values).

Accuracy: an approximation of the bf16 tower (E4M3 keeps 3 mantissa bits); vlm_bench reports the
cosine of each image's rows against the bf16 tower's (tests/engine/test_qwen2_vl.py bounds it on the
tiny towers).
"""
from __future__ import annotations

import os

import torch
from torch import nn

from engine.vision.qwen2_vl import UNFUSED_ENV, unfused
from kernels._triton import use_triton
from kernels.fp8 import FAST_ACCUM, QuantizedRows, as_quantized_rows, fp8_linear_ref, quantize_weight

TOWER_FP8_ENV = "TRITONLLM_TOWER_FP8"  # "1" / "mlp": a loaded tower's linears in FP8 (encoder_dir.load_vision_encoder)
# Scope -> the linears quantized, by their attribute names in a block (None: every block's and the merger's)
FP8_SCOPES = {"all": None, "mlp": ("gate_up", "down_proj", "fc1", "fc2")}
FP8_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")  # the towers whose forwards take Fp8TowerLinear as they are
_BIAS_IN_PRODUCT = [True]  # cleared when this torch's row-wise _scaled_mm refuses a bias (then added after)


def tower_fp8_scope() -> str | None:
    """The scope $TRITONLLM_TOWER_FP8 asks for: "1" all, "mlp", unset / "0" / "" None (the tower as loaded)."""
    value = os.environ.get(TOWER_FP8_ENV, "").strip().lower()
    if value in ("", "0"):
        return None
    if value not in ("1", "mlp"):
        raise ValueError(f"{TOWER_FP8_ENV}={value!r}: allowed are 1 (every product), mlp (the MLPs' only) or 0")
    if unfused():  # refused at load, not by every image's forward
        raise ValueError(f"{TOWER_FP8_ENV}={value} needs the fused tower blocks; {UNFUSED_ENV}=1 runs the bf16 blocks "
                         "only: unset one of them")
    return "all" if value == "1" else value


class Fp8TowerLinear(nn.Module):
    """An nn.Linear's product with its weight in E4M3: ``weight`` (N, K) float8_e4m3fn and ``weight_scale``
    (N,) float32 per output channel, ``bias`` (N,) in the activations' dtype or None. Takes (rows, K)
    activations or QuantizedRows (a norm that quantized its output) -> (rows, N) in the activations' dtype."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight, scale = quantize_weight(linear.weight.detach())
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", scale)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        values = x.values if isinstance(x, QuantizedRows) else x
        dtype = x.dtype
        if not (use_triton(values) and dtype == torch.bfloat16):  # row-wise _scaled_mm writes bf16 only
            return fp8_linear_ref(x, self.weight, self.weight_scale, self.bias)
        rows = as_quantized_rows(x)
        if self.bias is not None and _BIAS_IN_PRODUCT[0]:
            try:
                return self._scaled_mm(rows, self.bias)
            except torch.OutOfMemoryError:  # (no answer about the bias: not taken as a refusal for the process)
                raise
            except RuntimeError:  # (a check on the host, before anything is launched)
                _BIAS_IN_PRODUCT[0] = False
        out = self._scaled_mm(rows, None)
        return out if self.bias is None else out + self.bias

    def _scaled_mm(self, rows: QuantizedRows, bias: torch.Tensor | None) -> torch.Tensor:
        return torch._scaled_mm(rows.values, self.weight.t(), scale_a=rows.scale[:, None],
                                scale_b=self.weight_scale[None, :], bias=bias, out_dtype=rows.dtype,
                                use_fast_accum=FAST_ACCUM)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _quantizable(linear: nn.Linear) -> bool:
    """cuBLASLt's FP8 products need both dimensions a multiple of 16."""
    return linear.in_features % 16 == 0 and linear.out_features % 16 == 0


@torch.no_grad()
def quantize_tower_linears(encoder: nn.Module, scope: str = "all") -> nn.Module:
    """``encoder`` (a Qwen2-VL or Qwen2.5-VL tower, its MLP widths padded already if they are to be:
    engine/vision/mlp_width.py) with the nn.Linear layers of ``scope`` (FP8_SCOPES) replaced by
    Fp8TowerLinear, in place; ``encoder.fp8_linears`` says how many. Returns ``encoder``."""
    leaves = FP8_SCOPES[scope]
    targets = [name for name, module in encoder.named_modules()
               if isinstance(module, nn.Linear) and name != "patch_embed" and _quantizable(module)
               and (leaves is None or name.rpartition(".")[2] in leaves)]
    for name in targets:
        owner_name, _, leaf = name.rpartition(".")
        owner = encoder.get_submodule(owner_name) if owner_name else encoder
        setattr(owner, leaf, Fp8TowerLinear(getattr(owner, leaf)))
    encoder.fp8_linears = len(targets)
    return encoder


def quantize_loaded_tower(encoder: nn.Module, model_type: str, device, precision: str, scope: str = "all") -> nn.Module:
    """What load_vision_encoder does under TRITONLLM_TOWER_FP8: ``quantize_tower_linears``, after refusing by
    name a family whose forward does not take Fp8TowerLinear, or a CUDA tower that is not bfloat16 (the row-wise
    product writes bf16 only; another dtype would run the reference, slower than the tower it replaces)."""
    if model_type not in FP8_MODEL_TYPES:
        raise ValueError(f"{TOWER_FP8_ENV}: FP8 tower weights exist for {', '.join(FP8_MODEL_TYPES)}, "
                         f"not for this {model_type} encoder; unset it")
    if torch.device(device).type == "cuda" and precision != "bfloat16":
        raise ValueError(f"{TOWER_FP8_ENV}: FP8 tower products on CUDA need a bfloat16 encoder, this one is "
                         f"{precision}; unset it or build with --dtype bfloat16")
    return quantize_tower_linears(encoder, scope)


def embedding_cosines(reference: list[torch.Tensor], other: list[torch.Tensor]) -> list[float]:
    """Per image: the cosine similarity of its rows (flattened, float32) in ``other`` against ``reference``."""
    return [float(torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0))
            for a, b in zip(reference, other)]
