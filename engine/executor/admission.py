"""Admission: a request from ``enqueue_requests`` to the scheduler's queue (or to its error).

``Admission._rejection`` checks a request against the executor's switches and limits at enqueue;
``_admit`` (on the loop thread) makes its sequences, and a request joins the queue once what it
waits for is ready, off the loop: its LoRA adapter's parse (engine/lora/cache.py), then its grammar
(engine/executor/guided.py); a generation_only request first pulls its context's KV
(engine/executor/disaggregated.py), an encoder-decoder one waits for its encoder run. Also here:
cancellations, the returned sequences that share sequence 0's prompt blocks (``_fork_siblings``) and
the queued count.

A mixin of ``Executor`` (engine/executor/executor.py), not a collaborator: admitting reads and
writes most of the executor's state (the active table and its id sets, the queued count, the inbox
and its lock, the scheduler, the adapter cache, the grammar cache, the encoder stage, the
disaggregation side) and calls its finishing (``_fail``, ``_resolve_token``: engine/executor/
finishing.py), so passing those in would be the executor again, piece by piece.
"""
from __future__ import annotations

import random

from engine.encoder_decoder.encoder_stage import encoder_input_error
from engine.executor import state_cache
from engine.executor.guided import GuideError, make_matcher
from engine.executor.overlap import needs_tokens_on_host
from engine.executor.prompt_table import prompt_cache_keys
from engine.executor.sampler import greedy_alone
from engine.executor.request import (
    FinishReason, Request, RequestState, Sequence, SequenceStatus, now_ns, validate_request,
)
from engine.executor.speculative.executor_drafts import attach_external_draft, has_external_drafts
from engine.executor.speculative.lookahead import lookahead_request_error
from engine.lora.adapter import LoraError


class Admission:
    """The executor's admission (see the module's docstring); its state is the ``Executor``'s."""

    def _rejection(self, request: Request) -> str | None:
        """Why ``request`` is refused at enqueue (a message naming the field and what is allowed), or None."""
        if self._stopping:
            return "the executor is shut down and accepts no requests"
        disagg_error = self.disagg.request_error(request)
        if disagg_error is not None:
            return disagg_error
        if request.guided_decoding is not None and self.grammars is None:
            return ("guided_decoding_guide_type: guided decoding is not enabled on this model; set the "
                    "tensorrt_llm parameter guided_decoding_backend to xgrammar, or send the request "
                    "without guided_decoding_guide_type/guided_decoding_guide")
        if self.config.speculative is not None and (request.sampling.beam_width or 1) > 1:
            return (f"beam_width {request.sampling.beam_width}: beam search is not supported with speculative "
                    f"decoding (speculative mode '{self.config.speculative.mode}' is on); send beam_width 1")
        if request.lookahead_config is not None and (error := lookahead_request_error(request, self.config.speculative)):
            return error
        if request.lora is not None and self.adapters is None:
            return ("lora_task_id: LoRA is not enabled on this model; set the tensorrt_llm parameter enable_lora "
                    "to true, or send the request without lora_task_id/lora_weights/lora_config/lora_path")
        if self.state_slots is not None:
            error = state_cache.request_error(request, self.runner.model_config.architecture)
            if error is not None:
                return error
        encoder_error = encoder_input_error(request, self.encoder_stage)
        if encoder_error is not None:
            return encoder_error
        limit = self.config.max_queue_size
        if limit and len(self._inbox) + self._num_unscheduled >= limit:
            return f"Maximum queue size of {limit} has been reached, rejecting request"
        try:
            return validate_request(request, self.limits)
        except (TypeError, ValueError) as err:
            return f"invalid request: {err}"

    def _admit(self, new: list[RequestState]) -> None:
        for state in new:
            self._active[state.request_id] = state
            if needs_tokens_on_host(state.request) or has_external_drafts(state.request):
                self._sync_request_ids.add(state.request_id)  # (external drafts: until they are verified)
            state.is_queued = True
            self._num_unscheduled += 1
            beam_width = state.request.sampling.beam_width or 1
            table = state.request.prompt_table
            cache_keys = None
            if table is not None:  # the prefix cache sees each fake id as its table's content
                self._table_request_ids.add(state.request_id)
                self._keys_pending_ids.add(state.request_id)
                made = state.prompt_cache_keys  # at enqueue, off this thread (request.py normalize_all: keys or a Future)
                cache_keys = (made[2] if made is not None and made[0] is state.request.input_token_ids and made[1] is table
                              else prompt_cache_keys(state.request.input_token_ids, table, self.limits.vocab_size))
            if state.request.mrope is not None:
                self._mrope_request_ids.add(state.request_id)
            if not greedy_alone(state.request):
                self._sampler_request_ids.add(state.request_id)
            for index in range(state.num_streams if beam_width == 1 else beam_width):
                seq = Sequence(next(self._seq_ids), state, sequence_index=0 if beam_width > 1 else index,
                               beam_index=index if beam_width > 1 else 0)
                seq.can_reuse_prefix = not state.request.output.return_context_logits
                seq.prompt_cache_keys = cache_keys
                seq.seed = self._seed_for(state, index)
                attach_external_draft(seq)
                state.sequences.append(seq)
            if state.request.lora is not None and not self._prepare_adapter(state):
                continue
            self._prepare(state)

    def _prepare(self, state: RequestState) -> None:
        """A request joins the queue once what it waits for is ready, off the loop: its adapter's
        parse (engine/lora/cache.py), then its grammar (engine/executor/guided.py)."""
        if state.adapter_future is not None:
            self._wait_for(state, state.adapter_future)
        elif state.request.guided_decoding is not None and state.grammar_future is None:
            self._compile_guide(state)
        else:
            self._schedule_sequences(state)

    def _prepare_adapter(self, state: RequestState) -> bool:
        """Find or start loading the request's adapter; False (the request failed) if it cannot be."""
        lora = state.request.lora
        try:
            state.adapter_future = self.adapters.prepare(lora)
        except LoraError as err:
            self._fail(state, str(err))
            return False
        self.adapters.note_request(lora.task_id)
        state.lora_key = lora.task_id
        return True

    def _acquire_adapter(self, state: RequestState, behind_a_waiter: bool = False) -> bool:
        """The scheduler admits ``state``'s first sequence: it needs its adapter in a slot. False:
        every slot is held by running requests, or an earlier adapter request waits for one
        (``behind_a_waiter``: it gets the next slot first); it waits."""
        if state.lora_slot >= 0 or state.request.lora is None:
            return True
        if behind_a_waiter:
            return False
        slot = self.adapters.acquire(state.lora_key)
        if slot is None:
            return False
        state.lora_slot = slot
        return True

    def _wait_for(self, state: RequestState, future) -> None:
        self._compiling[state.request_id] = state
        if future.done():
            self._admit_compiled([state])
        else:
            future.add_done_callback(lambda _, state=state: self._grammar_ready(state))

    def _schedule_sequences(self, state: RequestState) -> None:
        if self.encoder_stage is not None and self.encoder_stage.take(state):
            return  # it waits for its encoder run (_step)
        if state.request.request_type == "generation_only":
            self._start_generation_only(state.sequences[0])
            return
        for index, seq in enumerate(state.sequences):
            if index == 0 or state.is_beam_search:
                self.scheduler.add(seq)

    def _start_generation_only(self, seq: Sequence) -> None:
        """The context phase's KV comes into this pool (a pull on streams of its own; on CUDA it finishes
        at a later step: engine/executor/disaggregated.py, kv_pull.py), then _continue_generation_only."""
        error = self.disagg.import_kv(seq)
        if error is not None:
            self._fail(seq.state, error)

    def _continue_generation_only(self, seq: Sequence, first_token: int) -> None:
        """The KV arrived: the context's first token is appended (with the usual stop checks); then the
        sequence decodes like any other."""
        seq.token_ids.append(first_token)
        seq.num_unresolved_tokens += 1
        self._resolve_token(seq, len(seq.token_ids) - 1, first_token, None, None, 0, now_ns())
        if not seq.is_finished:
            self.scheduler.add(seq)

    def _compile_guide(self, state: RequestState) -> None:
        """The request waits (queued, unscheduled) until its grammar is compiled off the loop."""
        state.grammar_future = self.grammars.compile(state.request.guided_decoding)
        self._wait_for(state, state.grammar_future)

    def _grammar_ready(self, state: RequestState) -> None:
        with self._cv:  # (on a compile thread)
            self._compiled.append(state)
            self._cv.notify()

    def _admit_compiled(self, ready: list[RequestState]) -> None:
        """Requests whose adapter was parsed go on to their grammar (or the queue); guided requests
        whose grammar compiled get a matcher per sequence and join the queue. A bad adapter or a
        guide that failed to compile fails its request."""
        for state in ready:
            if self._compiling.pop(state.request_id, None) is None or state.request_id not in self._active:
                continue  # cancelled, failed or shut down meanwhile
            if state.is_cancelled or all(seq.is_finished for seq in state.sequences):
                continue
            if state.adapter_future is not None:
                future, state.adapter_future = state.adapter_future, None
                try:
                    self.adapters.loaded(state.lora_key, future)
                except Exception as err:
                    self._fail(state, str(err) if isinstance(err, LoraError) else f"LoRA adapter: {err!r}")
                    continue
                self._prepare(state)
                continue
            try:
                compiled = state.grammar_future.result()
            except Exception as err:
                self._fail(state, str(err) if isinstance(err, GuideError) else f"guided decoding: {err!r}")
                continue
            for seq in state.sequences:
                seq.grammar = make_matcher(compiled, state.request.end_id)
            self._schedule_sequences(state)

    def _seed_for(self, state: RequestState, index: int) -> int:
        seed = state.request.sampling.seed
        if seed is None:
            return random.getrandbits(62)
        return (seed + index) % (1 << 62)  # each returned sequence draws its own stream

    def _cancel(self, request_ids: set[int]) -> None:
        for request_id in request_ids:
            state = self._active.get(request_id)
            if state is not None:
                state.is_cancelled = True
                for seq in state.sequences:
                    self._finish(seq, FinishReason.CANCELLED)

    def _fork_siblings(self, first: Sequence) -> None:
        """num_return_sequences > 1: sequences 1..n-1 take references on sequence 0's full prompt
        blocks (just computed) and join the queue; only the prompt's partial tail is recomputed."""
        state = first.state
        if state.is_beam_search:
            return
        T = self.blocks.tokens_per_block
        shared = first.block_ids[:(first.num_prompt_tokens - 1) // T]  # never the block of the last token
        for seq in state.sequences[1:]:
            if seq.status is SequenceStatus.WAITING and not seq.block_ids and seq not in self.scheduler.waiting:
                self.blocks.acquire(shared)
                seq.block_ids, seq.num_computed_tokens = list(shared), len(shared) * T
                seq.block_hashes, seq.num_registered_blocks = first.block_hashes[:len(shared)], len(shared)
                self.scheduler.add(seq)

    def _note_scheduled(self, state: RequestState, now: int) -> None:
        if not state.perf.first_scheduled_time_ns:
            state.perf.first_scheduled_time_ns = now
        self._leave_queue(state)

    def _leave_queue(self, state: RequestState) -> None:
        if state.is_queued:
            state.is_queued = False
            self._num_unscheduled -= 1
