"""Lookahead decoding's three sizes (TensorRT-LLM's LookaheadDecodingConfig), their ranges and the
tree they make; outside the speculative package (engine/executor/speculative/lookahead.py runs the
method) so that executor_config.py checks them without importing the runner.
"""
from __future__ import annotations

from dataclasses import dataclass

MAX_LOOKAHEAD_SIZE = 64  # each of W, N, G; the tree's (N-1)(W+G) drafts must also fit max_draft_len's 64
# The least of each size: a window of one column, n-grams of two tokens (one Jacobi level), no pool n-grams.
MIN_LOOKAHEAD_SIZES = {"window_size": 1, "ngram_size": 2, "verification_set_size": 0}


class LookaheadConfigError(ValueError):
    """Lookahead sizes out of range (the message names the field, the value and what is allowed)."""


@dataclass(frozen=True)
class LookaheadSizes:
    window_size: int  # W: Jacobi window columns
    ngram_size: int  # N: n-gram length (N - 1 Jacobi levels, drafts N - 1 deep)
    verification_set_size: int  # G: pool n-grams verified per step

    @property
    def num_draft_tokens(self) -> int:
        """Drafts in one step's tree: (N - 1) * (W + G)."""
        return (self.ngram_size - 1) * (self.window_size + self.verification_set_size)

    def check(self, prefix: str = "lookahead_", limit: int | None = None) -> "LookaheadSizes":
        """Raise LookaheadConfigError naming the field (``prefix`` + name) of a size out of range."""
        for name, low in MIN_LOOKAHEAD_SIZES.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= MAX_LOOKAHEAD_SIZE:
                raise LookaheadConfigError(f"{prefix}{name} must be an integer in {low}..{MAX_LOOKAHEAD_SIZE}, "
                                           f"got {value!r}")
        limit = MAX_LOOKAHEAD_SIZE if limit is None else limit
        if self.num_draft_tokens > limit:
            raise LookaheadConfigError(
                f"{prefix}window_size {self.window_size}, {prefix}ngram_size {self.ngram_size} and "
                f"{prefix}verification_set_size {self.verification_set_size} make a tree of (N-1)*(W+G) = "
                f"{self.num_draft_tokens} drafts; at most {limit} are allowed")
        return self

    def fits_within(self, other: "LookaheadSizes") -> bool:
        return (self.window_size <= other.window_size and self.ngram_size <= other.ngram_size
                and self.verification_set_size <= other.verification_set_size)


def sizes_of_config(spec) -> LookaheadSizes:
    """A SpeculativeConfig's three lookahead_* sizes; all are required."""
    missing = [name for name in ("lookahead_window_size", "lookahead_ngram_size", "lookahead_verification_set_size")
               if getattr(spec, name) is None]
    if missing:
        raise LookaheadConfigError(f"decoding_mode lookahead needs {', '.join(missing)} (all three of "
                                   f"lookahead_window_size, lookahead_ngram_size, lookahead_verification_set_size)")
    return LookaheadSizes(spec.lookahead_window_size, spec.lookahead_ngram_size, spec.lookahead_verification_set_size)
