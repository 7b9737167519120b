"""StageRunner: one rank of a pipeline-parallel job (its stage's layers, its own KV pool), and the
micro-batched step that moves hidden states from stage to stage.

Every rank receives every step's plan (engine/tensor_parallel: the leader broadcasts it); all
stages share the leader's block tables, each stage's pool holding only its own layers, so a block
costs each rank 1/pp of the bytes and the KV capacity grows with pp. One step runs as micro-batches
(contiguous runs of the step's tokens; how many: ``StageRunner.micro_batch_count``, one for a
decode step of a few sequences, whose stage time is its weight read whatever its size, more for
long prompts and long contexts, engine/pipeline/step_cost.py):

    stage 0 (ranks 0..tp-1)    embed + layers(mb0) -> isend | embed + layers(mb1) -> isend | ...
    stage 1                    recv(mb0) -> layers -> isend | recv(mb1) -> layers -> isend | ...
    last stage                 recv(mb0) -> layers, norm, logits -> isend to rank 0 | ...
    rank 0                     irecv each micro-batch's logits right after its isend; the step's
                               logits, in order -> the sampler

so stage s works on micro-batch m while stage s+1 works on m-1: with M micro-batches the pipeline
idles (pp - 1) / (M + pp - 1) of a step (the fill and drain), rather than (pp - 1) / pp when the
step runs whole. Each tensor-parallel rank of a stage sends to the same tp rank of the next (the
stream is replicated within a stage); the last stage's tp rank 0 sends the logits (float32, the full
vocabulary) to rank 0, which samples, so sampling, penalties, guided decoding and log-probs work
as on one rank. A step whose rows only draw (greedy or seeded draws with temperature, top-k and
top-p, nothing else asked: engine/executor/sampler.py draws_alone) is sampled on the last stage
instead where rank 0 marks it so in the plan (ForwardBatch.sample_on_last_stage and, for draws,
last_stage_draws; ``StageRunner.samples_on_last_stage``): the last stage sends the int64 ids, 8
bytes a row, and rank 0 stores them where its sampler's would go.
Sends are asynchronous; a step's sends are waited on at the rank's next step, after that step's
work is queued (``StageRunner.forward`` says why), and every receive before its
step returns. Plans, heartbeats and CALLs go over the step protocol's own channel and groups, so they
never interleave with activations (with several steps in flight no heartbeat goes out while a step
is unfinished). Over gloo (CPU) and NCCL (GPU) alike; a lost peer raises in the send/recv like any
other collective, and the leader's LeaderRunner turns that into its rank failure.

CUDA graphs per stage: each stage captures its forward (StageStep: embed or the received stream ->
its layers -> the stream to send, or the final-normed hidden states) with the engine's graph
machinery (ModelRunner.capture_cuda_graphs through the ``graph_model`` hook): per batch-size bucket
for decode (engine/executor/cuda_graphs.py DecodeGraphs) and, where the model's mixed-step graphs
are enabled (tp_size 1, model-dtype or FP8 weights), per token bucket for micro-batches with prompt
tokens (engine/executor/prefill_graphs.py PrefillGraphs). A micro-batch that fits a bucket replays
its graph; any other runs eagerly. The send/recv stay OUTSIDE the graphs:
a later stage receives into the graphs' static input (``StageStep.carried[:n]``) and replays; a
stage sends a copy of its graph's output rows. Why outside, though ProcessGroupNCCL can capture
send/recv: a captured send only works if the peer replays the matching captured recv, so every
rank would have to replay the same graph sequence, step after step, with no eager fallback on
either side; the heartbeats and rank-failure detection of the step protocol would also stop
seeing the transfers. Outside, the wire format is the same for graphed and eager micro-batches
((n, 2, hidden) rows, engine/pipeline/stage.py), each rank picks graph or eager alone, and the
graph path runs over gloo in the CPU tests (graphs emulated) as over NCCL. What it costs: one
send and one recv launch from Python per micro-batch and stage boundary (tens of microseconds
against a ~2 ms stage at batch 1 of an 8B model).

Not with pipeline stages (refused by name): LoRA adapters, prompt tables. ``forward`` is
``finish(launch(batch))``: by default each step's micro-batches drain before the next step starts;
with several steps in flight (engine/pipeline/in_flight.py) rank 0 launches the next step before
finishing this one, every step's transfers queued in the same order as here.
"""
from __future__ import annotations

import os
from bisect import bisect_left
from dataclasses import dataclass, field, replace
from itertools import accumulate

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.executor.overlap import resolve_placeholders
from engine.executor.packed_draws import draw_metadata
from engine.executor.runner import ForwardBatch, ModelRunner
from engine.executor.sampler import sample
from engine.pipeline.layout import Stage, stage_of_rank
from engine.pipeline.step_cost import AUTO_MOST_PER_STAGE, StepCost, choose_micro_batches
from engine.pipeline.stage import StageStep, check_pipeline_supported, stage_forward, trim_to_stage
from kernels.sampling import greedy_tokens

# Micro-batches per step, the same on every rank: a number fixes it; unset, each step takes the count
# that makes it soonest done (engine/pipeline/step_cost.py), at most AUTO_MOST_PER_STAGE * pp_size.
MICRO_BATCHES_ENV = "TRITONLLM_PP_MICRO_BATCHES"
# "0": each ``forward`` waits on its own sends before it returns (the behaviour before they were
# deferred to the next step; kept for measurements, StageRunner.forward says why not by default).
DEFER_SEND_WAITS_ENV = "TRITONLLM_PP_DEFER_SEND_WAITS"
# "0": every step's logits go to rank 0, which samples (the behaviour before steps were sampled on the
# last stage; kept for A/B measurements: StageRunner.samples_on_last_stage).
SAMPLE_ON_LAST_STAGE_ENV = "TRITONLLM_PP_SAMPLE_ON_LAST_STAGE"


@dataclass(frozen=True)
class PipelinePlace:
    """Where this rank sits: its global rank, stage and tp rank, and its peers' global ranks."""

    rank: int
    tp_size: int
    stage: Stage

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def prev_rank(self) -> int:
        return self.rank - self.tp_size

    @property
    def next_rank(self) -> int:
        return self.rank + self.tp_size

    @property
    def sends_logits(self) -> bool:
        """The last stage's tp rank 0 sends the logits to rank 0 (unless it is rank 0: pp 1)."""
        return self.stage.is_last and self.tp_rank == 0 and self.rank != 0


@dataclass
class MicroBatch:
    batch: ForwardBatch
    logits_rows: list[int]   # rows of the step's logits this micro-batch's logits fill, in order


def fixed_micro_batches(environ=os.environ) -> int | None:
    """The fixed micro-batch count of ``MICRO_BATCHES_ENV``, or None: chosen per step."""
    value = environ.get(MICRO_BATCHES_ENV, "")
    return max(1, int(value)) if value else None


def split_micro_batches(batch: ForwardBatch, count: int, *, all_logits: bool = False) -> list[MicroBatch]:
    """The step's tokens in ``count`` contiguous runs of equal size (+-1; at most one per token).

    A run boundary inside a sequence cuts it in two pieces, like chunked prefill within the step:
    the first piece's context ends where it ends, the second continues it. A stage runs its
    micro-batches in order, so the later piece's attention reads the KV the earlier one wrote in
    that stage, and one long prompt fills the pipeline too. Each piece keeps its sequence's whole
    block table (context_lens bound what is read). ``logits_indices`` are rebased to the
    micro-batch's tokens and ``logits_rows`` says where its logits go in the step's (all_logits:
    its token rows). Deterministic: every rank splits the same plan alike."""
    total = len(batch.token_ids)
    count = max(1, min(count, total))
    if count == 1:  # the whole step, as most decode steps run: nothing to cut (~1 ms of Python at 256 sequences)
        rows = list(range(total)) if all_logits else list(range(len(batch.logits_indices)))
        return [MicroBatch(replace(batch, sampled_tokens_slot=-1), rows)]
    cuts = [total * part // count for part in range(count + 1)]  # strictly increasing: count <= total
    seq_starts = [0, *accumulate(batch.seq_lens_q)]
    out = []
    first_seq = 0  # the first sequence that ends after the run's start
    for start, end in zip(cuts, cuts[1:]):
        seq_lens, context_lens, tables, lora = [], [], [], []
        while seq_starts[first_seq + 1] <= start:
            first_seq += 1
        for i in range(first_seq, bisect_left(seq_starts, end)):  # the sequences with tokens in [start, end)
            first, last = max(start, seq_starts[i]), min(end, seq_starts[i + 1])
            if first >= last:
                continue
            seq_lens.append(last - first)
            context_lens.append(batch.context_lens[i] - (seq_starts[i + 1] - last))
            tables.append(batch.block_tables[i])
            if batch.lora_slots is not None:
                lora.append(batch.lora_slots[i])
        rows = [row for row, index in enumerate(batch.logits_indices) if start <= index < end]
        part = replace(
            batch, token_ids=batch.token_ids[start:end], positions=batch.positions[start:end],
            seq_lens_q=seq_lens, context_lens=context_lens, block_tables=tables,
            logits_indices=[batch.logits_indices[row] - start for row in rows], sampled_tokens_slot=-1,
            lora_slots=None if batch.lora_slots is None else lora)
        out.append(MicroBatch(part, list(range(start, end)) if all_logits else rows))
    return out


@dataclass
class LaunchedStep:
    """A step launched on this stage (StageRunner.launch), its transfers not waited on yet."""

    # rank 0: what ``receives`` fill: the step's float32 logits (rows, vocab), or where the step is
    # sampled on the last stage (ForwardBatch.sample_on_last_stage) its int64 greedy token ids (rows,)
    received: torch.Tensor | None
    sends: list = field(default_factory=list)  # (work, tensor): tensors kept alive until their sends complete
    receives: list = field(default_factory=list)  # rank 0: (work, staging tensor or None, its rows)


class StageRunner(ModelRunner):
    """ModelRunner for one pipeline stage (module docstring). ``forward`` returns the step's logits
    on rank 0 and None on every other rank."""

    def __init__(self, engine_dir: str, *, rank: int, device, tp_group=None, config: EngineConfig | None = None,
                 logits_group=None):
        config = config or EngineConfig.load(engine_dir)
        # The logits' way back to rank 0: a process group of its own (make_stage_runner), or None: the world's
        self.logits_group = logits_group
        check_pipeline_supported(config.model)
        stage, tp_rank = stage_of_rank(config.model, config.build, rank)
        self.place = PipelinePlace(rank, config.build.tp_size, stage)
        self.micro_batches = fixed_micro_batches()
        self.step_cost = StepCost.for_engine(config)
        self._graph_model: StageStep | None = None
        self._unwaited_sends: list = []  # (work, tensor) of the last ``forward``'s sends (``forward`` says why)
        self._defer_send_waits = os.environ.get(DEFER_SEND_WAITS_ENV, "1") != "0"
        self._sample_on_last_stage = os.environ.get(SAMPLE_ON_LAST_STAGE_ENV, "1") != "0"
        super().__init__(engine_dir, rank=tp_rank, device=device, tp_group=tp_group)

    # -- the ModelRunner hooks

    @property
    def weights_rank(self) -> int:
        return self.place.rank

    def shape_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return trim_to_stage(model, self.place.stage)

    @property
    def kv_layers(self) -> int:
        return self.place.stage.num_layers

    @property
    def graph_model(self) -> StageStep:
        """The stage's decode forward with its static input stream, made once (its buffer's
        address is captured)."""
        if self._graph_model is None:
            build = self.build_config  # (rows: the largest decode bucket, or prefill bucket where those are captured)
            rows = max(build.max_batch_size, build.max_num_tokens if self.prefill_graphs_enabled() else 0)
            self._graph_model = StageStep(self.model, self.place.stage, max_rows=rows, dtype=self.dtype,
                                          device=self.device)
        return self._graph_model

    # -- what a stage does not do (yet)

    def enable_lora(self, num_slots: int, max_rank: int) -> None:
        raise ValueError("LoRA adapters are not supported with pipeline parallelism (pp_size > 1) yet; "
                         "build the engine with --pp_size 1 (tensor parallelism serves adapters)")

    def warmup(self) -> None:
        """The warm-up batch runs a whole model; a stage's kernels compile on its first step."""

    @property
    def samples_on_last_stage(self) -> bool:
        """Whether rank 0 may mark a step whose rows only draw for sampling on the last stage
        (ForwardBatch.sample_on_last_stage): the last stage's tp rank 0 then samples the logits it
        computed (``_last_stage_tokens``) and sends rank 0 the (rows,) int64 ids, 8 bytes a row
        instead of the vocabulary's float32 logits (131 MB a step at 256 rows of Llama-3.1-8B, ~0.5 ms
        of a 6.0 ms PP 2 decode step on two H200s). Exact: the functions rank 0's sampler would run,
        on the same float32 logits with the same settings. Off with SAMPLE_ON_LAST_STAGE_ENV=0."""
        return self._sample_on_last_stage and self.place.stage.pp_size > 1

    # -- the step

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, *, all_logits: bool = False, prompt_embeds=None) -> torch.Tensor | None:
        """One step: ``launch``, then ``finish`` but for this step's sends, which are waited on at
        the next step's forward, once its own work is queued. Why: on NCCL waiting on a send makes
        the stream wait until the peer has the data, so the last stage would start its next step
        only after its logits arrived at rank 0 (float32, the whole vocabulary: 131 MB at 256 rows of
        Llama-3.1-8B, ~0.4 ms over NVLink) and idle that long every step; a stage before it would wait
        for its hidden states to arrive. Their receivers are posted independently (rank 0's logits
        receive at its launch, the next stage's receive at its own), so nothing waits on this wait; the
        sent tensors stay referenced until it. Rank 0 with several steps in flight calls launch and
        finish itself (engine/pipeline/in_flight.py): its sends are waited on a step later anyway."""
        launched = self.launch(batch, all_logits=all_logits, prompt_embeds=prompt_embeds)
        if not self._defer_send_waits:
            return self.finish(launched)
        sends, launched.sends = launched.sends, []
        self.wait_sends()  # the previous step's, behind this step's queued work
        self._unwaited_sends = sends
        return self.finish(launched)

    def wait_sends(self) -> None:
        """Wait for the last ``forward``'s deferred sends. Call it before dropping a runner whose
        peers still receive that step: on gloo an isend's buffer is held only by its work object,
        and a send whose work is freed before the peer's receive matched it is dropped (the peer
        then waits forever)."""
        for work, _ in self._unwaited_sends:
            work.wait()
        self._unwaited_sends = []

    @torch.inference_mode()
    def launch(self, batch: ForwardBatch, *, all_logits: bool = False, prompt_embeds=None) -> "LaunchedStep":
        """The step's work on this stage, its sends queued and, on rank 0, every micro-batch's
        logits receive posted (in the last stage's order: each right after its micro-batch's send);
        nothing waited on. ``finish`` completes it. Rank 0 launches the next step before finishing
        this one where several steps are in flight (engine/pipeline/in_flight.py): its stage-0
        compute then queues ahead of this step's sampling."""
        if prompt_embeds is not None:
            raise ValueError("prompt tables (prompt_embedding_table, image inputs) are not supported with pipeline "
                             "parallelism (pp_size > 1) yet")
        if self.kv_cache is None:
            raise RuntimeError("allocate_kv_cache() must run before forward()")
        place, stage = self.place, self.place.stage
        parts = split_micro_batches(batch, self.micro_batch_count(batch), all_logits=all_logits)
        graphed = [None if all_logits else self._graph_kind(part.batch) for part in parts]
        # may raise ValueError: before any send
        prepared = [None if replay else self._prepare(part.batch) for part, replay in zip(parts, graphed)]
        ids_only = bool(batch.sample_on_last_stage) and not all_logits
        launched = LaunchedStep(self._receive_buffer(parts, ids_only) if place.rank == 0 else None)
        for part, replay, inputs in zip(parts, graphed, prepared):
            rows = len(part.batch.token_ids)
            if replay:
                out = self._replay(part.batch, replay)
            else:
                out = self._eager(inputs, rows)
            if not stage.is_last:
                # A decode graph's output is overwritten by the next replay while an NCCL send may still
                # read it (the send's stream waits for this one, not the other way round): send a copy.
                # (A prefill graph's rows are gathered into a tensor of their own already.)
                out = out.clone() if replay == "decode" else out.contiguous()
                launched.sends.append((dist.isend(out, dst=place.next_rank), out))
                if launched.received is not None and part.logits_rows:
                    launched.receives.append(self._post_logits_receive(launched.received, part))
                continue
            scored = replay == "prefill" or (replay == "decode" and part.batch.logits_indices == list(range(rows)))
            if not all_logits and not scored:  # (a prefill graph returns the scored rows itself)
                out = out[self._to_device(part.batch.logits_indices, torch.int64)]
            logits = self.model.compute_logits(out)  # a collective within the stage's tp group
            if place.sends_logits and logits.shape[0]:
                # sampled here: rank 0 gets the ids its own sampler would have drawn from these logits
                logits = self._last_stage_tokens(logits, batch, part) if ids_only else logits.contiguous()
                launched.sends.append((dist.isend(logits, dst=0, group=self.logits_group), logits))
        return launched

    def finish(self, launched: "LaunchedStep") -> torch.Tensor | None:
        """Wait for a launched step's transfers (on CUDA: the current stream waits, the host does
        not); on rank 0 the step's logits, or its (rows,) int64 token ids where the step was sampled
        on the last stage (``batch.sample_on_last_stage``); None elsewhere."""
        for work, staging, rows in launched.receives:
            work.wait()
            if staging is not None:
                launched.received[self._to_device(rows, torch.int64)] = staging
        for work, _ in launched.sends:
            work.wait()
        return launched.received

    def _last_stage_tokens(self, logits: torch.Tensor, batch: ForwardBatch, part: MicroBatch) -> torch.Tensor:
        """A micro-batch's tokens as rank 0's sampler would draw them (Executor._sample): greedy rows
        alone, ``greedy_tokens`` (sample's all-greedy path); else ``sample`` with the rows' settings
        from the plan (engine/executor/packed_draws.py: as rank 0 would build them for the step)."""
        if batch.last_stage_draws is None:
            return greedy_tokens(logits)
        return sample(logits, draw_metadata(batch.last_stage_draws, part.logits_rows, self.vocab_size,
                                            self.device)).token_ids

    def micro_batch_count(self, batch: ForwardBatch) -> int:
        if self.micro_batches is not None:
            return self.micro_batches
        if batch.micro_batches:  # the leader's choice, in the plan (several steps in flight: one)
            return batch.micro_batches
        pp_size = self.place.stage.pp_size
        work = self.step_cost.work(len(batch.token_ids), batch.context_lens)
        return choose_micro_batches(work, pp_size, AUTO_MOST_PER_STAGE * pp_size)

    def _graph_kind(self, batch: ForwardBatch) -> str | None:
        """"decode" or "prefill" where a captured graph takes this micro-batch, else None (eager)."""
        if self.decode_graphs is not None and self.decode_graphs.fits(batch):
            return "decode"
        if self.prefill_graphs is not None and self.prefill_graphs.fits(self._stage_rows(batch)):
            return "prefill"
        return None

    def _stage_rows(self, batch: ForwardBatch) -> ForwardBatch:
        """The rows a stage's forward hands on: every token's before the last stage, the scored ones on it."""
        return batch if self.place.stage.is_last else replace(batch, logits_indices=list(range(len(batch.token_ids))))

    def _replay(self, batch: ForwardBatch, kind: str) -> torch.Tensor:
        """A micro-batch through its bucket's graph: a later stage first receives its stream into the
        graphs' static input. Decode: the graph's output rows, a view the next replay overwrites,
        (n, 2, hidden) or on the last stage (n, hidden) final-normed. Prefill: every token's stream
        (n, 2, hidden), or on the last stage the scored rows (len(logits_indices), hidden)."""
        if not self.place.stage.is_first:
            dist.recv(self.graph_model.carried[:len(batch.token_ids)], src=self.place.prev_rank)
        if kind == "prefill":
            return self.prefill_graphs.try_run(self._stage_rows(batch))
        return self.decode_graphs.run(batch.token_ids, batch.positions, batch.context_lens, batch.block_tables)

    def _eager(self, inputs: tuple, rows: int) -> torch.Tensor:
        input_ids, positions, meta = inputs
        carried = None
        if self.place.stage.is_first:
            input_ids = resolve_placeholders(input_ids, self.sampled_tokens)
        else:
            carried = torch.empty(rows, 2, self.model_config.hidden_size, dtype=self.dtype, device=self.device)
            dist.recv(carried, src=self.place.prev_rank)
        return stage_forward(self.model, self.place.stage, input_ids, carried, positions, self.kv_cache, meta)

    def _receive_buffer(self, parts: list[MicroBatch], ids_only: bool) -> torch.Tensor:
        """Rank 0: the step's float32 logits (or, ``ids_only``, its int64 token ids sampled on the
        last stage), every micro-batch's rows in step order."""
        rows = sum(len(part.logits_rows) for part in parts)
        if ids_only:
            return torch.empty(rows, dtype=torch.int64, device=self.device)
        return torch.empty(rows, self.vocab_size, dtype=torch.float32, device=self.device)

    def _post_logits_receive(self, received: torch.Tensor, part: MicroBatch) -> tuple:
        """Rank 0: post the receive of one micro-batch's logits (or token ids sampled on the last
        stage: ``received`` is then (rows,) int64) from the last stage's tp rank 0,
        right after sending that micro-batch on. The receives so interleave with the sends in the
        order the last stage works (receive micro-batch m, send its logits, receive m + 1): at pp 2
        the same NCCL communicator and stream carry both directions between rank 0 and the last
        stage, and had rank 0 queued every send before its first receive, a send larger than NCCL's
        buffers (a long prompt's micro-batch) would wait for a peer itself blocked sending the
        previous micro-batch's logits (a step whose first micro-batch has many decode rows). (With
        make_stage_runner's logits group the logits have a communicator of their own; the order
        is kept, and still holds where that group is not made.)
        Returns (work, staging tensor or None, the rows it fills)."""
        source = (self.place.stage.pp_size - 1) * self.place.tp_size
        first, count = part.logits_rows[0], len(part.logits_rows)
        if part.logits_rows == list(range(first, first + count)):  # (always, for sorted rows)
            # a contiguous span of rows
            return dist.irecv(received[first:first + count], src=source, group=self.logits_group), None, None
        staging = torch.empty(count, *received.shape[1:], dtype=received.dtype, device=self.device)
        return dist.irecv(staging, src=source, group=self.logits_group), staging, part.logits_rows


def make_stage_runner(engine_dir: str, ctx, config: EngineConfig) -> StageRunner:
    """This rank's StageRunner inside a job whose world is tp_size x pp_size ranks. Collective:
    every rank creates every stage's tensor-parallel group, in stage order (torch.distributed's
    rule for new_group), and gives its model its own stage's (None at tp_size 1); then the logits
    group (rank 0 and the last stage's tp rank 0).

    Why the logits have a group of their own: on NCCL a communicator's point-to-point calls run in
    order on one stream per rank. At pp 2 rank 0 and the last stage share one for the stream of
    hidden states and the logits, so the last stage's receive of step n+1's hidden states queued
    behind the send of step n's logits (float32, the whole vocabulary: 131 MB at 256 rows of
    Llama-3.1-8B, ~0.4 ms over NVLink) and its GPU idled that long every step, with steps in
    flight too. Apart, the logits go while the stage already computes the next step."""
    tp_size, pp_size = config.build.tp_size, config.build.pp_size
    tp_group = None
    if tp_size > 1:
        for stage in range(pp_size):
            group = dist.new_group(ranks=list(range(stage * tp_size, (stage + 1) * tp_size)))
            if stage == ctx.rank // tp_size:
                tp_group = group
    logits_group = dist.new_group(ranks=[0, (pp_size - 1) * tp_size])
    return StageRunner(engine_dir, rank=ctx.rank, device=ctx.device, tp_group=tp_group, config=config,
                       logits_group=logits_group if ctx.rank in (0, (pp_size - 1) * tp_size) else None)
