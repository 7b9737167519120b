"""Several steps in flight across pipeline stages: the executor's overlapped scheduling (engine/
executor/overlap.py) generalized from one step ahead to ``depth`` steps, where the runner is a
pipeline (pp_size > 1, one rank per stage).

Why: with one step in flight a stage idles while another works (rank 0 samples step N only after
the last stage's logits came back, then starts step N+1), so pp 2 is at best one GPU's speed.
Here rank 0 launches step N's stage-0 work (StageRunner.launch: compute, the isend, its logits
irecv posted) and only then finishes step N - depth + 1 (its logits waited on, sampled, the tokens
stored in the ring), so rank 0's stream holds

    stage 0 (rank 0):  s0(N) | sample(N-1) | s0(N+1) | sample(N) | ...
    stage 1:           s1(N-1)             | s1(N)              | ...

and each stage works on a different step at the same time (depth = pp_size fills the pipeline).

Groups ("virtual engines"): a sequence in a launched, not yet sampled step has no new token yet
(its placeholder comes with the sampling), so the scheduler, which schedules a sequence only when
it has an uncomputed token, leaves it out of the next steps: consecutive steps take disjoint
sequences, and the running set splits into ``depth`` groups by itself (a new request joins the
step that admits it). The block pool and block tables are the leader's as before.

The sampled-token ring keeps its two halves, but a step's half is the executor's parity at its
launch and the parity flips at each sampling, so two launched steps may share a half (depth 2:
steps 1 and 2 both write half 0). Stream order on rank 0 keeps it right: each iteration launches,
then samples, then the host reads the step sampled one iteration before. So step k's tokens are
read from the ring only by the step launched in the iteration after step k was sampled (its
sequences had no new token before; later steps take the tokens from the host, which reads them in
that iteration from the pinned buffer of the parity at step k's sampling), and no sampling comes
between step k's and that launch. The pinned buffers alternate strictly: the host reads step k's
tokens before step k + 2 samples into the same buffer.

Transfers stay matched in order on every rank: a step's plan, its sends and rank 0's logits
receives are queued at launch in the order of today's single step (each micro-batch's logits
receive right after its send, the last stage's order), and finishing only waits. A launched step
is one micro-batch (``ForwardBatch.micro_batches``: the other steps fill the pipeline, and a
micro-batch re-reads the stage's weights) unless its work exceeds the step launched before it by
much (a long prompt next to a decode step): the excess is cut as one step alone would be
(``PipelinedSteps._micro_batches``). No heartbeat goes out while a step is unfinished
(LeaderRunner.launch says why).

Which steps: only while every active request takes its tokens on the device. Requests that need
tokens on the host between steps keep the one-step path (penalties, bad words, beams, returned
context/generation logits: the executor's ``_must_sync``; speculative decoding; guided decoding,
whose masks follow the previous token; disaggregated context_only / generation_only requests).
While one is active the launched steps are drained first; nothing is refused. Log-probs and top
log-probs ride with the sampled tokens and work either way. A launched step whose rows only draw
(greedy or seeded draws, nothing else asked) is sampled on the last stage
(ForwardBatch.sample_on_last_stage, engine/pipeline/runner.py): ``finish`` then gives its token
ids, which go to the ring as the sampler's would.

And only while they pay (``in_flight_gain``, engine/pipeline/step_cost.py): a sequence's next step
needs its sampled token, so the steps in flight carry different sequences and a batch of b becomes
``depth`` steps of b / depth, each re-reading every stage's weights. At small decode batches a half
step costs nearly a whole one (the weight read dominates) and the last stage (LM head) sets the
pace, so two half steps in flight were slower than one whole step (session 17, Llama-3.1-8B PP 2 on
two H200s: batch 8 1,489 against 1,705 tok/s, batch 32 5,658 against 6,091); with hundreds of
sequences or prompts to fill a step's time grows with its tokens and both stages stay busy
(offline 128/128: 1.46x). So each iteration weighs the sequences that could run now: steps go in
flight once the model says >= ``ENTER_GAIN`` x and stay so until it says < ``LEAVE_GAIN`` x (no
flapping at the edge); going back to one step drains the launched ones first (their tokens reach the
host: a step's sampled-token ring half is read only by the launch right after it, see above).

The host on rank 0 runs about one step ahead: each iteration waits for the tokens of the step
sampled one iteration before (the executor's _finish_in_flight), i.e. for sample(n-2) when step n
was just launched. The decode and prefill graphs' ``_copied.synchronize()`` (launching step n+1
waits until step n's input copies ran) adds no wait at depth 2: rank 0's stream runs those copies
right after sample(n-2), which the host already waited for. At depth >= 3 it would bound the
overlap to about two steps; measured, it does not matter: three pinned input sets per decode graph (the host
free to launch three steps ahead) left PP 2 at depth 3 and 4 stepping as at 2 (~6.0 ms at 256 sequences on two
H200s, 2026-11-30), so the sets stayed one.

``TRITONLLM_PP_STEPS_IN_FLIGHT``: unset: up to pp_size steps, in flight where they pay (the default
for pipelines of one rank per stage); 0 or 1: off (one step at a time); N >= 2: N steps, always in
flight (the pre-cost behaviour, kept for tests and measurements). Pipelines of one rank per stage
only (tp_size 1): with tp_size > 1 stage 0's other ranks would have to receive each step's sampled
tokens in the launched order (a broadcast per step), not built.
"""
from __future__ import annotations

import logging
import os
from collections import deque
from dataclasses import dataclass
from itertools import chain
from typing import Any

from engine.executor.overlap import InFlightStep
from engine.pipeline.step_cost import AUTO_MOST_PER_STAGE, choose_micro_batches, in_flight_gain

STEPS_IN_FLIGHT_ENV = "TRITONLLM_PP_STEPS_IN_FLIGHT"
# Steps go in flight when the cost model gives them this gain over one step at a time, and go back to
# one step below LEAVE_GAIN (module docstring; the model was ~5% optimistic at batch 32 on the H200s).
ENTER_GAIN, LEAVE_GAIN = 1.1, 1.0
logger = logging.getLogger(__name__)


def steps_in_flight(runner, environ=os.environ) -> int:
    """How many steps the executor may keep launched with this runner: where the runner is a
    pipeline of one rank per stage (launch/finish), ``STEPS_IN_FLIGHT_ENV`` or else pp_size; else 1."""
    value = environ.get(STEPS_IN_FLIGHT_ENV, "").strip()
    if (value and int(value) < 2) or not hasattr(runner, "launch"):
        return 1
    place = getattr(runner, "place", None)
    if place is None or place.stage.pp_size < 2:
        return 1
    if place.tp_size != 1:
        if value:
            logger.warning("%s=%s is ignored with tp_size %d: several steps in flight need one rank per pipeline "
                           "stage; one step in flight", STEPS_IN_FLIGHT_ENV, value, place.tp_size)
        return 1
    return int(value) if value else place.stage.pp_size


@dataclass
class LaunchedForward:
    """A step whose stage-0 work is launched and whose logits are not sampled yet."""

    plan: Any  # SchedulerOutput
    batch: Any  # ForwardBatch
    rows: list[tuple[int, int]]
    sampling: list  # (sequence, logits row) of each row that samples
    launched: Any  # the runner's LaunchedStep
    started: float
    num_active: int
    number: int  # 1, 2, ... in launch order
    work: float = 0.0  # its splittable work in weight passes of a stage (StepCost.work)


class PipelinedSteps:
    """The executor's launched, unsampled steps (oldest first) and the step that moves them on."""

    def __init__(self, executor, depth: int, *, always: bool = False):
        self.executor = executor
        self.depth = depth
        self.always = always  # (STEPS_IN_FLIGHT_ENV set) in flight whatever the cost model says
        self.in_flight = always  # steps go in flight now (in_flight_gain's hysteresis)
        # Each step in flight its own sequences, up to a step's batch each
        executor.scheduler.max_running = depth * executor.scheduler.max_batch_size
        self.pending: deque[LaunchedForward] = deque()
        self.calls: list[tuple[str, int]] | None = None  # set to a list: ("launch" | "finish", step number)
        self._launched = 0

    def eligible(self) -> bool:
        """Whether the next step may join the pipeline: no active request needs its tokens on the
        host between steps, and steps in flight pay for the sequences there are (module docstring).
        False with steps launched: the executor drains them, then steps one at a time."""
        ex = self.executor
        if ex._must_sync() or ex._table_request_ids or ex._mrope_request_ids or ex.encoder_stage is not None:
            return False
        if any(state.request.request_type != "context_and_generation"
               or (ex.token_masks is not None and state.request.guided_decoding is not None)
               for state in ex._active.values()):
            return False
        return self.always or self._pays()

    def _pays(self) -> bool:
        """Whether steps in flight beat one step at a time for the sequences that could run now
        (in_flight_gain), with hysteresis: in at ENTER_GAIN, out below LEAVE_GAIN."""
        scheduler, runner = self.executor.scheduler, self.executor.runner
        seqs = len(scheduler.running) + len(scheduler.waiting)
        if seqs > scheduler.max_batch_size:  # more than one step holds: in flight (>= ~1.8x)
            gain = float("inf")
        else:  # (<= max_batch_size sequences: the sums stay cheap)
            tokens = context = largest = 0
            for seq in chain(scheduler.running, scheduler.waiting):
                length = len(seq.token_ids)
                new = max(1, length - seq.num_computed_tokens)  # (launched, unsampled: its next token)
                tokens, context, largest = tokens + new, context + length, max(largest, new)
            gain = in_flight_gain(runner.step_cost, runner.place.stage.pp_size, self.depth, seqs=seqs, tokens=tokens,
                                  context=context, max_batch_size=scheduler.max_batch_size,
                                  max_num_tokens=scheduler.max_num_tokens, largest=largest)
        self.in_flight = gain >= (LEAVE_GAIN if self.in_flight else ENTER_GAIN)
        return self.in_flight

    def step(self, started: float) -> tuple[Any, InFlightStep | None]:
        """Schedule one group and launch it (if any), then, once ``depth - 1`` older steps are
        launched (or nothing new was), sample the oldest. Returns (the plan, the executor's launched
        step: the one sampled now, whose tokens the host reads next iteration, or None)."""
        scheduler = self.executor.scheduler
        # A group's share: the sequences there are, over the steps in flight (at most a step's batch).
        plan = scheduler.schedule(max_seqs=-(-(len(scheduler.running) + len(scheduler.waiting)) // self.depth))
        if not plan.is_empty:
            self._launch(plan, started)
        if self.pending and (plan.is_empty or len(self.pending) >= self.depth):
            return plan, self._sample(self.pending.popleft())
        return plan, None

    def drain(self) -> None:
        """Sample and read every launched step, oldest first (before a one-step iteration)."""
        ex = self.executor
        while self.pending:
            launched = self._sample(self.pending.popleft())
            ex._finish_in_flight()
            ex._in_flight = None if launched is None or launched.failed else launched
        ex._finish_in_flight()

    def drop(self) -> None:
        """The loop failed everything (an internal error): finish the launched steps, results unread, and forget
        them. Finished, not just forgotten: LeaderRunner counts launched, unfinished steps and sends no heartbeat
        while any is (its launch says why), so a step dropped unfinished left the idle workers without heartbeats
        until their plan receive timed out."""
        while self.pending:
            item = self.pending.popleft()
            try:
                self.executor.runner.finish(item.launched)
            except Exception:  # noqa: BLE001  (a failed runner: no later step goes over its transfers)
                logger.debug("finishing a dropped step failed", exc_info=True)

    def _launch(self, plan, started: float) -> None:
        ex = self.executor
        num_active = len(ex._active)
        try:
            batch, rows, sampling, _ = ex._forward_batch(plan)
            ex._mark_last_stage_sampling(batch, sampling, [])
            work = ex.runner.step_cost.work(len(batch.token_ids), batch.context_lens)
            batch.micro_batches = self._micro_batches(work)
            launched = ex.runner.launch(batch)
        except Exception as err:
            ex._fail_step(plan, err, "forward failed")
            return
        self._launched += 1
        self._note("launch", self._launched)
        ex._mark_launched(plan)
        self.pending.append(LaunchedForward(plan, batch, rows, sampling, launched, started, num_active,
                                            self._launched, work))

    def _micro_batches(self, work: float) -> int:
        """A launched step's micro-batches: one while it is about the size of the step launched
        before it (that step fills the pipeline), more for the work it has beyond that. Why: a long
        prompt's step launched next to another group's decode step held each stage in turn for its
        whole length while the other stage idled (the decode step cannot fill that time: its group's
        next step waits for its tokens); cut, its micro-batches flow through the stages as a
        one-step pipeline's do (choose_micro_batches on the excess: 2,048 prompt tokens of the 8B
        shape over a 256-sequence decode step -> 3)."""
        before = self.pending[-1].work if self.pending else 0.0
        pp_size = self.executor.runner.place.stage.pp_size
        return choose_micro_batches(max(0.0, work - before), pp_size, AUTO_MOST_PER_STAGE * pp_size)

    def _sample(self, item: LaunchedForward) -> InFlightStep | None:
        ex = self.executor
        try:
            logits = ex.runner.finish(item.launched)  # (or the token ids the last stage sampled)
            self._note("finish", item.number)
            if item.batch.sample_on_last_stage:
                transfer = ex._store_last_stage_tokens(logits, item.batch)
            else:
                transfer = ex._sample(logits, item.sampling, item.batch) if item.sampling else None
        except Exception as err:
            ex._fail_step(item.plan, err, "forward failed")
            return None
        step = InFlightStep(item.plan, item.rows, None, [], transfer, item.started, item.num_active)
        ex._add_placeholders(step, item.sampling, item.batch)
        return step

    def _note(self, what: str, number: int) -> None:
        if self.calls is not None:
            self.calls.append((what, number))


def make_pipelined_steps(executor, environ=os.environ) -> PipelinedSteps | None:
    """The executor's PipelinedSteps where its runner keeps several steps in flight, else None."""
    depth = steps_in_flight(executor.runner, environ)
    if depth < 2:
        return None
    always = bool(environ.get(STEPS_IN_FLIGHT_ENV, "").strip())
    logger.info("pipeline: up to %d steps in flight%s (%s)", depth, "" if always else " where they pay",
                STEPS_IN_FLIGHT_ENV)
    return PipelinedSteps(executor, depth, always=always)
