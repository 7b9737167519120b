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

Several steps in flight (engine/pipeline/in_flight.py) pay only where a step's time grows with its
tokens: ``in_flight_gain`` (below) says when.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.config import BuildConfig, EngineConfig, ModelConfig, pipeline_layer_counts

# New tokens per layer whose products take as long as one read of the layer's weights: a weight's
# 2 bytes (bf16) at ~4.8 TB/s of HBM against its 2 FLOPs per token at ~800 dense bf16 TFLOP/s
# achieved (H100/H200): 2 * 800e12 / (2 * 4.8e12) ~ 167. 8-bit products (FP8, SmoothQuant) halve
# both; integer weight-only schemes read fewer bytes at bf16's FLOPs (scaled by their bytes / 2).
TOKENS_PER_WEIGHT_READ = 160.0
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
WEIGHT_BYTES = {"fp8": 1.0, "fp8_block": 1.0, "int8_sq": 1.0, "int8_wo": 1.0, "int4_wo": 0.5, "int4_awq": 0.5}
EIGHT_BIT_PRODUCTS = ("fp8", "fp8_block", "int8_sq")
AUTO_MOST_PER_STAGE = 2  # micro-batches a step is cut into at most, per stage
# What a step costs besides its stages' layers, once a step (rank 0's host work, sampling, the
# send/recv launches between the stages' graphs), and the weight-read rate that turns it into weight
# passes: fitted to session 17's Llama-3.1-8B PP 2 figures on two H200s (half-batch steps in flight
# lost 0.3-0.4 ms a step against one whole step at batch 8 and 32).
STEP_OVERHEAD_S = 3e-4
WEIGHT_READ_BYTES_PER_S = 4.0e12  # achieved HBM read rate of a decode step (H100/H200)


@dataclass(frozen=True)
class StepCost:
    """A step's splittable work in weight passes (module docstring)."""

    tokens_per_weight_read: float
    context_per_weight_read: float  # context tokens whose K/V reads equal one pass over the weights
    # (in_flight_gain only) the last stage's LM head in passes over a stage's weights (Llama-3.1-8B
    # at pp 2: 0.15: the last stage is the slower one), and STEP_OVERHEAD_S in the same unit
    head: float = 0.0
    step_overhead: float = 0.0
    # (in_flight_gain only) each stage's layers over a stage's mean, in stage order (an uneven
    # split: 17,15 of the 8B shape -> 1.0625, 0.9375); empty: the even split
    layer_shares: tuple[float, ...] = ()

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
        stage_bytes = layer_params * weight_bytes * m.num_layers / max(1, build.pp_size)
        mean_layers = m.num_layers / max(1, build.pp_size)
        return cls(tokens_per_weight_read=TOKENS_PER_WEIGHT_READ * scale,
                   context_per_weight_read=layer_params * weight_bytes / kv_bytes,
                   head=m.vocab_size * m.hidden_size * dtype_bytes / stage_bytes,
                   step_overhead=STEP_OVERHEAD_S * WEIGHT_READ_BYTES_PER_S / stage_bytes,
                   layer_shares=tuple(count / mean_layers for count in pipeline_layer_counts(
                       m.num_layers, build.pp_size, build.pp_layers)) if build.pp_layers else ())

    def work(self, num_tokens: int, context_lens: list[int]) -> float:
        return self.work_of(num_tokens, sum(context_lens))

    def work_of(self, num_tokens: float, context: float) -> float:
        return num_tokens / self.tokens_per_weight_read + context / self.context_per_weight_read


def choose_micro_batches(work: float, pp_size: int, most: int) -> int:
    """The M in 1..most with the least (M + pp_size - 1) * (1 + work / M); the fewest on a tie."""
    return min(range(1, max(1, most) + 1), key=lambda m: ((m + pp_size - 1) * (1 + work / m), m))


def in_flight_gain(cost: StepCost, pp_size: int, depth: int, *, seqs: int, tokens: int, context: int,
                   max_batch_size: int, max_num_tokens: int, largest: int = 1) -> float:
    """Tokens a second with ``depth`` steps in flight, each taking its share of the sequences, over
    tokens a second with one whole step at a time (micro-batched as choose_micro_batches says).
    ``seqs`` sequences could run now, needing ``tokens`` new tokens (``largest`` of them one
    sequence's: a prompt cannot be shared out) over ``context`` tokens of context.

    Why not always in flight: a sequence's next step needs its sampled token, so steps in flight
    carry different sequences and a batch of b sequences becomes ``depth`` steps of b / depth. Each
    re-reads every stage's weights; a group goes through the stages in turn and each stage serves
    every group, so ``depth`` steps take max(depth, P) passes of the slowest stage (split evenly,
    the last: its LM head; ``--pp_layers balanced`` evens them out, ``layer_shares``) plus
    ``depth`` step overheads, against (M + P - 1)(1 + work / M) + head + one overhead for the whole
    step. In weight passes of a stage (Llama-3.1-8B at pp 2 split evenly: head 0.15, overhead 0.17):

        batch 8:   one step 2.47, two half steps 2.72  -> 0.91x: stay whole (measured 0.87x)
        batch 32:  2.90 against 2.95                    -> 0.98x: stay whole (measured 0.93x)
        batch 128: 4.66 against 3.87                    -> 1.20x: in flight
        512 sequences (two steps' worth): 6.65 for 256 tokens against 7.24 for 512 -> 1.84x

    The half step costs nearly what the whole one does while the weight read dominates (decode at
    small batches); once the tokens' products and context reads dominate (hundreds of sequences,
    prompts), halving a step halves its time and both stages stay busy."""
    depth = min(depth, seqs)  # (a step in flight holds a sequence of its own)
    if depth < 2:
        return 1.0

    def head(rows: float) -> float:  # the LM head's pass, and its products for the scored rows
        return cost.head * (1 + rows / cost.tokens_per_weight_read)

    # One step: its sequences' share of the tokens and context, up to the step's limits.
    share = min(seqs, max_batch_size) / seqs
    whole_tokens = min(tokens * share, max_num_tokens)
    work = cost.work_of(whole_tokens, context * share)
    m = choose_micro_batches(work, pp_size, AUTO_MOST_PER_STAGE * pp_size)
    whole = (m + pp_size - 1) * (1 + work / m) + head(seqs * share) + cost.step_overhead
    # ``depth`` steps: the slowest carries an even share of the tokens or the largest sequence's.
    share = min(-(-seqs // depth), max_batch_size) / seqs
    round_tokens = min(tokens * min(1.0, share * depth), max_num_tokens * depth)  # (share: rounded up)
    step_tokens = min(max(round_tokens / depth, largest), max_num_tokens)
    work = cost.work_of(step_tokens, context * share)
    shares = cost.layer_shares or (1.0,) * pp_size  # (the last stage's layers, then its head)
    slowest = max(max(shares[:-1], default=0.0) * (1 + work), shares[-1] * (1 + work) + head(seqs * share))
    in_flight = max(depth * slowest, pp_size * (1 + work) + head(seqs * share)) + depth * cost.step_overhead
    return (round_tokens / in_flight) / (whole_tokens / whole)


def stage_costs(model: ModelConfig, build: BuildConfig) -> tuple[list[float], float]:
    """(each decoder layer's time, the last stage's extra time: the LM head) in one full decode step,
    in bytes of weight read: a linear layer costs its weight read plus its products for the step's
    ``max_batch_size`` tokens (``tokens_per_weight_read`` of them take one read's time). The split of
    layers over stages that evens these out (engine/pipeline/layout.py balanced_layer_counts) keeps
    the stages of steps in flight equally busy, where the slowest sets the pace.

    Left out, as they cancel or are small: the first stage's embedding (a gather of the step's rows)
    and the float32 logits (the last stage writes and sends them, rank 0 on the first stage receives
    and samples them: a few passes over rows x vocab on each side); norms and biases; attention's KV
    reads (they add to every layer and not to the head, so over long contexts the last stage could
    take a little more than this split gives it). A layer of routed experts reads every expert (a
    full step's tokens reach nearly all) but multiplies each token by its num_experts_per_tok."""
    dtype_bytes = DTYPE_BYTES.get(build.dtype, 2)
    weight_bytes = WEIGHT_BYTES.get(build.quantization or "", dtype_bytes)
    scale = 1.0 if build.quantization in EIGHT_BIT_PRODUCTS else weight_bytes / 2
    tokens = build.max_batch_size
    h = model.hidden_size
    attention = h * model.head_dim * 2 * (model.num_heads + model.num_kv_heads)
    layers = []
    for index in range(model.num_layers):
        if model.is_moe_layer(index):
            expert = 3 * h * model.moe_intermediate_size
            shared = model.n_shared_experts * expert
            read, multiplied = attention + shared + model.num_experts * expert, \
                attention + shared + model.num_experts_per_tok * expert
        else:
            read = multiplied = attention + 3 * h * model.intermediate_size
        layers.append(weight_bytes * (read + multiplied * tokens / (TOKENS_PER_WEIGHT_READ * scale)))
    # (the LM head keeps the model dtype whatever the layers' quantization)
    head = model.vocab_size * h * dtype_bytes * (1 + tokens / (TOKENS_PER_WEIGHT_READ * dtype_bytes / 2))
    return layers, head
