"""Which decoder layers each pipeline stage holds, and how ranks map onto stages.

Ranks: ``rank = stage * tp_size + tp_rank`` (TensorRT-LLM's mapping), so the ranks of one stage are
consecutive and the leader (rank 0) is tensor-parallel rank 0 of the first stage.

Split: engine.config.pipeline_layer_counts (even by default; an explicit list such as
``8,12,14,14``, vLLM's ``VLLM_PP_LAYER_PARTITION`` form, with ``--pp_layers``).

Rank files: ``rank{r}.safetensors`` holds stage s's part of tensor-parallel rank t's weights
(r = s * tp_size + t): its layers renumbered from 0 (the index into its own KV pool), the
embedding on the first stage, the final norm and LM head on the last (and the embedding there
too when the LM head is tied to it).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from engine.config import BuildConfig, ConfigError, ModelConfig, pipeline_layer_counts

_LAYER_NAME = re.compile(r"^layers\.(\d+)\.(.*)$")
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


def split_rank_weights(weights: dict, all_stages: list[Stage], tied_embeddings: bool) -> list[dict]:
    """One tensor-parallel rank's whole-model weights -> one dict per stage (renamed; tensors shared)."""
    out: list[dict] = [{} for _ in all_stages]
    for name, tensor in weights.items():
        for stage, held in zip(all_stages, out):
            local = stage_tensor_name(name, stage, tied_embeddings)
            if local is not None:
                held[local] = tensor
    return out
