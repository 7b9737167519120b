"""ModelRunner: one rank's model, weights and KV pool, running one packed forward at a time.

The runner is deliberately dumb: the scheduler decides which tokens run and which KV blocks
they use; the runner turns a ``ForwardBatch`` (plain Python lists) into device tensors once,
runs the model, and returns float32 logits for the requested rows. It never allocates or
frees blocks and trusts the block tables it is given.
"""
from __future__ import annotations

import gc
import math
import os
import sys
from dataclasses import dataclass, field
from itertools import accumulate

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from engine.config import FLOAT32_WEIGHT_SUFFIXES, EngineConfig, EngineFormatError
from engine.models import get_model_class
from engine.executor.device_memory import apply_memory_fraction_from_env, free_device_bytes
from engine.executor.cuda_graphs import DecodeGraphs, choose_programmatic_launch, run_warmup_batch
from engine.executor.layer_taps import LayerTaps
from engine.executor.load_phases import load_phase
from engine.executor.overlap import resolve_placeholders
from engine.executor.prefill_graphs import PrefillGraphs, model_token_buckets
from engine.executor.mrope_rotary import StepRotary
from engine.executor.table_graphs import table_step_buffers
from engine.models.prompt_embeds import PromptEmbeds, embeddable_ids
from engine.executor import image_spans, tree_batch
from engine.executor.random_weights import has_random_weights, materialize_random_weights
from engine.lora.pool import LoraPools
from engine.models.layers import Linear, enable_one_shot_all_reduce, prepare_weights, wide_row_weights
from kernels import choice_cache
from kernels.attention import KV_FP8_DTYPE
from kernels.attention_metadata import AttentionMetadata, pack_tree_mask
from kernels.triton_attention import prefill_tokens_per_tile
from kernels.fp8 import FP8_DTYPE, choose_fp8_scaling, choose_fp8_skinny_variants
from kernels.fp8_block_choice import choose_fp8_block_skinny
from kernels.int8_gemm import choose_int8_gemm_tilings, int8_gemm_row_counts
from kernels.int8_sq import choose_int8_skinny_variants
from kernels.linear import choose_activated_weights, choose_gated_weights, choose_skinny_weights
from kernels.moe_decode_tiles import choose_decode_tiles
from kernels.wna16 import choose_wna16_variants, mid_rows_for
from kernels.wide_rows import choose_wide_variants, wide_row_counts
from kernels.lora import lora_batch

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
CPU_KV_BUDGET_BYTES = 256 * 1024 * 1024  # a CPU pool never grows past this on its own
PREFILL_GRAPHS_ENV = "TRITONLLM_PREFILL_GRAPHS"  # 0: steps with prompt tokens run eagerly
# Weight schemes whose mixed steps are checked graphed against eager (None: the model dtype).
PREFILL_GRAPH_QUANTIZATIONS = (None, "fp8")
# Decode buckets up to this many rows time the FP8 products' deferred scales (kernels/fp8.py): on an
# H100 the row-wise and tensor-wise products were within a few percent from 1,024 rows on.
MAX_DEFERRED_SCALING_ROWS = 1024


@dataclass
class ForwardBatch:
    """The one typed hand-off from scheduler to runner (see docs/INTERFACES.md).

    A token id ``-1 - i`` (< 0) is a placeholder: the token sampled by the previous step into
    slot i of the runner's ``sampled_tokens`` ring, not on the host yet (engine/executor/overlap.py).

    Invariants: ``len(token_ids) == len(positions) == sum(seq_lens_q)``; sequence i's new tokens
    are ``token_ids[sum(seq_lens_q[:i]) : sum(seq_lens_q[:i+1])]`` at positions
    ``context_lens[i] - seq_lens_q[i] ... context_lens[i] - 1``; ``block_tables[i]`` covers
    ``ceil(context_lens[i] / tokens_per_block)`` blocks.
    """

    token_ids: list[int]
    positions: list[int]
    seq_lens_q: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    logits_indices: list[int]
    # Where this step's sampled tokens go in the runner's sampled_tokens ring (first slot; -1: the
    # step samples nothing). Leader mode: the workers receive them there too.
    sampled_tokens_slot: int = -1
    # LoRA: the adapter pool slot of each sequence (-1: the base model); None when no sequence
    # of the step uses an adapter.
    lora_slots: list[int] | None = None
    # Models with Mamba layers: each sequence's state slot (engine/executor/state_cache.py); else None.
    state_slots: list[int] | None = None
    # Encoder-decoder engines (engine/encoder_decoder/runner.py): each sequence's encoder output
    # length and its request's cross-KV blocks; None / [] for decoder-only engines.
    cross_lengths: list[int] | None = None
    cross_block_tables: list[list[int]] = field(default_factory=list)
    # Llama 3.2 Vision (engine/encoder_decoder/mllama_runner.py): each sequence's cross-attention mask
    # (mllama_cross.CrossMask), None for a request without images; None for other engines.
    cross_masks: list | None = None
    # Tree verification (engine/executor/tree_batch.py): per sequence, each new token's
    # parent within its chunk (-1: none), or None for a plain chunk; None when no sequence has a tree.
    # Positions are then rotary positions; the KV slots of a tree's tokens stay consecutive.
    tree_parents: list[list[int] | None] | None = None
    # Pipeline stages (engine/pipeline/runner.py): the step's micro-batch count, the same on every
    # rank; 0: each stage's cost model chooses it.
    micro_batches: int = 0
    # Pipeline stages: the last stage samples the step's rows, which only draw (sampler.draws_alone),
    # and sends rank 0 the token ids instead of the logits (engine/pipeline/runner.py); decided on rank 0
    # from the requests (Executor._mark_last_stage_sampling), so every rank agrees. Other runners ignore it.
    sample_on_last_stage: bool = False
    # ... and where some row is not greedy, the step's draw settings (engine/executor/packed_draws.py); else None.
    last_stage_draws: list[int] | None = None


def deferred_scaling_choice(fp8_weights: list[torch.Tensor], decode_batches) -> dict:
    """kernels/fp8.py choose_fp8_scaling for these FP8 weights at the decode batches up to
    MAX_DEFERRED_SCALING_ROWS, as a runner's ("fp8_deferred_scales",) gemm choice: the (rows, N, K) whose
    products defer their scales to the kernel that reads them."""
    scaling = choose_fp8_scaling(fp8_weights, [b for b in decode_batches if b <= MAX_DEFERRED_SCALING_ROWS])
    return {"deferred": sorted(key for key, deferred in scaling.items() if deferred)}


class ModelRunner:
    """Loads ``engine_dir`` for ``rank`` onto ``device`` and runs forwards through a paged KV pool."""

    def __init__(self, engine_dir: str, *, rank: int = 0, device: str | torch.device = "cpu", tp_group=None):
        self.engine_config = EngineConfig.load(engine_dir)
        self.model_config = self.engine_config.model
        self.build_config = self.engine_config.build
        self.vocab_size = self.model_config.vocab_size
        self.device = torch.device(device)
        if self.device.type == "cuda":
            apply_memory_fraction_from_env(self.device)
        self.dtype = TORCH_DTYPES[self.build_config.dtype]
        self.rank = rank
        tp_size = self.build_config.tp_size
        if not 0 <= rank < tp_size:
            raise ValueError(f"rank {rank} is out of range for an engine built with tp_size {tp_size}")
        if tp_size > 1 and tp_group is None:
            raise ValueError(f"engine was built with tp_size {tp_size}; a tp_group is required to run it")
        self.tokens_per_block = self.build_config.tokens_per_block
        self.num_kv_heads_local = self.model_config.num_kv_heads // tp_size
        self.model = self._load_model(engine_dir, tp_group)
        if tp_group is not None:  # collective: every rank builds its runner at the same point (CPU: a no-op)
            enable_one_shot_all_reduce(tp_group, self.device)
        self.kv_cache: torch.Tensor | None = None
        self._pin = self.device.type == "cuda"
        # Two steps' worth of sampled tokens (the one being read, the one being written), so the
        # next step's inputs can name them before they reach the host (engine/executor/overlap.py).
        self.sampled_tokens = torch.zeros(2 * self.build_config.max_batch_size, dtype=torch.int64, device=self.device)
        self.sampled_ring_slots = self.sampled_tokens.shape[0]  # the two halves; draft slots follow (add_draft_slots)
        self.decode_graphs: DecodeGraphs | None = None  # captured by capture_cuda_graphs() on CUDA
        self.lora_pools: LoraPools | None = None  # enable_lora(): adapter slots on every adapted projection
        self.prefill_graphs: PrefillGraphs | None = None  # steps with prompt tokens (engine/executor/prefill_graphs.py)
        self.keep_hidden_rows = False  # forward() keeps the scored rows' hidden states (_logits)
        self.last_hidden_rows: torch.Tensor | None = None
        self.graph_greedy: tuple[torch.Tensor, torch.Tensor] | None = None  # forward's head graph's (logits, ids)
        self.layer_taps: LayerTaps | None = None  # tap_layers(): layers' streams after each forward, graphs too
        # Tree methods (the executor sets it before the capture): rows of up to this many tokens verify
        # token trees through graphs of their own (engine/executor/prefill_graphs.py); 0: eagerly.
        self.tree_graph_width = 0

    def add_draft_slots(self, count: int) -> int:
        """Grow the sampled-token ring by ``count`` slots past its two halves -> the first of them. A
        proposer leaves its drafts there, on the device, and names them in a step's drafts by
        placeholder ids like sampled tokens (engine/executor/overlap.py), so the step is packed and
        launched while the drafting still runs. Before capture_cuda_graphs: the graphs resolve
        placeholders from the ring they captured."""
        assert self.decode_graphs is None and self.prefill_graphs is None, "draft slots after the graphs' capture"
        first = self.sampled_tokens.shape[0]
        self.sampled_tokens = torch.cat([self.sampled_tokens, self.sampled_tokens.new_zeros(count)])
        return first

    def tap_layers(self, layers: list[int]) -> LayerTaps:
        """Keep ``layers``' residual streams after every forward, graph replays included
        (engine/executor/layer_taps.py). Before capture_cuda_graphs: each graph keeps the streams
        its capture made."""
        if self.decode_graphs is not None or self.prefill_graphs is not None:
            raise RuntimeError("tap_layers() must run before capture_cuda_graphs()")
        self.layer_taps = LayerTaps(self.model, layers)
        return self.layer_taps

    def _load_model(self, engine_dir: str, tp_group) -> torch.nn.Module:
        cfg, build = self.model_config, self.build_config
        model_class = get_model_class(cfg.architecture, cfg.deepstack_layers)
        quantization = {"quantization": build.weight_only or build.quantization} if build.quantization else {}
        model = self.shape_model(model_class(
            cfg, tp_rank=self.rank, tp_size=build.tp_size, tp_group=tp_group, dtype=self.dtype,
            device="meta", max_positions=max(build.max_seq_len, 1), **quantization,
        ))
        file_rank = self.weights_rank
        if has_random_weights(self.engine_config.extra):  # a config-only benchmark engine
            model = materialize_random_weights(model, self.device, self.engine_config.extra["random_weights_seed"] + file_rank)
            prepare_weights(model)
            model.init_buffers(self.device)
            return model.eval()
        weights = load_rank_weights(engine_dir, file_rank, self.device)
        expected = set(model.state_dict())
        missing, unexpected = sorted(expected - set(weights)), sorted(set(weights) - expected)
        if missing or unexpected:
            raise EngineFormatError(
                f"rank{file_rank}.safetensors in {engine_dir!r} does not match {cfg.architecture}: "
                f"missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
        try:
            model.load_state_dict({k: keep_or_cast(k, v, self.dtype) for k, v in weights.items()}, assign=True)
        except RuntimeError as err:
            raise EngineFormatError(f"rank{file_rank}.safetensors has wrong tensor shapes: {err}") from None
        del weights
        prepare_weights(model)
        model.init_buffers(self.device)
        return model.eval()

    # Hooks for a pipeline stage (engine/pipeline/runner.py): the file its weights are in, the
    # model cut to its layers, what its decode graphs capture, and how many layers its KV pool holds.
    @property
    def weights_rank(self) -> int:
        return self.rank

    def shape_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    @property
    def graph_model(self) -> torch.nn.Module:
        """What the decode graphs capture: ``module(input_ids, positions, kv_cache, meta) -> hidden``
        (a pipeline stage's share of the forward, engine/pipeline/stage.py StageStep)."""
        return self.model

    @property
    def graph_head(self):
        """What the decode graphs' head graphs capture after a step (cuda_graphs.py: the LM head, then the greedy
        pick): the model's compute_logits, on one rank without adapters (a tensor-parallel head gathers across
        ranks, a pipeline stage may hold no head, an adapter may change it); None: the head stays eager."""
        build = self.build_config
        if build.tp_size != 1 or build.pp_size != 1 or self.lora_pools is not None or type(self).graph_model is not \
                ModelRunner.graph_model:
            return None
        return self.model.compute_logits

    @property
    def kv_layers(self) -> int:
        """Layers the KV pool holds: every layer, or a hybrid model's attention layers only."""
        return getattr(self.model, "num_kv_layers", self.model_config.num_layers)

    # ---- LoRA -------------------------------------------------------------------------------

    def lora_slot_bytes(self, max_rank: int) -> int:
        return LoraPools.slot_bytes(self.model, max_rank, self.dtype)

    def enable_lora(self, num_slots: int, max_rank: int) -> None:
        """Allocate ``num_slots`` adapter slots of rank up to ``max_rank`` on every adapted
        projection (engine/lora/pool.py). Before the KV pool and the CUDA graphs: the graphs
        capture the pools' addresses, and the pools come out of the memory the KV pool sizes from."""
        if not getattr(self.model, "supports_lora", False):
            raise ValueError(f"LoRA adapters are not supported for {self.model_config.architecture} yet; "
                             "supported: the Llama-family models (Llama, Mistral, Qwen2, Qwen3, Phi-3, SmolLM3; "
                             "attention only on mixture-of-experts layers)")
        self.lora_pools = LoraPools(self.model, num_slots=num_slots, max_rank=max_rank, tp_rank=self.rank,
                                    tp_size=self.build_config.tp_size, dtype=self.dtype, device=self.device)

    def load_adapter(self, slot: int, adapter) -> None:
        """Copy ``adapter`` (engine.lora.adapter.LoraAdapter) into pool slot ``slot``."""
        self.lora_pools.write(slot, adapter)

    def check_adapter(self, adapter) -> None:
        self.lora_pools.check(adapter)

    # ---- KV pool and state slots ----------------------------------------------------------

    def allocate_state_cache(self, num_slots: int) -> None:
        """A model with Mamba layers: its state slots (engine/executor/state_cache.py), before the KV
        pool is sized so the pool takes what they leave."""
        self.model.allocate_states(num_slots, self.device)

    def kv_cache_torch_dtype(self, kv_cache_dtype: str | None = None) -> torch.dtype:
        """The pool's element type: ``kv_cache_dtype`` ("fp8", or "auto"/None for the engine's
        build choice, which defaults to the model dtype)."""
        name = kv_cache_dtype if kv_cache_dtype not in (None, "auto") else self.build_config.kv_cache_dtype
        if name not in (None, "fp8"):
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not supported; allowed: auto, fp8")
        return KV_FP8_DTYPE if name == "fp8" else self.dtype

    @property
    def kv_block_bytes(self) -> int:
        """Bytes one KV block takes in the pool across all layers (K and V)."""
        return self.kv_block_bytes_for()

    def kv_block_bytes_for(self, kv_cache_dtype: str | None = None) -> int:
        elems = math.prod(self.kv_pool_shape(1))
        dtype = self.kv_cache.dtype if self.kv_cache is not None and kv_cache_dtype is None else \
            self.kv_cache_torch_dtype(kv_cache_dtype)
        return elems * torch.empty((), dtype=dtype).element_size()

    def num_kv_blocks_for(self, *, free_mem_fraction: float | None = None, max_tokens: int | None = None,
                          kv_cache_dtype: str | None = None, reserve_bytes: int = 0) -> int:
        """How many KV blocks to allocate.

        CUDA: ``free_mem_fraction`` (default 0.9) of the device memory this process may still take
        (engine/executor/device_memory.py: the free memory, under a per-process cap), but leaving
        at least ``reserve_bytes`` free (engine/executor/memory_profile.py), capped by
        ``max_tokens`` when given. CPU: ``max_tokens`` when given, else room for
        ``max_batch_size * max_seq_len`` tokens within a 256 MiB budget (never less than one
        full-length sequence).
        """
        per_block = self.kv_block_bytes_for(kv_cache_dtype or "auto")
        cap = None if max_tokens is None else -(-max_tokens // self.tokens_per_block)
        if self.device.type == "cuda":
            fraction = 0.9 if free_mem_fraction is None else free_mem_fraction
            if not 0 < fraction <= 1:
                raise ValueError(f"free_mem_fraction must be in (0, 1], got {fraction}")
            # A dropped executor's pool is freed only with the executor: held in any reference cycle, it still
            # counts as allocated until the collector runs, and this pool would get what little is left (one
            # block, seen on the H200 when a test process made an executor after one that had taken all its
            # memory, when its disaggregation part still pointed back at it; that part's reference is weak now).
            gc.collect()
            free_bytes = free_device_bytes(self.device)
            blocks = min(int(free_bytes * fraction), free_bytes - reserve_bytes) // per_block
            return max(1, blocks if cap is None else min(blocks, cap))
        if cap is not None:
            return max(1, cap)
        return self.host_default_kv_blocks(per_block)

    def host_default_kv_blocks(self, per_block: int) -> int:
        """The pool without device memory to size it from (CPU): room for max_batch_size full-length
        sequences within CPU_KV_BUDGET_BYTES, never less than one full-length sequence."""
        build = self.build_config
        one_seq = -(-build.max_seq_len // self.tokens_per_block)
        wanted = build.max_batch_size * one_seq
        return max(one_seq, min(wanted, CPU_KV_BUDGET_BYTES // per_block))

    def kv_pool_shape(self, num_blocks: int) -> tuple[int, int, int, int, int, int]:
        """(layers, planes, blocks, heads, tokens_per_block, width) before allocate_kv_cache's transpose:
        K and V planes of the KV heads, or what a model with a cache of its own kind says through
        ``kv_pool_dims`` (planes, heads, width): DeepSeek's latent pool is (1, 1, kv_lora_rank + rope)."""
        cfg = self.model_config
        planes, heads, width = getattr(self.model, "kv_pool_dims", (2, self.num_kv_heads_local, cfg.head_dim))
        return self.kv_layers, planes, num_blocks, heads, self.tokens_per_block, width

    def allocate_kv_cache(self, num_blocks: int, kv_cache_dtype: str | None = None) -> None:
        """Allocate the pool (num_layers, 2, num_blocks, tokens_per_block, kv_heads_local, head_dim)
        in ``kv_cache_torch_dtype(kv_cache_dtype)``.

        That shape is a view: in memory each block holds its KV heads one after another, each head's
        tokens_per_block x head_dim values one contiguous run (4 KB for 32 tokens of a 128-wide FP8
        head), and every kernel reads the pool through its strides. Decode attention reads one KV
        head's keys and values at a time, which then come in runs of a page instead of 128- or
        256-byte rows 1-2 KB apart: FP8 decode attention 4-5% faster on an H100 (RESULTS.md, issue 32)."""
        shape = self.kv_pool_shape(num_blocks)
        dtype = self.kv_cache_torch_dtype(kv_cache_dtype)
        self.kv_cache = None  # free the old pool before allocating the new one
        self.decode_graphs = self.prefill_graphs = None  # graphs hold the old pool's address
        self.kv_cache = torch.zeros(shape, dtype=dtype, device=self.device).transpose(3, 4)

    def copy_kv_host_blocks(self, num_host_slots: int, direction: str, block_ids: list[int], slots: list[int]) -> None:
        """KV host tier (engine/executor/kv_host_tier.py) on this rank: keep a host pool of
        ``num_host_slots`` blocks of this rank's KV shard (made by the first call), then copy pool
        block ``block_ids[i]`` to host slot ``slots[i]`` ("to_host") or back ("to_device"); ""
        copies nothing. Leader mode runs it on every rank through the step plan (a CALL), in the
        same order relative to the forwards as on rank 0."""
        from engine.executor.kv_host_tier import HostKVPool

        pool = getattr(self, "kv_host_pool", None)
        if pool is None or pool.num_slots != num_host_slots:
            self.kv_host_pool = pool = HostKVPool(lambda: self.kv_cache, num_host_slots)
        if direction == "to_host":
            pool.copy_to_host(block_ids, slots)
        elif direction == "to_device":
            pool.copy_to_device(slots, block_ids)
        elif direction:
            raise ValueError(f"copy_kv_host_blocks: direction must be to_host, to_device or empty, got {direction!r}")

    # ---- engine load on CUDA: kernels chosen and compiled, decode graphs captured ----------

    def capture_cuda_graphs(self) -> None:
        """Choose the skinny-GEMM kernel per weight shape, then capture decode CUDA graphs for
        every batch-size bucket up to max_batch_size (engine/executor/cuda_graphs.py). CPU: no-op.
        Runs after allocate_kv_cache (on every rank in leader mode)."""
        if self.device.type != "cuda" or self.kv_cache is None:
            return
        build = self.build_config
        self.decode_graphs = DecodeGraphs(self.graph_model, self.kv_cache, tokens_per_block=self.tokens_per_block,
                                          max_seq_len=build.max_seq_len, max_batch_size=build.max_batch_size,
                                          sampled_tokens=self.sampled_tokens, taps=self.layer_taps,
                                          lora_slots=0 if self.lora_pools is None else self.lora_pools.num_slots,
                                          head=self.graph_head)
        # (cold Triton cache: a compile per candidate; kernels/choice_cache.py skips the losers of stored choices)
        with choice_cache.counting() as cached, load_phase(
                lambda: f"load-time kernel choices (cached: {cached['hits']} of {cached['lookups']}"
                        + (f"; timing {slow}" if (slow := choice_cache.slowest_families(cached)) else "") + ")",
                self.device):
            self.choose_kernels(self.decode_graphs.buckets)
        self.choice_cache_counts = cached
        with load_phase(f"decode graphs ({len(self.decode_graphs.buckets)} buckets)", self.device):
            self.decode_graphs.capture()
        buckets = model_token_buckets(self.model, build.max_num_tokens)
        if self.prefill_graphs_enabled() and buckets:
            cfg = self.model_config
            self.prefill_graphs = PrefillGraphs(
                self.graph_model, self.kv_cache, tokens_per_block=self.tokens_per_block, max_seq_len=build.max_seq_len,
                max_batch_size=build.max_batch_size, max_num_tokens=build.max_num_tokens,
                tokens_per_tile=prefill_tokens_per_tile(cfg.num_heads // cfg.num_kv_heads, cfg.head_dim,
                                                        self.kv_cache.element_size(), self.kv_cache.device),
                sampled_tokens=self.sampled_tokens, buckets=buckets, taps=self.layer_taps,
                tree_width=self.tree_graph_width, lora_slots=0 if self.lora_pools is None else self.lora_pools.num_slots,
                table=table_step_buffers(self.model, self.engine_config, build.max_num_tokens, self.dtype, self.device))
            try:
                graphs = self.prefill_graphs
                with load_phase(lambda: f"prefill graphs ({len(buckets)} buckets to {buckets[-1]} tokens; twins: "
                                        f"table {len(graphs.table_graphs)}, tree {len(graphs.tree_graphs)}, "
                                        f"LoRA {len(graphs.lora_graphs)})", self.device):
                    graphs.capture()
            except torch.cuda.OutOfMemoryError:  # the KV pool left too little room: such steps stay eager
                self.prefill_graphs = None
                torch.cuda.empty_cache()
                print("engine: no memory left for the CUDA graphs of steps with prompt tokens; they run "
                      "eagerly (lower kv_cache_free_gpu_mem_fraction to make room)", file=sys.stderr, flush=True)

    def choose_kernels(self, decode_batches: list[int]) -> None:
        """The load-time kernel choices that graphs capture (read at capture): the skinny-GEMM kernel
        per weight shape, PDL or not, and which FP8 products defer their scales at each of
        ``decode_batches`` rows. CUDA only; capture_cuda_graphs runs it, benchmarks that capture
        graphs of their own call it first to time what the executor serves."""
        linears = [m.weight for m in self.model.modules() if isinstance(m, Linear)]
        self.gemm_choices = choose_skinny_weights([w for w in linears if w.dtype != FP8_DTYPE])
        gate_ups = [layer.gate_up_proj.weight for layer in getattr(self.model, "layers", [])
                    if hasattr(layer, "gate_up_proj") and layer.gate_up_proj.weight.dtype != FP8_DTYPE]
        self.gemm_choices.update({("gated",) + shape: choice for shape, choice in choose_gated_weights(gate_ups).items()})
        for activation, weights in getattr(self.model, "activated_weights", dict)().items():  # engine/models/decoder.py
            self.gemm_choices.update({("activated", activation) + shape: choice
                                      for shape, choice in choose_activated_weights(weights, activation).items()})
        fp8_gate_ups = [layer.gate_up_proj.weight for layer in getattr(self.model, "layers", [])
                        if hasattr(layer, "gate_up_proj") and layer.gate_up_proj.weight.dtype == FP8_DTYPE]
        # block-FP8 layers (every family's, through Linear): the skinny kernel without activation quantization at
        # decode rows where it times faster than quantize + block GEMM (kernels/fp8_block_skinny.py)
        block_fp8 = [m.weight for m in self.model.modules()
                     if isinstance(m, Linear) and m.block_scales and m.weight.dtype == FP8_DTYPE]
        self.gemm_choices.update({("fp8_block_skinny",) + shape: report
                                  for shape, report in choose_fp8_block_skinny(block_fp8, self.dtype).items()})
        fp8_plain = [w for w in linears if w.dtype == FP8_DTYPE and not any(w is g for g in fp8_gate_ups)
                     and not any(w is b for b in block_fp8)]  # (per-channel tilings: block-FP8 weights never read them)
        fp8 = choose_fp8_skinny_variants(fp8_plain, gated=fp8_gate_ups)
        self.gemm_choices.update({("fp8",) + key: {"variant": variant} for key, variant in fp8.items()})
        int8_gate_ups = [layer.gate_up_proj.weight for layer in getattr(self.model, "layers", [])
                         if getattr(getattr(layer, "gate_up_proj", None), "int8", False)]
        int8_plain = [m.weight for m in self.model.modules()
                      if isinstance(m, Linear) and m.int8 and not any(m.weight is g for g in int8_gate_ups)]
        int8 = choose_int8_skinny_variants(int8_plain, gated=int8_gate_ups)  # SmoothQuant W8A8 (int8_sq)
        self.gemm_choices.update({("int8",) + key: {"variant": variant} for key, variant in int8.items()})
        int8_gemm = choose_int8_gemm_tilings(int8_plain, gated=int8_gate_ups, rows=int8_gemm_row_counts(
            max(self.build_config.max_num_tokens, self.build_config.max_batch_size)))  # int8_sq past 16 rows
        self.gemm_choices.update({("int8_gemm",) + key: {"tiling": tiling} for key, tiling in int8_gemm.items()})
        plain, gated = wide_row_weights(self.model)  # 17-128 rows (tree verify steps): the skinny kernel where faster
        wide = choose_wide_variants(plain, gated=gated, row_counts=wide_row_counts(
            max(self.build_config.max_num_tokens, self.build_config.max_batch_size)))
        self.gemm_choices.update({("wide",) + key: report for key, report in wide.items()})
        integer = choose_wna16_variants([m.wna16 for m in self.model.modules()
                                         if isinstance(m, Linear) and m.wna16 is not None],
                                        mid_rows=mid_rows_for(decode_batches))
        self.gemm_choices.update({("wna16",) + key: report["variant"] for key, report in integer.items()})
        # one-token grouped expert GEMMs' tiles (models that list their experts: DeepSeek)
        self.gemm_choices.update({("moe_decode",) + key: report for key, report in
                                  choose_decode_tiles(getattr(self.model, "decode_experts", list)()).items()})
        self.launch_choice = choose_programmatic_launch(
            self.graph_model, self.kv_cache, tokens_per_block=self.tokens_per_block,
            max_seq_len=self.build_config.max_seq_len, sampled_tokens=self.sampled_tokens)
        if self.dtype == torch.bfloat16:  # (an fp16 product of E4M3 values unscaled could overflow)
            self.gemm_choices[("fp8_deferred_scales",)] = deferred_scaling_choice(
                [m.weight for m in self.model.modules() if isinstance(m, Linear) and m.is_fp8], decode_batches)

    def prefill_graphs_enabled(self) -> bool:
        """Steps with prompt tokens replay CUDA graphs (engine/executor/prefill_graphs.py) for the
        model families whose forward has been checked against its eager run that way (a class
        attribute), on one GPU, with weights in the model dtype or FP8 and a KV pool in the model
        dtype or FP8 (tests/engine/test_cuda_graphs.py checks each against eager; the integer
        weight-only schemes are not checked in such graphs yet), unless $TRITONLLM_PREFILL_GRAPHS
        is 0. Why FP8 matters here: speculative verify steps (k + 1 tokens a row) and chunked
        prompts run through these graphs; eagerly, an FP8 8B verify step at batch 1 cost 4.7x a
        graphed decode step on an H100 (benchmarks/results/speculative.md, issue 34)."""
        return (getattr(self.model, "supports_prefill_graphs", False) and self.build_config.tp_size == 1
                and self.build_config.quantization in PREFILL_GRAPH_QUANTIZATIONS
                and os.environ.get(PREFILL_GRAPHS_ENV, "1") != "0")

    def release_cuda_graphs(self) -> None:
        """Drop the decode graphs (and, in leader mode, the NCCL work captured in them). Must run
        before the process groups are destroyed: NCCL's communicator teardown can wait forever
        on collectives still held by a live graph (pytorch/pytorch#115388)."""
        if self.decode_graphs is None and self.prefill_graphs is None:
            return
        self.decode_graphs = self.prefill_graphs = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def warmup(self) -> None:
        """Compile the prefill-path kernels now, not in the first request's time to first token:
        one mixed batch (a prefill chunk and a decode row) whose KV writes are skipped (slot -1)."""
        if self.device.type != "cuda" or self.kv_cache is None:
            return
        build = self.build_config
        run_warmup_batch(self.model, self.kv_cache, self.tokens_per_block, max_seq_len=build.max_seq_len,
                         max_num_tokens=build.max_num_tokens)
        warm_up_kernels = getattr(self.model, "warm_up_kernels", None)
        if warm_up_kernels is not None:  # kernels whose variants depend on the batch (the MoE block sizes)
            warm_up_kernels(self.build_config.max_num_tokens)

    @property
    def num_kv_blocks(self) -> int:
        return 0 if self.kv_cache is None else self.kv_cache.shape[2]

    # ---- forward --------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, *, all_logits: bool = False,
                prompt_embeds: PromptEmbeds | None = None, rotary: StepRotary | None = None,
                span_ahead: torch.Tensor | None = None, graph_logits: bool = False) -> torch.Tensor:
        """Run one packed step; float32 logits (len(logits_indices), vocab), or (num_tokens, vocab)
        for every new token when ``all_logits`` (context logits). ``prompt_embeds``: rows of prompt
        tables that replace the embeddings of some of the batch's tokens (engine/executor/prompt_table.py).
        ``rotary``: M-RoPE requests' rotary positions (engine/executor/mrope_rotary.py). Such steps replay
        the prefill graphs' table twins in a vision-language engine (engine/executor/table_graphs.py; a
        decode-only step with deltas its decode graph), else run eagerly. ``span_ahead``: (num_tokens,) int32, how many later new tokens of its
        sequence each token also sees (image spans, engine/executor/image_spans.py;
        AttentionMetadata.span_ahead); such steps run eagerly. ``graph_logits``: the caller reads the logits (and
        greedy_of's ids) before its next forward, so a decode graph's head graph may give them (static buffers the
        next step overwrites; engine/executor/cuda_graphs.py); else they are the step's own."""
        self.graph_greedy = None
        if self.kv_cache is None:
            raise RuntimeError("allocate_kv_cache() must run before forward()")
        # M-RoPE decode rows rotate at position + delta from the engine's table: the decode graphs' positions
        # buffer feeds rotary only (slots come from the true positions), so they replay with those indices.
        graphs_may_run = not all_logits and span_ahead is None
        if (self.decode_graphs is not None and graphs_may_run and batch.tree_parents is None and prompt_embeds is None
                and (rotary is None or rotary.rows is None)):
            hidden = self.decode_graphs.try_run(batch, None if rotary is None else rotary.indices)
            if hidden is not None:  # a decode-only batch, replayed from its bucket's graph
                head = (self.decode_graphs.replay_head(len(hidden)) if graph_logits and not self.keep_hidden_rows
                        and batch.logits_indices == list(range(len(hidden))) else None)
                if head is not None:  # its LM head and greedy pick replayed too
                    self.graph_greedy = head
                    return head[0]
                return self._logits(hidden)
        if self.prefill_graphs is not None and graphs_may_run:  # table / M-RoPE rows: its table twins
            hidden = self.prefill_graphs.try_run(batch, prompt_embeds, rotary)
            if hidden is not None:  # a batch with prompt tokens, replayed from its token bucket's graph
                return self._logits(hidden)
        input_ids, positions, meta = self._prepare(batch)
        if span_ahead is not None:
            meta.span_ahead = span_ahead.to(self.device)
            if meta.tree_mask is not None:  # token trees beside image spans: plain rows of the tree mask see ahead too
                meta.tree_mask |= image_spans.ahead_mask(span_ahead, batch.seq_lens_q, meta.tree_mask.shape[1]).to(
                    self.device)
                meta.tree_bits = pack_tree_mask(meta.tree_mask)  # (the bits of the mask as it now is)
        table_rows = {}  # only models with supports_prompt_tables take the keyword
        if prompt_embeds is not None:
            input_ids = embeddable_ids(input_ids, self.vocab_size)
            table_rows = {"prompt_embeds": prompt_embeds}
        if rotary is not None:  # only models with supports_mrope take the keyword
            table_rows["rotary"] = rotary.resolve(self.model.cos_sin_cache)
        hidden = self.model(resolve_placeholders(input_ids, self.sampled_tokens), positions, self.kv_cache, meta,
                            **table_rows)
        if not all_logits:
            hidden = hidden[self._to_device(batch.logits_indices, torch.int64)]
        return self._logits(hidden)

    def greedy_of(self, logits: torch.Tensor) -> torch.Tensor | None:
        """The greedy ids (n,) int64 of ``logits`` where the last forward's head graph picked them (``logits`` the
        very tensor that forward returned with ``graph_logits``), else None (the caller picks them)."""
        head = self.graph_greedy
        return head[1] if head is not None and head[0] is logits else None

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits of the step's scored rows; with ``keep_hidden_rows`` (Medusa heads read them,
        engine/executor/speculative/medusa.py) their hidden states stay in ``last_hidden_rows``."""
        if self.keep_hidden_rows:
            self.last_hidden_rows = hidden
        return self.model.compute_logits(hidden)

    def store_sampled_tokens(self, token_ids: torch.Tensor, batch: ForwardBatch) -> None:
        """Keep a step's sampled tokens (n,) int64 on the device at ``batch.sampled_tokens_slot``,
        where the next step's placeholders read them (leader mode: every rank gets them)."""
        slot = batch.sampled_tokens_slot
        self.sampled_tokens[slot:slot + len(token_ids)].copy_(token_ids, non_blocking=True)

    def _to_device(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        host = torch.tensor(values, dtype=dtype)
        if self._pin:
            return host.pin_memory().to(self.device, non_blocking=True)
        return host.to(self.device)

    def attention_inputs(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(token ids, positions, AttentionMetadata) of ``batch`` on this device, for a module run
        beside the model over a pool of its own (DeepSeek's MTP module: speculative/mtp.py)."""
        return self._prepare(batch)

    def _prepare(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        num_tokens = len(batch.token_ids)
        if not (num_tokens == len(batch.positions) == sum(batch.seq_lens_q)):
            raise ValueError(
                f"ForwardBatch is inconsistent: {num_tokens} token_ids, {len(batch.positions)} positions, "
                f"sum(seq_lens_q) = {sum(batch.seq_lens_q)}; all three must be equal"
            )
        cu_seqlens = [0, *accumulate(batch.seq_lens_q)]
        width = max(len(table) for table in batch.block_tables)
        padded_tables = [table + [0] * (width - len(table)) for table in batch.block_tables]
        slot_positions = batch.positions if batch.tree_parents is None else tree_batch.slot_positions(
            batch.positions, batch.seq_lens_q, batch.context_lens, batch.tree_parents)
        meta = AttentionMetadata(
            slot_mapping=self._to_device(self._slot_mapping(batch, cu_seqlens, slot_positions), torch.int64),
            block_tables=self._to_device(padded_tables, torch.int32),
            cu_seqlens_q=self._to_device(cu_seqlens, torch.int32),
            context_lens=self._to_device(batch.context_lens, torch.int32),
            max_seqlen_q=max(batch.seq_lens_q),
            max_context_len=max(batch.context_lens),
            is_decode_only=all(n == 1 for n in batch.seq_lens_q),
            cu_seqlens_q_host=cu_seqlens,
            context_lens_host=list(batch.context_lens),
            lora=None if batch.lora_slots is None else lora_batch(batch.lora_slots, batch.seq_lens_q, self.device),
        )
        if batch.tree_parents is not None:
            mask = tree_batch.tree_mask(batch.seq_lens_q, batch.tree_parents)
            meta.tree_mask, meta.tree_bits = mask.to(self.device), pack_tree_mask(mask).to(self.device)
        if batch.state_slots is not None:
            meta.state_slots = self._to_device(batch.state_slots, torch.int32)
            meta.state_slots_host = batch.state_slots
        return self._to_device(batch.token_ids, torch.int64), self._to_device(batch.positions, torch.int64), meta

    def _slot_mapping(self, batch: ForwardBatch, cu_seqlens: list[int], positions: list[int]) -> list[int]:
        """Flat cache slot of every new token at ``positions``: block_table[p // B] * B + p % B."""
        size = self.tokens_per_block
        slots = []
        for i, table in enumerate(batch.block_tables):
            for p in positions[cu_seqlens[i]:cu_seqlens[i + 1]]:
                slots.append(table[p // size] * size + p % size)
        return slots


def keep_or_cast(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of a rank file in the dtype the model holds it in: FP8 weights, integer codes,
    zero points and permutations, and float32 scales stay as stored; everything else is cast to
    the engine's dtype."""
    if tensor.dtype == FP8_DTYPE or not tensor.dtype.is_floating_point or name.endswith("_scale"):
        return tensor
    if tensor.dtype == torch.float32 and name.endswith(FLOAT32_WEIGHT_SUFFIXES):
        return tensor  # DeepSeek's routing (engine/config.py keeps_float32); others' routers are stored in dtype
    return tensor.to(dtype)


def load_rank_weights(engine_dir: str, rank: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Memory-map ``rank{rank}.safetensors`` onto ``device``; clear errors when absent or corrupt."""
    path = os.path.join(engine_dir, f"rank{rank}.safetensors")
    if not os.path.isfile(path):
        raise EngineFormatError(f"engine directory {engine_dir!r} has no weights for rank {rank}: {path} is missing")
    try:
        return load_file(path, device=str(device))
    except (SafetensorError, OSError, ValueError) as err:
        raise EngineFormatError(f"cannot read {path} (corrupt or truncated safetensors file): {err}") from None
