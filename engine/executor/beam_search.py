"""Beam search over the executor's sequences: one Sequence per beam, blocks shared on forks.

A beam-search request owns ``beam_width`` sequences. Every beam computes its last token and
parks its log-probs (``seq.pending_logprobs``); once all live beams have them, ``advance``
picks the ``beam_width`` best (beam, token) extensions of the running scores. A beam whose new
parent is another beam takes that parent's tokens and a reference on the parent's *full*
computed blocks; the parent's partial last block is not copied but recomputed (at most
tokens_per_block - 1 tokens), so no block is ever written by two beams.

Scores: ``cum_log_prob / generated_len ** length_penalty`` (length_penalty defaults to 1.0).
A hypothesis ends at ``end_id`` (the token is not kept) or at ``max_tokens``. With
``early_stopping`` (the default) the search stops once ``beam_width`` hypotheses ended;
with ``early_stopping=0`` it also stops once no live beam scores above the worst ended one.
Stop words are not checked inside beam search, and beams return no generation logits.
"""
from __future__ import annotations

from dataclasses import dataclass


from engine.executor.kv_cache import BlockManager
from engine.executor.request import FinishReason, RequestState, Response, Result, Sequence, SequenceStatus


@dataclass
class Hypothesis:
    score: float
    tokens: list[int]  # generated tokens
    log_probs: list[float]
    cum_log_prob: float
    reason: FinishReason


def _score(cum_log_prob: float, length: int, length_penalty: float | None) -> float:
    penalty = 1.0 if length_penalty is None else length_penalty
    return cum_log_prob / max(length, 1) ** penalty


def _hypotheses(state: RequestState) -> list[Hypothesis]:
    if not hasattr(state, "hypotheses"):
        state.hypotheses = []
    return state.hypotheses


def advance(state: RequestState, beams: list[Sequence], blocks: BlockManager, scheduler) -> None:
    """Extend every live beam by one token from the best candidates; park ended hypotheses."""
    import torch  # here, not at the top: engine_process.py's client side imports this module without torch

    request = state.request
    width = len(beams)
    # (width, vocab) on the host: one copy, then every per-candidate read below is free
    logprobs = torch.stack([b.pending_logprobs for b in beams]).float().cpu()
    cum = torch.tensor([b.cum_log_prob for b in beams], dtype=torch.float32)
    if all(b.num_generated_tokens == 0 for b in beams):
        cum[1:] = float("-inf")  # every beam holds the same prompt: expand only the first
    scores = (cum.unsqueeze(1) + logprobs).flatten()
    top = scores.topk(min(2 * width, scores.numel()))
    vocab = logprobs.shape[1]
    chosen = []
    for score, flat in zip(top.values.tolist(), top.indices.tolist()):
        parent, token = divmod(flat, vocab)
        if score == float("-inf"):
            break
        token_lp = float(logprobs[parent, token])
        if token == request.end_id:
            p = beams[parent]
            _hypotheses(state).append(Hypothesis(
                _score(score, p.num_generated_tokens + 1, request.sampling.length_penalty),
                p.generated_token_ids, list(p.log_probs), score, FinishReason.END_ID))
            continue
        chosen.append((parent, token, token_lp))
        if len(chosen) == width:
            break
    _rewire(beams, chosen, blocks)
    for beam in beams:
        beam.pending_logprobs = None
    if beams[0].num_generated_tokens >= request.max_tokens:
        for beam in beams:
            _hypotheses(state).append(Hypothesis(
                _score(beam.cum_log_prob, beam.num_generated_tokens, request.sampling.length_penalty),
                beam.generated_token_ids, list(beam.log_probs), beam.cum_log_prob, FinishReason.LENGTH))


def _rewire(beams: list[Sequence], chosen: list[tuple[int, int, float]], blocks: BlockManager) -> None:
    """Make beam j the extension chosen[j] of its parent, sharing the parent's full blocks."""
    snapshot = [(list(b.token_ids), list(b.block_ids), b.num_computed_tokens, list(b.block_hashes),
                 list(b.log_probs), b.cum_log_prob) for b in beams]
    T = blocks.tokens_per_block
    to_free = []
    for j, beam in enumerate(beams):
        if j >= len(chosen):  # fewer live candidates than beams (all others ended): beam idles on its parent 0
            chosen.append(chosen[0] if chosen else (j, beam.token_ids[-1], 0.0))
        parent, token, token_lp = chosen[j]
        tokens, table, computed, hashes, log_probs, cum = snapshot[parent]
        if parent != j:  # a beam extending itself keeps its blocks; any other forks from its parent
            shared = table[:computed // T] if beam.status is SequenceStatus.RUNNING else []
            blocks.acquire(shared)
            to_free.append(beam.block_ids)
            beam.block_ids = list(shared)
            beam.num_computed_tokens = len(shared) * T
            beam.block_hashes = hashes[:len(shared)]
            beam.num_registered_blocks = len(shared)
        beam.token_ids = tokens + [token]
        beam.log_probs = log_probs + [token_lp]
        beam.cum_log_prob = cum + token_lp
    for table in to_free:
        blocks.free(table)


def is_done(state: RequestState) -> bool:
    request = state.request
    width = request.sampling.beam_width
    hyps = _hypotheses(state)
    live = [s for s in state.sequences if not s.is_finished]
    if any(h.reason is FinishReason.LENGTH for h in hyps) or not live:
        return True
    if len(hyps) < width:
        return False
    if request.sampling.early_stopping is None or request.sampling.early_stopping:
        return True
    worst = min(h.score for h in sorted(hyps, key=lambda h: -h.score)[:width])
    best_live = max(_score(s.cum_log_prob, s.num_generated_tokens, request.sampling.length_penalty) for s in live)
    return best_live <= worst


def responses(state: RequestState) -> list[Response]:
    """Streaming: the current beams (whole hypotheses so far); final: the best ended hypotheses."""
    request = state.request
    done = all(s.is_finished for s in state.sequences)
    if 0 in state.finished_streams:
        return []
    if not done and not request.streaming:
        return []
    # A stream never repeats the prompt, not even in its final response (TRT-LLM's rule).
    prompt = [] if state.exclude_input or request.streaming else list(request.input_token_ids)
    if done:
        state.finished_streams.add(0)
        if any(s.finish_reason is FinishReason.CANCELLED for s in state.sequences) or not _hypotheses(state):
            beams = [Hypothesis(0.0, s.generated_token_ids, s.log_probs, s.cum_log_prob, s.finish_reason)
                     for s in state.sequences]
        else:
            beams = sorted(_hypotheses(state), key=lambda h: -h.score)
        n = request.sampling.num_return_sequences or 1
        beams = beams[:n if n > 1 else request.sampling.beam_width]
    else:
        beams = [Hypothesis(0.0, s.generated_token_ids, s.log_probs, s.cum_log_prob, FinishReason.NOT_FINISHED)
                 for s in state.sequences]
        prompt = []
    result = Result(output_token_ids=[prompt + h.tokens if done else h.tokens for h in beams], is_final=done,
                    finish_reasons=[h.reason for h in beams])
    if request.output.return_log_probs:
        result.log_probs = [list(h.log_probs) for h in beams]
        result.cum_log_probs = [h.cum_log_prob for h in beams]
    if request.output.return_perf_metrics:
        result.perf = state.perf
    return [Response(state.request_id, result=result)]
