"""Which decoder layers each pipeline stage holds, and how ranks map onto stages.

Ranks: ``rank = stage * tp_size + tp_rank`` (TensorRT-LLM's mapping), so the ranks of one stage are
consecutive and the leader (rank 0) is tensor-parallel rank 0 of the first stage.

Split: engine.config.pipeline_layer_counts reads an engine's list (an explicit one such as
``8,12,14,14``, vLLM's ``VLLM_PP_LAYER_PARTITION`` form, with ``--pp_layers``; an engine without one
was split evenly). Without ``--pp_layers`` the split is even; ``--pp_layers balanced`` records
``balanced_pp_layers``: the split that evens out the stages' time per step, the last stage's LM head and
rank 0's work on the first counted (Llama-3.1-8B at pp 2: 15,17; layers of unequal cost, dense among
expert layers, are balanced too). Not the default: the fullest stage sizes every rank's KV pool.

Rank files: ``rank{r}.safetensors`` holds stage s's part of tensor-parallel rank t's weights
(r = s * tp_size + t): its layers renumbered from 0 (the index into its own KV pool), the
embedding on the first stage, the final norm and LM head on the last (and the embedding there
too when the LM head is tied to it).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from itertools import accumulate

from engine.config import BuildConfig, ConfigError, ModelConfig, pipeline_layer_counts
from engine.pipeline.step_cost import stage_costs

_LAYER_NAME = re.compile(r"^layers\.(\d+)\.(.*)$")
# What rank 0's part of a step weighs on the first stage, in LM heads (balanced_pp_layers). On two H200s
# (session 18, Llama-3.1-8B, 256-sequence decode steps in flight) a step came every 5.97 ms with 14 or 16 of
# the 32 layers on the first stage (its graph 3.68 / 4.23 ms), and every 6.15 / 6.31 ms with 17 / 18 there;
# moving layers to the last stage (16-18 layers and the head, ~2.4 layers) never slowed it. So rank 0's work
# (its stage, the sampling of every row, the step's host work) weighs more than its layers: two heads give 15,17
# for that shape, between the two measured best. (Session 20 profiled it: rank 0's loop waits half of each step
# for the tokens of the step before, and the logits' trip is ~0.5 ms of it; benchmarks/results/engine.md.)
FIRST_STAGE_HEADS = 2.0
FIRST_STAGE_PREFIXES = ("embed_tokens.",)
LAST_STAGE_PREFIXES = ("norm.", "lm_head.")


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: layers [start, end) of the model; ``index`` of ``pp_size``."""

    index: int
    pp_size: int
    start: int
    end: int

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.pp_size - 1

    @property
    def num_layers(self) -> int:
        return self.end - self.start


def parse_pp_layers(text: str | None) -> list[int] | None:
    """``"8,12,14,14"`` -> [8, 12, 14, 14]; None or "" -> None (the even split)."""
    if not text:
        return None
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise ConfigError(f"--pp_layers {text!r} must be comma-separated layer counts, one per stage, "
                          "e.g. 8,12,14,14") from None


def balanced_pp_layers(model: ModelConfig, build: BuildConfig) -> list[int]:
    """The layers per stage engine.build records for ``--pp_layers balanced``: the split whose
    slowest stage is fastest by engine/pipeline/step_cost.py's stage_costs (at full decode steps;
    steps in flight run at the pace of the slowest stage). ConfigError where pp_size exceeds the layers.

    The last stage holds the LM head; the first holds rank 0, which samples every row from the float32
    logits and runs the executor's step for the whole pipeline: charged FIRST_STAGE_HEADS heads."""
    pipeline_layer_counts(model.num_layers, build.pp_size)  # (the named error for a pp_size too large)
    layer_costs, head = stage_costs(model, build)
    return balanced_layer_counts(layer_costs, build.pp_size, first_extra=FIRST_STAGE_HEADS * head, last_extra=head)


def balanced_layer_counts(layer_costs: list[float], pp_size: int, *, first_extra: float = 0.0,
                          last_extra: float = 0.0) -> list[int]:
    """Contiguous runs of the layers, one per stage and at least one layer each, that make the
    costliest stage cheapest; a stage costs its layers' ``layer_costs``, the first one ``first_extra``
    more and the last one ``last_extra`` more. Of the splits with that least costliest stage, those
    whose fullest stage holds fewest layers, and of them the one whose later stages take as many
    layers as they can (rank 0, on the first stage, has host work beside its layers; equal layers and
    no extras: 32 over 3 gives 10, 11, 11)."""
    n = len(layer_costs)
    prefix = [0.0, *accumulate(layer_costs)]

    def cost(stage: int, start: int, end: int) -> float:  # layers [start, end) as ``stage``
        return (prefix[end] - prefix[start] + (first_extra if stage == 0 else 0.0)
                + (last_extra if stage == pp_size - 1 else 0.0))

    # least[s][k]: the least costliest stage of layers [0, k) over stages 0..s (inf: too few layers)
    inf = float("inf")
    least = [[inf] * (n + 1) for _ in range(pp_size)]
    for k in range(1, n + 1):
        least[0][k] = cost(0, 0, k)
    for s in range(1, pp_size):
        for k in range(s + 1, n + 1):
            least[s][k] = min(max(least[s - 1][j], cost(s, j, k)) for j in range(s, k))
    bound = least[-1][n] * (1 + 1e-9)  # (float sums of the same costs in another order)
    # fewest[s][k]: of the splits of layers [0, k) over stages 0..s within ``bound``, the fewest layers on
    # the fullest stage. Many splits tie where one stage's cost is fixed above a mean stage's (the first,
    # its extra more than a few layers: Llama-3.1-8B at pp 16); their fullest stage sets every rank's KV
    # blocks and the largest weight load, so it is kept small (else pp 16 gave 1 x 11, 3, 5, 5, 5, 3).
    fewest = [[inf] * (n + 1) for _ in range(pp_size)]
    for k in range(1, n + 1):
        fewest[0][k] = k if cost(0, 0, k) <= bound else inf
    for s in range(1, pp_size):
        for k in range(s + 1, n + 1):
            fewest[s][k] = min((max(fewest[s - 1][j], k - j) for j in range(s, k) if cost(s, j, k) <= bound),
                               default=inf)
    most = fewest[-1][n]
    counts, end = [], n
    for s in range(pp_size - 1, 0, -1):
        start = min(j for j in range(s, end) if cost(s, j, end) <= bound and end - j <= most and fewest[s - 1][j] <= most)
        counts.append(end - start)
        end = start
    return [end, *reversed(counts)]


def stages_of(model: ModelConfig, build: BuildConfig) -> list[Stage]:
    """Every stage of an engine, in order."""
    out, start = [], 0
    for index, count in enumerate(pipeline_layer_counts(model.num_layers, build.pp_size, build.pp_layers)):
        out.append(Stage(index, build.pp_size, start, start + count))
        start += count
    return out


def stage_of_rank(model: ModelConfig, build: BuildConfig, rank: int) -> tuple[Stage, int]:
    """(stage, tp_rank) of global rank ``rank``."""
    index, tp_rank = divmod(rank, build.tp_size)
    return stages_of(model, build)[index], tp_rank


def stage_tensor_name(name: str, stage: Stage, tied_embeddings: bool) -> str | None:
    """The name a whole-model engine tensor has in ``stage``'s rank file, or None when the stage
    does not hold it."""
    match = _LAYER_NAME.match(name)
    if match is not None:
        layer = int(match.group(1))
        return f"layers.{layer - stage.start}.{match.group(2)}" if stage.start <= layer < stage.end else None
    if name.startswith(FIRST_STAGE_PREFIXES):
        return name if stage.is_first or (stage.is_last and tied_embeddings) else None
    if name.startswith(LAST_STAGE_PREFIXES):
        return name if stage.is_last else None
    return name  # nothing else in the supported families; kept on every stage if a family adds one
