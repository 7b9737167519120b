"""The bound on top log-probs per generated token, and its check (no torch: serving/requests.py,
which converts Triton inputs without torch, refuses a bad value with the same words)."""
from __future__ import annotations

# OpenAI's limit on top_logprobs; each alternative costs a (k,) copy per generated token.
MAX_TOP_LOG_PROBS = 20


def num_top_log_probs_error(k) -> str | None:
    """Why ``k`` is no valid num_top_log_probs (an int in 0..MAX_TOP_LOG_PROBS), or None."""
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_TOP_LOG_PROBS:
        return f"num_top_log_probs must be an integer in 0..{MAX_TOP_LOG_PROBS} (0: off), got {k!r}"
    return None
