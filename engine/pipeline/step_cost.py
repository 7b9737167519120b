"""How many micro-batches a pipeline step is cut into: as many as make it finish soonest.

A stage's time for a micro-batch is modelled as one pass over its layers' weights (paid again by
every micro-batch) plus work that splits with the tokens: the new tokens' products and the
attention reads of their contexts. In units of one weight pass (a stage's per-layer figures, the
same on every stage):

    t(micro-batch) = 1 + tokens / TOKENS_PER_WEIGHT_READ + sum(context_lens) / context_per_weight_read

With P stages and M micro-batches of one step (each drains before the next step starts) the step
takes (M + P - 1) micro-batch times, so with ``work`` the step's whole splittable part:

    step(M) = (M + P - 1) * (1 + work / M)

M = 1 wins (over M = 2) while the work is below 2 / (P - 1) weight passes: a decode step of a few sequences reads the weights
once per micro-batch, and cutting it in two made it 1.5x slower at P = 2 (the H200's first PP 2
figures: batch 8 at 0.29x one GPU, batch 1 at 0.45x). Long prompts and decode steps over long
contexts (work of several weight passes) gain from M up to ``most``. Every rank computes the same
count from the same plan and engine config.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.config import EngineConfig

# New tokens per layer whose products take as long as one read of the layer's weights: a weight's
# 2 bytes (bf16) at ~4.8 TB/s of HBM against its 2 FLOPs per token at ~800 dense bf16 TFLOP/s
# achieved (H100/H200): 2 * 800e12 / (2 * 4.8e12) ~ 167. 8-bit products (FP8, SmoothQuant) halve
# both; integer weight-only schemes read fewer bytes at bf16's FLOPs (scaled by their bytes / 2).
TOKENS_PER_WEIGHT_READ = 160.0
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
WEIGHT_BYTES = {"fp8": 1.0, "fp8_block": 1.0, "int8_sq": 1.0, "int8_wo": 1.0, "int4_wo": 0.5, "int4_awq": 0.5}
EIGHT_BIT_PRODUCTS = ("fp8", "fp8_block", "int8_sq")


@dataclass(frozen=True)
class StepCost:
    """A step's splittable work in weight passes (module docstring)."""

    tokens_per_weight_read: float
    context_per_weight_read: float  # context tokens whose K/V reads equal one pass over the weights

    @classmethod
    def for_engine(cls, config: EngineConfig) -> "StepCost":
        """From the model's per-layer shape: q/k/v/o and a gated MLP's weights against one token's
        K and V (an approximation: biases, norms, MoE routing and latent attention are left out)."""
        m, build = config.model, config.build
        layer_params = (m.hidden_size * m.head_dim * 2 * (m.num_heads + m.num_kv_heads)
                        + 3 * m.hidden_size * m.intermediate_size)
        dtype_bytes = DTYPE_BYTES.get(build.dtype, 2)
        weight_bytes = WEIGHT_BYTES.get(build.quantization or "", dtype_bytes)
        kv_bytes = 2 * m.num_kv_heads * m.head_dim * (1 if build.kv_cache_dtype == "fp8" else dtype_bytes)
        scale = 1.0 if build.quantization in EIGHT_BIT_PRODUCTS else weight_bytes / 2
        return cls(tokens_per_weight_read=TOKENS_PER_WEIGHT_READ * scale,
                   context_per_weight_read=layer_params * weight_bytes / kv_bytes)

    def work(self, num_tokens: int, context_lens: list[int]) -> float:
        return num_tokens / self.tokens_per_weight_read + sum(context_lens) / self.context_per_weight_read


def choose_micro_batches(work: float, pp_size: int, most: int) -> int:
    """The M in 1..most with the least (M + pp_size - 1) * (1 + work / M); the fewest on a tie."""
    return min(range(1, max(1, most) + 1), key=lambda m: ((m + pp_size - 1) * (1 + work / m), m))
