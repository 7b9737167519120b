"""Finishing: a step's tokens reach their sequences, stops are checked, requests finish or fail,
responses go out, and an ended request is forgotten.

``_resolve_token`` puts a sampled token in place of its placeholder (engine/executor/overlap.py)
and runs the stop checks (end id, grammar, stop words, max_tokens); a speculative step's kept
tokens go through ``_take_verified`` (the rollback: engine/executor/speculative/executor_drafts.py)
and ``_resolve_verified``; beams advance in ``_beam_step``. ``_finish`` / ``_fail`` end sequences
and requests, ``_emit`` turns this iteration's news into responses, ``_retire`` gives back what an
ended request held, ``_deliver`` hands responses to the callback or the queue.

A mixin of ``Executor`` (engine/executor/executor.py), not a collaborator: ending a request touches
most of the executor's state (the scheduler and block pool, the adapter cache, the encoder stage,
the proposer, the disaggregation side, the active table and its id sets, the news of the iteration,
the response queue or callback, the draft counters of the stats), so passing those in would be the
executor again, piece by piece.
"""
from __future__ import annotations

import time
import traceback

import torch

from engine.executor import beam_search
from engine.executor.output import responses_for
from engine.executor.overlap import needs_tokens_on_host
from engine.executor.request import FinishReason, RequestState, Response, Sequence
from engine.executor.sampler import build_sampling_metadata, process_logits
from engine.executor.speculative import Verified
from engine.executor.speculative.executor_drafts import take_verified


class Finishing:
    """The executor's token resolution and finishing (see the module's docstring); its state is the
    ``Executor``'s."""

    def _collect_context_logits(self, item, chunk_logits: torch.Tensor) -> None:
        state = item.seq.state
        if not state.request.output.return_context_logits or item.seq is not state.sequences[0]:
            return
        have = sum(len(part) for part in state.context_logits_parts)
        new = max(0, min(item.start + item.num_new_tokens, item.seq.num_prompt_tokens) - have)
        if new:
            state.context_logits_parts.append(chunk_logits[:new].float().cpu())

    def _resolve_token(self, seq: Sequence, index: int, token: int, log_prob: float | None,
                       logits: torch.Tensor | None, row: int, now: int,
                       top: tuple[list[int], list[float]] | None = None) -> None:
        """seq.token_ids[index] (its oldest placeholder) becomes ``token``; then the stop checks.
        A stop drops the placeholders after it: their tokens are never emitted. ``top``: the
        step's K best (ids, log-probs) for this row, K >= the request's num_top_log_probs."""
        request, perf = seq.state.request, seq.state.perf
        perf.first_token_time_ns = perf.first_token_time_ns or now
        perf.last_token_time_ns = now
        if request.streaming:  # a non-streaming request has news only when it finishes (_finish touches it)
            self._touched[seq.request_id] = seq.state
        grammar = seq.grammar
        if grammar is not None and not grammar.accept_token(token):  # never, with the mask applied
            self._fail(seq.state, f"guided decoding: the grammar refused generated token {token}")
            return
        if token == request.end_id:
            self._drop_unresolved(seq, keep=index)
            self._finish(seq, FinishReason.END_ID)
            return
        seq.token_ids[index] = token
        seq.num_unresolved_tokens -= 1
        if log_prob is not None:
            seq.log_probs.append(log_prob)
            seq.cum_log_prob += log_prob
        if top is not None:
            k = request.output.num_top_log_probs
            seq.top_log_prob_ids.append(top[0][:k])
            seq.top_log_probs.append(top[1][:k])
        if request.output.return_generation_logits:
            seq.generation_logits.append(logits[row].float().cpu())
        length = index + 1
        if grammar is not None and grammar.is_terminated():  # complete, and the request has no end_id
            self._drop_unresolved(seq, keep=length)
            self._finish(seq, FinishReason.END_ID)
            return
        if request.stop_words or length - seq.num_prompt_tokens >= request.max_tokens:
            reason = self._stop_reason(seq, length)  # (else NOT_FINISHED, known without the call)
            if reason is not FinishReason.NOT_FINISHED:
                self._drop_unresolved(seq, keep=length)
                self._finish(seq, reason)

    @staticmethod
    def _drop_unresolved(seq: Sequence, keep: int) -> None:
        """Cut token_ids to ``keep`` tokens: every placeholder goes (they all sit at the tail)."""
        del seq.token_ids[keep:]
        seq.num_unresolved_tokens = 0

    def _stop_reason(self, seq: Sequence, length: int) -> FinishReason:
        """Why seq stops after its first ``length`` tokens, or NOT_FINISHED."""
        request = seq.state.request
        generated = length - seq.num_prompt_tokens
        for word in request.stop_words or ():
            if word and len(word) <= generated and seq.token_ids[length - len(word):length] == list(word):
                return FinishReason.STOP_WORDS
        if generated >= request.max_tokens:
            return FinishReason.LENGTH
        return FinishReason.NOT_FINISHED

    def _beam_step(self, beam_rows: list[tuple[Sequence, torch.Tensor]], now: int) -> None:
        for seq, raw in beam_rows:
            md = build_sampling_metadata([seq], self.runner.vocab_size, raw.device, False)
            seq.pending_logprobs = process_logits(raw.unsqueeze(0), md).log_softmax(dim=-1)[0]
        for state in {seq.state.request_id: seq.state for seq, _ in beam_rows}.values():
            live = [s for s in state.sequences if not s.is_finished]
            if live and all(s.pending_logprobs is not None for s in live):
                state.perf.first_token_time_ns = state.perf.first_token_time_ns or now
                state.perf.last_token_time_ns = now
                self._touched[state.request_id] = state
                beam_search.advance(state, live, self.blocks, self.scheduler)
                if beam_search.is_done(state):
                    for seq in state.sequences:
                        self._finish(seq, seq.finish_reason if seq.finish_reason is not FinishReason.NOT_FINISHED
                                     else FinishReason.LENGTH)

    def _take_verified(self, item, verified: Verified, kv_moves: list) -> None:
        """Roll a drafted sequence back to its accepted tokens (executor_drafts.take_verified), count
        its drafts for the stats, and stop syncing a request whose external drafts are all verified."""
        take_verified(item, verified, kv_moves, self.blocks, self.runner.tokens_per_block)
        state = item.seq.state
        self._num_draft_tokens_total += verified.num_draft_tokens
        self._num_accepted_draft_tokens_total += verified.num_accepted
        if state.request_id in self._sync_request_ids and not needs_tokens_on_host(state.request) and not any(
                s.draft_token_ids for s in state.sequences if not s.is_finished):
            self._sync_request_ids.discard(state.request_id)  # its external drafts are all verified

    def _resolve_verified(self, seq: Sequence, verified: Verified, logits: torch.Tensor | None, first: int,
                          now: int) -> None:
        """Stop checks on each emitted token in order; a stop drops the tokens after it."""
        start = len(seq.token_ids) - len(verified.token_ids)
        for j, token in enumerate(verified.token_ids):
            if seq.is_finished:
                return
            log_prob = None if verified.log_probs is None else verified.log_probs[j]
            self._resolve_token(seq, start + j, token, log_prob, logits, first + j, now)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.is_finished:
            return
        if seq.num_unresolved_tokens:  # e.g. cancelled with a step in flight: its token is not sent
            self._drop_unresolved(seq, keep=len(seq.token_ids) - seq.num_unresolved_tokens)
        if seq.state.request.request_type == "context_only" and reason is not FinishReason.CANCELLED:
            if (error := self.disagg.export(seq)) is not None:  # pins the prompt's blocks before the scheduler
                self._fail(seq.state, error)  # frees the sequence's; a failed export pins none: this request alone
                return
        self.scheduler.finish(seq)
        seq.finish_reason = reason
        self._touched[seq.request_id] = seq.state

    def _fail(self, state: RequestState, message: str) -> None:
        for seq in state.sequences:
            if not seq.is_finished:
                self.scheduler.finish(seq)
                seq.finish_reason = FinishReason.ERROR
        self._retire(state)
        self._touched.pop(state.request_id, None)
        self._deliver([Response(state.request_id, error=message)])

    def _fail_all(self, message: str) -> None:
        for state in list(self._active.values()):
            self._fail(state, message)
        with self._cv:
            pending, self._inbox = self._inbox, []
        self._deliver([Response(state.request_id, error=message) for state in pending])

    def _emit(self) -> None:
        self._emit_after_launch = False
        responses = []
        for state in self._touched.values():
            new = responses_for(state, self.config.stream_interval)
            if self.encoder_stage is not None:  # Whisper token timestamps, before the cross K/V goes
                self.encoder_stage.add_token_timestamps(state, new)
            responses += new
            if all(s.is_finished for s in state.sequences):
                self._retire(state)
        self._touched.clear()
        if responses:
            self._deliver(responses)

    def _retire(self, state: RequestState) -> None:
        """The request has ended (every sequence finished, or failed): forget it."""
        if state.lora_key is not None:  # its adapter slot (or its claim on one) goes back
            if state.lora_slot >= 0:
                self.adapters.release(state.lora_key)
            else:
                self.adapters.forget_request(state.lora_key)
            state.lora_key, state.lora_slot = None, -1
        self._leave_queue(state)  # e.g. cancelled while still queued
        if self.encoder_stage is not None:  # its cross-KV blocks go back
            self.encoder_stage.release(state)
        if self.proposer is not None:
            for seq in state.sequences:
                self.proposer.release(seq)
        self._active.pop(state.request_id, None)
        self._sync_request_ids.discard(state.request_id)
        self._table_request_ids.discard(state.request_id)
        self._keys_pending_ids.discard(state.request_id)
        self._mrope_request_ids.discard(state.request_id)
        self._sampler_request_ids.discard(state.request_id)

    def _deliver(self, responses: list[Response]) -> None:
        started = time.perf_counter()
        if self._callback is None:
            self._responses.put(responses)
        else:
            try:
                self._callback(responses)
            except Exception:  # a broken callback must not stop the loop
                traceback.print_exc()
        self._step_stats.deliver_ms += (time.perf_counter() - started) * 1e3
