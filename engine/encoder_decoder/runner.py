"""EncDecRunner: a ModelRunner whose model is an encoder-decoder's decoder, plus its encoder and cross-KV pool.

The decoder steps are the executor's ordinary packed steps (paged self-attention KV, in-flight
batching); what differs:

- ``encode_into``: a batch of requests' encoder inputs runs through the encoder once, and every
  decoder layer's cross K/V of each output is written into the request's blocks of the cross pool;
- ``forward``: a step's ``ForwardBatch.cross_block_tables`` / ``cross_lengths`` (each scheduled
  sequence's cross blocks and encoder length) say where each new token's cross K/V is;
- the KV memory is split: ``cross_kv_cache_fraction`` f of it (default 0.5) is the cross pool,
  the rest the self-attention pool. Without device memory to size from (CPU) or with
  max_tokens_in_paged_kv_cache, the self pool is sized as for any engine and the cross pool
  f / (1 - f) times it, never less than one longest encoder input.

Cross and self blocks have the same shape (decoder layers x 2 x tokens_per_block x heads x
head_dim). Their element type: with an FP8 KV cache (the executor's ``kv_cache_dtype fp8`` or the
build's ``--kv_cache_dtype fp8``) both pools are E4M3 with scale 1, as the self pool of any engine
(kernels/attention.py ``to_cache_dtype``); ``cross_kv_cache_dtype fp8`` makes the cross pool E4M3
whatever the self pool's type (engine/encoder_decoder/cross_kv.py; the fraction f is then of the
bytes: an FP8 cross pool holds twice the blocks). ``encode_into`` casts the cross K/V once when it
writes them, and every decode step's cross-attention reads half the bytes through the same
FP8-aware paged kernels (the cross K/V read is most of a large batch's step: docs/features/encoder-decoder.md). On CUDA, decode-only steps replay CUDA graphs per batch bucket
(engine/encoder_decoder/decode_graphs.py; $TRITONLLM_ENCDEC_GRAPHS=0 keeps them eager), after the
skinny-GEMM kernel is chosen per decoder weight shape; steps with prompt tokens run eagerly.

Tensor parallelism (an engine built with tp_size > 1: model.py's module docstring says what each rank
holds): each rank loads its rank{r}.safetensors of both stacks and holds a cross pool of its heads / tp
heads (``kv_pool_shape``: the self pool's shape). In leader mode (engine/tensor_parallel/distributed.py)
``encode_into`` is mirrored on every rank (each runs the encoder over the same inputs, its all-reduces
keeping them in step, and projects its heads' cross K/V into its own pool; Whisper's log-mel features
go to the workers by one broadcast over the tp group, NCCL on GPUs, and only their shapes in the plan:
``call_for_workers``, ``FeatureShapes``. 64 30-s clips of 128 mels are 98 MB, past the shared-memory
plan segment's 8 MB: pickled over gloo instead); the cross-pool settings the
leader's executor was given reach the workers through ``worker_settings`` / ``apply_worker_settings``
(make_runner), and the ranks agree on the cross pool's block count (the minimum). An FP8 engine (build ``quantization`` "fp8": model.py Fp8Linear) loads both stacks' layer linears
in E4M3 with their scales; its decode steps run the skinny W8A8 kernel with the tilings timed at load
(kernels/fp8.py choose_fp8_skinny_variants). A config-only engine (``extra.random_weights_seed``, benchmarks) gets random weights
made on the device (engine/executor/random_weights.py).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed

from engine.config import EngineFormatError
from engine.encoder_decoder.convert import check_complete
from engine.encoder_decoder.cross_kv import cross_pool_dtype, fuse_cross_kv, project_into_pool, require_fp8
from engine.encoder_decoder.decode_graphs import EncDecDecodeGraphs
from engine.encoder_decoder.model import (CrossAttentionBatch, Decoder, Encoder, Fp8Linear, TensorParallel,
                                          cross_metadata, fuse_gated_mlps, fuse_self_attention_qkv)
from engine.encoder_decoder.spec import EncDecSpec
from engine.executor.overlap import resolve_placeholders
from engine.executor.random_weights import has_random_weights, materialize_random_weights
from engine.executor.cuda_graphs import default_buckets
from engine.executor.runner import (ForwardBatch, ModelRunner, deferred_scaling_choice, keep_or_cast,
                                    load_rank_weights)
from kernels.attention import KV_FP8_DTYPE
from kernels.fp8 import FP8_DTYPE, choose_fp8_skinny_variants
from kernels.linear import choose_activated_weights, choose_skinny_weights
from kernels.wide_rows import choose_wide_variants, wide_row_counts

DEFAULT_CROSS_KV_FRACTION = 0.5
GRAPHS_ENV = "TRITONLLM_ENCDEC_GRAPHS"  # "0": decode steps run eagerly on CUDA too


def encoder_engine_dir(decoder_dir: str, extra: dict, override: str | None = None) -> str:
    """Where the encoder engine is: ``override`` (the encoder_engine_dir parameter), else the path the
    decoder's config.json names (relative to the decoder directory)."""
    path = override or os.path.join(decoder_dir, extra.get("encoder_engine_dir", "../encoder"))
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise EngineFormatError(f"encoder engine directory {path!r} has no config.json; build the checkpoint with "
                                "python -m engine.build (it writes encoder/ and decoder/) and point "
                                "encoder_engine_dir at its encoder/")
    return os.path.normpath(path)


@dataclass(frozen=True)
class FeatureShapes:
    """A worker's encode_into inputs in leader mode: the shapes of the features rank 0 broadcasts."""

    shapes: tuple[tuple[int, ...], ...]


class EncDecRunner(ModelRunner):
    def __init__(self, engine_dir: str, *, rank: int = 0, device="cpu", tp_group=None,
                 encoder_engine_dir: str | None = None, cross_kv_cache_fraction: float | None = None,
                 cross_kv_cache_dtype: str | None = None):
        self._encoder_dir_override = encoder_engine_dir
        self.cross_kv_fraction = cross_kv_cache_fraction or DEFAULT_CROSS_KV_FRACTION
        self.cross_kv_cache_dtype = cross_kv_cache_dtype  # None/"auto": the self pool's type (cross_kv.py)
        self.cross_pool: torch.Tensor | None = None
        self.num_cross_blocks = 0
        self.tp_group = tp_group
        super().__init__(engine_dir, rank=rank, device=device, tp_group=tp_group)

    def _load_model(self, engine_dir: str, tp_group) -> torch.nn.Module:
        extra = self.engine_config.extra
        if extra.get("stack") != "decoder" or "encoder_decoder" not in extra:
            raise EngineFormatError(f"{engine_dir!r} is not the decoder of an encoder-decoder engine "
                                    "(config.json extra.stack must be 'decoder')")
        self.spec = EncDecSpec.from_dict(extra["encoder_decoder"])
        self.max_encoder_input_len = int(extra["max_encoder_input_len"])
        self.encoder_dir = encoder_engine_dir(engine_dir, extra, self._encoder_dir_override)
        self.tp = TensorParallel(self.build_config.tp_size, self.rank, tp_group)
        self.encoder = self._load_stack(Encoder, self.encoder_dir)
        return fuse_self_attention_qkv(fuse_cross_kv(self._load_stack(Decoder, engine_dir)))

    def _load_stack(self, cls, directory: str) -> torch.nn.Module:
        module = cls(self.spec, dtype=self.dtype, device="meta", quantization=self.build_config.quantization,
                     tp=self.tp)
        extra = self.engine_config.extra
        if has_random_weights(extra):  # a config-only benchmark engine: seed for the decoder, + 1 the encoder
            seed = extra["random_weights_seed"] + (cls is Encoder) + 2 * self.rank
            return fuse_gated_mlps(materialize_random_weights(module, self.device, seed).eval())
        weights = load_rank_weights(directory, self.rank, self.device)
        try:
            check_complete(module, weights, f"rank{self.rank}.safetensors in {directory!r}")
        except ValueError as err:
            raise EngineFormatError(str(err)) from None
        module.load_state_dict({k: keep_or_cast(k, v, self.dtype) for k, v in weights.items()}, assign=True)
        return fuse_gated_mlps(module.eval())

    # ---- leader mode: what every rank must share --------------------------------------------------

    def worker_settings(self) -> dict:
        """The executor's cross-pool settings this (the leader's) runner was built with, for the workers'
        (``apply_worker_settings``; engine/tensor_parallel/distributed.py make_runner sends them)."""
        return {"cross_kv_cache_fraction": self.cross_kv_fraction, "cross_kv_cache_dtype": self.cross_kv_cache_dtype,
                "encoder_dir": os.path.realpath(self.encoder_dir)}

    def apply_worker_settings(self, cross_kv_cache_fraction: float, cross_kv_cache_dtype: str | None,
                              encoder_dir: str) -> None:
        """Take the leader's settings (before the pools are sized): its cross-KV fraction and type and its
        encoder engine (loaded again here when the leader was pointed at another one)."""
        self.cross_kv_fraction, self.cross_kv_cache_dtype = cross_kv_cache_fraction, cross_kv_cache_dtype
        if os.path.realpath(self.encoder_dir) != encoder_dir:
            self.encoder_dir = encoder_dir
            self.encoder = self._load_stack(Encoder, encoder_dir)

    def call_for_workers(self, call: tuple) -> tuple:
        """The plan the workers get for a mirrored ``call`` (LeaderRunner.call_on_all_ranks): encode_into's
        feature inputs as their shapes (``shared_features`` broadcasts the values), anything else as is."""
        method, args, kwargs, reduce = call
        if method != "encode_into" or not self.spec.num_mel_bins:
            return call
        inputs, *rest = args
        shapes = FeatureShapes(tuple(tuple(torch.as_tensor(f).shape) for f in inputs))
        return method, (shapes, *rest), kwargs, reduce

    def shared_features(self, inputs) -> list[torch.Tensor]:
        """Every rank's copy of the leader's feature inputs, on this rank's device: rank 0 sends them, the
        workers (given their ``FeatureShapes``) receive them, in one broadcast over the tp group."""
        if isinstance(inputs, FeatureShapes):
            shapes = inputs.shapes
            flat = torch.empty(sum(int(torch.Size(s).numel()) for s in shapes), dtype=torch.float32, device=self.device)
        else:
            shapes = [tuple(torch.as_tensor(f).shape) for f in inputs]
            flat = torch.cat([torch.as_tensor(f, dtype=torch.float32).reshape(-1) for f in inputs]).to(self.device)
        torch.distributed.broadcast(flat, src=0, group=self.tp_group)
        sizes = [int(torch.Size(s).numel()) for s in shapes]
        return [part.view(shape) for part, shape in zip(flat.split(sizes), shapes)]

    # ---- KV memory: the self-attention pool and the cross pool ----------------------------------

    def num_kv_blocks_for(self, *, free_mem_fraction=None, max_tokens=None, kv_cache_dtype=None,
                          reserve_bytes: int = 0) -> int:
        """Blocks of the self-attention pool; sets ``num_cross_blocks`` (module docstring): f of the
        bytes, so a cross pool of half the self pool's element size holds twice the blocks."""
        total = super().num_kv_blocks_for(free_mem_fraction=free_mem_fraction, max_tokens=max_tokens,
                                          kv_cache_dtype=kv_cache_dtype, reserve_bytes=reserve_bytes)
        self_dtype = self.kv_cache_torch_dtype(kv_cache_dtype)
        per_byte = self_dtype.itemsize / self.cross_pool_dtype(self_dtype).itemsize  # cross blocks per self block
        f = self.cross_kv_fraction
        one_input = -(-self.max_encoder_input_len // self.tokens_per_block)
        if self.device.type == "cuda" and max_tokens is None:
            self.num_cross_blocks = self._agreed(max(one_input, int(total * f * per_byte)))
            return max(1, total - max(1, int(self.num_cross_blocks / per_byte)))
        self.num_cross_blocks = self._agreed(max(one_input, int(total * f / (1 - f) * per_byte)))
        return total

    def _agreed(self, cross_blocks: int) -> int:
        """Tensor-parallel ranks: the fewest cross blocks any rank can hold (every rank sizes its pool alike;
        the leader's stage hands out blocks of its own count). Collective: num_kv_blocks_for is mirrored."""
        if self.tp_group is None:
            return cross_blocks
        count = torch.tensor([cross_blocks], dtype=torch.int64, device=self.device)
        torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MIN, group=self.tp_group)
        return int(count)

    def kv_cache_torch_dtype(self, kv_cache_dtype: str | None = None) -> torch.dtype:
        """ModelRunner's, refused by name on a GPU without FP8 (cross_kv.py require_fp8)."""
        dtype = super().kv_cache_torch_dtype(kv_cache_dtype)
        if dtype == KV_FP8_DTYPE:
            require_fp8(self.device, "kv_cache_dtype fp8")
        return dtype

    def cross_pool_dtype(self, self_pool_dtype: torch.dtype) -> torch.dtype:
        return cross_pool_dtype(self.cross_kv_cache_dtype, self_pool_dtype, self.device)

    def allocate_kv_cache(self, num_blocks: int, kv_cache_dtype: str | None = None) -> None:
        super().allocate_kv_cache(num_blocks, kv_cache_dtype)
        if not self.num_cross_blocks:  # allocated without num_kv_blocks_for: as many as self blocks
            self.num_cross_blocks = max(num_blocks, -(-self.max_encoder_input_len // self.tokens_per_block))
        self.cross_pool = None
        # Head-major in memory like the self pool (runner.py allocate_kv_cache): the decode attention
        # reads a page of one head's cross keys as one run, not 128-byte rows a head-stride apart.
        self.cross_pool = torch.zeros(self.kv_pool_shape(self.num_cross_blocks),
                                      dtype=self.cross_pool_dtype(self.kv_cache.dtype), device=self.device).transpose(3, 4)

    def capture_cuda_graphs(self) -> None:
        """CUDA: choose the skinny-GEMM kernel per decoder weight shape (kernels/linear.py; the
        non-gated MLP's up product with its bias and activation fused), then capture the decode
        graphs of every batch bucket up to max_batch_size. CPU, or $TRITONLLM_ENCDEC_GRAPHS=0: no-op."""
        if self.device.type != "cuda" or self.kv_cache is None or os.environ.get(GRAPHS_ENV, "1") == "0":
            return
        self.choose_kernels(default_buckets(self.build_config.max_batch_size))
        build = self.build_config
        self.decode_graphs = EncDecDecodeGraphs(
            self.model, self.kv_cache, self.cross_pool, tokens_per_block=self.tokens_per_block,
            max_seq_len=build.max_seq_len, max_encoder_len=self.max_encoder_input_len,
            max_batch_size=build.max_batch_size, sampled_tokens=self.sampled_tokens)
        self.decode_graphs.capture()

    def choose_kernels(self, decode_batches: list[int] | None = None) -> None:
        """The load-time kernel choices the graphs capture: the skinny-GEMM tiling per decoder weight shape
        (decode steps of up to MAX_SKINNY_ROWS rows). FP8 layer weights (model.py Fp8Linear, the fused gate_up among
        them) get the skinny W8A8 kernel's tiling per shape (kernels/fp8.py; keyed ("fp8", N, K)); the LM
        head stays in the model dtype and is timed as before. Then, for steps of 17-128 rows (the batch
        buckets up to max_batch_size), kernels/wide_rows.py's choice per weight of a decode step
        (``Decoder.decode_step_weights``, FP8 or not; keyed ("wide", ...)): the skinny kernel with a wide-row
        tiling where it beats cuBLAS / cuBLASLt at that many rows. Without it every FP8 product of such a
        step ran torch._scaled_mm, slower than the bf16 engine's cuBLAS products at these rows, with its
        bias added by a kernel of its own (Whisper large-v3, batch 64 on an H200, 2026-11-30: a decode
        step 6.05 ms with bf16 weights, 7.63 with FP8). Last, for a bf16 FP8 T5 (RMS norms), kernels/fp8.py's
        choose_fp8_scaling at ``decode_batches`` (the graphs' buckets) up to MAX_DEFERRED_SCALING_ROWS: the
        products whose reader applies deferred scales (model.py Decoder.forward) run tensor-wise where faster."""
        layers = self.model.layers
        step_weights = self.model.decode_step_weights()
        fp8 = [w for w in step_weights if w.dtype == FP8_DTYPE]
        if isinstance(layers[0].mlp.down, Fp8Linear):
            self.gemm_choices = choose_skinny_weights([m.weight for m in self.model.modules()
                                                       if isinstance(m, torch.nn.Linear)])
            self.gemm_choices.update({("fp8",) + key: {"variant": variant}
                                      for key, variant in choose_fp8_skinny_variants(fp8).items()})
        else:
            ups = [layer.mlp.up.weight for layer in layers] if layers[0].mlp.gate is None else []
            plain = [w for w in step_weights if not any(w is up for up in ups)]
            self.gemm_choices = choose_skinny_weights(plain)
            if ups:
                activation = layers[0].mlp.activation_name
                self.gemm_choices.update({("activated", activation) + shape: choice
                                          for shape, choice in choose_activated_weights(ups, activation).items()})
        wide = choose_wide_variants(step_weights, row_counts=wide_row_counts(self.build_config.max_batch_size))
        self.gemm_choices.update({("wide",) + key: report for key, report in wide.items()})
        if isinstance(layers[0].mlp.down, Fp8Linear) and self.spec.norm == "rms" and self.dtype == torch.bfloat16:
            # T5's products read by its quantizing RMS norms and gated-GELU (model.py Decoder.forward) may defer
            # their scales at the batch buckets' row counts past MAX_SKINNY_ROWS where tensor-wise is faster
            self.gemm_choices[("fp8_deferred_scales",)] = deferred_scaling_choice(fp8, decode_batches or ())

    def warmup(self) -> None:
        pass

    # ---- encoder ------------------------------------------------------------------------------

    @torch.inference_mode()
    def encode_into(self, inputs: list[list[int]], block_tables: list[list[int]]) -> None:
        """Run the encoder over ``inputs`` at once and write each one's cross K/V (every decoder
        layer) into its cross blocks ``block_tables[i]`` (covering its encoder outputs). Returns
        once the work is queued on the device, without waiting for it. Tensor-parallel features: every
        rank's from the leader (``shared_features``; a worker's ``inputs`` are their FeatureShapes)."""
        if self.tp_group is not None and self.spec.num_mel_bins:
            inputs = self.shared_features(inputs)
        T = self.tokens_per_block
        slots = []
        for source, blocks in zip(inputs, block_tables):
            positions = torch.arange(Encoder.output_length(len(source), self.spec))
            slots.append(torch.tensor(blocks)[positions // T] * T + positions % T)
        slots = torch.cat(slots).to(self.device)  # (before the pass: this copy would wait for it)
        # All inputs' rows at once: per layer one [K | V] product and one write (not per input: cross_kv.py)
        project_into_pool(self.model, torch.cat(self.encoder.encode(inputs)), self.cross_pool, slots)

    # ---- decoder step -------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, *, all_logits: bool = False, prompt_embeds=None) -> torch.Tensor:
        block_tables, lengths = batch.cross_block_tables, batch.cross_lengths
        if lengths is None:  # the executor always names them; the memory profile's step reads the worst case
            lengths = [self.max_encoder_input_len] * len(batch.seq_lens_q)
            block_tables = [list(range(-(-lengths[0] // self.tokens_per_block)))] * len(lengths)
        if prompt_embeds is not None:
            raise ValueError("prompt tables are not supported by encoder-decoder engines")
        if self.decode_graphs is not None and not all_logits and batch.tree_parents is None:
            hidden = self.decode_graphs.try_run(batch)
            if hidden is not None:  # a decode-only step, replayed from its bucket's graph
                return self.model.compute_logits(hidden)
        input_ids, positions, meta = self._prepare(batch)
        token_tables, token_lengths = [], []  # one row per new token: its sequence's
        for table, length, n in zip(block_tables, lengths, batch.seq_lens_q):
            token_tables += [table] * n
            token_lengths += [length] * n
        cross = CrossAttentionBatch(self.cross_pool, cross_metadata(token_tables, token_lengths, self.device))
        hidden = self.model(resolve_placeholders(input_ids, self.sampled_tokens), positions, self.kv_cache, meta,
                            cross=cross)
        if not all_logits:
            hidden = hidden[self._to_device(batch.logits_indices, torch.int64)]
        return self.model.compute_logits(hidden)
