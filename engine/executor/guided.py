"""Guided decoding: per-request grammars (xgrammar) that decide which tokens each step may produce.

Two parts, both owned by the executor:

``GrammarCache`` compiles a request's guide (JSON, JSON schema, regex, EBNF grammar, structural
tag) into an xgrammar ``CompiledGrammar`` on a small thread pool, so that a slow schema never
stalls the executor loop: the request waits in the queue for its own grammar only. Compiled
grammars are kept in an LRU keyed by (guide type, guide text); concurrent requests for the same
guide share one compilation. The tokenizer and the xgrammar vocabulary are loaded on that pool
too, when the first guide arrives: an engine that never sees one never imports xgrammar (with
transformers: ~1.4 CPU-s and ~100 MiB per engine process, on every start). The price: the first
guided request waits for that load (about a second on a CPU host) besides its own compilation;
the executor's loop and every other request never wait for it.

``TokenMasks`` builds, for the constrained rows of one step, a token bitmask on the host from each
sequence's ``GrammarMatcher`` (one per sequence, so ``n`` > 1 works) and moves it to the device,
where ``kernels.grammar_mask`` sets every disallowed logit to -inf before sampling.

Overlapped scheduling and masks (engine/executor/overlap.py). A step's mask needs the matcher to
have accepted the previous step's token, which the host learns only after launching the next
step. The executor therefore splits a step with constrained rows in two: it launches the forward
(the GPU's long part), then waits for the previous step's tokens, lets the matchers accept them,
fills this step's mask and launches the sampling. Mask building overlaps the forward instead of
stalling the GPU, and unconstrained requests keep the overlapped loop unchanged. The previous
step's responses go out after the next step's forward is launched, so that what stands between
the previous step's tokens and the next forward's launch is only: accepting the tokens, filling
the masks, sampling, scheduling and packing. The GPU idles only when that takes longer than a
forward (H100, 8B model, 64 streams: ~5 of ~7 ms; benchmarks/results/features.md, guided decoding).
"""
from __future__ import annotations

import os
import queue
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future
from typing import Any

import torch

from engine.executor.request import GuidedDecodingParams, Sequence

BITS_PER_WORD = 32  # xgrammar's bitmask: int32 words, bit j of word w allows token 32 * w + j
# From this many constrained rows a step fills its masks on xgrammar's thread pool (~0.25 ms of
# fixed cost on a 16-core H100 host); below, one matcher after another. A row's fill costs from
# a few us (a valid document's states) to ~100 us (a random-weight model's states, inside long
# strings) on that host, so the pool decides a step's time at any batch worth the name: at 64
# streams the loop took 7 ms per step and doubled it (benchmarks/results/features.md, guided decoding).
BATCH_FILL_MIN_ROWS = 4
# The pool's threads. Few: the fill runs beside the executor's own thread, the response path and
# (in leader mode) the other ranks' processes. H100 host (16 cores), 8B model, 64 constrained
# streams: 4 threads kept 0.99x the unconstrained throughput, while xgrammar's default (half the
# cores, 8) and 14 stalled the loop behind the pool (steps of 100-800 ms; 0.83x). Override with
# TRITONLLM_GRAMMAR_FILL_THREADS.
FILL_THREADS = int(os.environ.get("TRITONLLM_GRAMMAR_FILL_THREADS", "0")) or max(1, min(4, (os.cpu_count() or 2) // 2))


class GuideError(ValueError):
    """A guide that does not compile; the message names the input, the guide type and the cause."""


def _load_vocabulary(tokenizer_dir: str, vocab_size: int):
    """xgrammar's view of the tokenizer, padded to the model's logits width ``vocab_size``."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=True)
    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)


class _DaemonPool:
    """A few daemon worker threads. Unlike ThreadPoolExecutor's workers, which the interpreter joins
    at exit, these never hold up the engine process's exit behind a tokenizer load or a long
    compilation."""

    def __init__(self, threads: int, name: str):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        for index in range(threads):
            threading.Thread(target=self._work, name=f"{name}-{index}", daemon=True).start()
        self._threads = threads

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        self._jobs.put((future, fn, args))
        return future

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as err:  # the future carries it to the waiting request
                    future.set_exception(err)

    def shutdown(self) -> None:
        for _ in range(self._threads):
            self._jobs.put(None)


class GrammarCache:
    """Compiles guides off the executor loop; an LRU of compiled grammars keyed by (type, text)."""

    def __init__(self, tokenizer_dir: str, vocab_size: int, capacity: int = 512, threads: int = 2):
        self.capacity = capacity
        self._lock = threading.Lock()
        self._compiled: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._pending: dict[tuple[str, str], Future] = {}
        self._pool = _DaemonPool(threads, "grammar-compile")
        self._vocabulary = (tokenizer_dir, vocab_size)
        # Submitted by the first compile(), before its compilation, which waits for it on the pool.
        self._compiler: Future | None = None
        self.compile_seconds: list[float] = []  # cold compilations, in order (benchmarks read them)

    @staticmethod
    def _make_compiler(tokenizer_dir: str, vocab_size: int):
        import xgrammar as xgr

        info = _load_vocabulary(tokenizer_dir, vocab_size)
        # Our own LRU decides what stays; xgrammar's cache would hold everything ever compiled.
        return xgr.GrammarCompiler(info, max_threads=4, cache_enabled=False)

    def compile(self, guide: GuidedDecodingParams) -> Future:
        """A future of the guide's CompiledGrammar (done at once when cached); it fails with GuideError."""
        key = (guide.guide_type, guide.guide or "")
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
                future: Future = Future()
                future.set_result(compiled)
                return future
            future = self._pending.get(key)
            if future is None:
                if self._compiler is None:
                    self._compiler = self._pool.submit(self._make_compiler, *self._vocabulary)
                future = self._pool.submit(self._compile, key)
                self._pending[key] = future
            return future

    def _compile(self, key: tuple[str, str]):
        started = time.perf_counter()
        try:
            compiled = _compile_guide(self._compiler.result(), *key)
        except BaseException:
            with self._lock:
                self._pending.pop(key, None)  # not cached: the next request with it tries again
            raise
        self.compile_seconds.append(time.perf_counter() - started)
        with self._lock:  # cached before it stops being pending: no second compilation in between
            self._compiled[key] = compiled
            self._pending.pop(key, None)
            while len(self._compiled) > self.capacity:
                self._compiled.popitem(last=False)
        return compiled

    def shutdown(self) -> None:
        self._pool.shutdown()


def _compile_guide(compiler, guide_type: str, guide: str):
    """xgrammar's compile call for one guide type; its errors become GuideError naming the input."""
    try:
        # Compact separators throughout: a free-whitespace grammar lets small models pad with
        # newlines until max_tokens.
        if guide_type == "json":  # the guide, if any, is not read (the reference's rule)
            # An object or an array at the top, as xgrammar's built-in JSON grammar (which TRT-LLM
            # compiles for this type) has it; a bare number or string could run on to max_tokens.
            return compiler.compile_json_schema('{"type": ["object", "array"]}', any_whitespace=False,
                                                strict_mode=False)
        if guide_type == "json_schema":  # strict_mode: nothing beyond the schema's properties (OpenAI's strict)
            return compiler.compile_json_schema(guide, any_whitespace=False, strict_mode=True)
        if guide_type == "regex":
            return compiler.compile_regex(guide)
        if guide_type == "ebnf_grammar":
            return compiler.compile_grammar(guide)
        if guide_type == "structural_tag":
            return compiler.compile_structural_tag(guide)
    except Exception as err:  # xgrammar raises RuntimeError, ValueError and its own types
        detail = " ".join(str(err).split())[:500] or type(err).__name__
        raise GuideError(f"guided_decoding_guide: invalid {guide_type} guide: {detail}") from None
    raise GuideError(f"guided_decoding_guide_type value of '{guide_type}' is not supported")


def make_matcher(compiled, end_id: int | None):
    """A matcher for one sequence. It ends on the request's end_id (the executor's notion of the
    end); a request without one ends when the grammar is complete (``is_terminated``)."""
    import xgrammar as xgr

    if end_id is None:
        return xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return xgr.GrammarMatcher(compiled, override_stop_tokens=[end_id])


class TokenMasks:
    """Builds one step's token bitmask for its constrained rows and puts it on the device.

    ``fill(seqs)`` -> (bitmask (k, words) int32 on the device, rows (B,) int64 on the device: the
    bitmask row of each logits row, -1 for unconstrained ones; None when every row is constrained,
    row b then taking bitmask row b), or None when no row is constrained.
    Host buffers are pinned (CUDA) and alternate between two halves, one per step parity, so a
    buffer is never rewritten while its copy to the device may still be queued.
    """

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device):
        self.device = device
        self.words = -(-vocab_size // BITS_PER_WORD)
        pin = device.type == "cuda"
        self._host = [torch.empty((max_rows, self.words), dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self._rows = [torch.empty(max_rows, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._parity = 0
        # xgrammar's BatchGrammarMatcher, made at the first batched fill: by then the pool has
        # imported xgrammar for the grammar, and an engine that never sees a guide never imports it.
        self._batch = None
        self.fill_seconds = 0.0  # host time spent filling masks (benchmarks read it)
        self.rows_filled = 0
        self.recent_fills: deque[tuple[int, float]] = deque(maxlen=4096)  # (rows, seconds) per step

    def fill(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        matchers, rows = [], []
        for row, seq in enumerate(seqs):
            grammar = seq.grammar
            if grammar is not None and not seq.is_finished and not grammar.is_terminated():
                matchers.append(grammar)
                rows.append(row)
        if not matchers:
            return None
        started = time.perf_counter()
        host = self._host[self._parity][:len(matchers)]
        row_index = None
        if len(rows) < len(seqs):  # else row b takes bitmask row b
            index = [-1] * len(seqs)
            for k, row in enumerate(rows):
                index[row] = k
            row_index = self._rows[self._parity][:len(seqs)]
            row_index.copy_(torch.tensor(index, dtype=torch.int64))
        self._parity ^= 1
        if len(matchers) >= BATCH_FILL_MIN_ROWS:
            if self._batch is None:
                import xgrammar as xgr

                self._batch = xgr.BatchGrammarMatcher(max_threads=FILL_THREADS)
            self._batch.batch_fill_next_token_bitmask(matchers, host)
        else:
            for k, matcher in enumerate(matchers):
                matcher.fill_next_token_bitmask(host, k)
        for k, row in enumerate(rows):
            if seqs[row].state.request.sampling.min_tokens:
                self._hold_back_end(seqs[row], host[k])
        elapsed = time.perf_counter() - started
        self.fill_seconds += elapsed
        self.rows_filled += len(matchers)
        self.recent_fills.append((len(matchers), elapsed))
        copy = (lambda t: t.clone()) if self.device.type != "cuda" else (
            lambda t: t.to(self.device, non_blocking=True))
        return copy(host), None if row_index is None else copy(row_index)

    @staticmethod
    def _hold_back_end(seq: Sequence, mask_row: torch.Tensor) -> None:
        """Before min_tokens the end token is not allowed, unless the grammar allows nothing else
        (a complete JSON value cannot grow): the output must conform, min_tokens yields."""
        request = seq.state.request
        end_id = request.end_id
        if end_id is None or seq.num_generated_tokens >= (request.sampling.min_tokens or 0):
            return
        word, bit = divmod(end_id, BITS_PER_WORD)
        before = int(mask_row[word])
        mask_row[word] = before & ~(1 << bit) if bit < 31 else before & 0x7FFFFFFF
        if not bool(mask_row.any()):
            mask_row[word] = before
