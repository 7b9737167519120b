"""Hybrid Mamba / attention decoders (Bamba, Granite 4.0 hybrids, Nemotron-H, Falcon-H1, Mamba-2; Mamba-1 and Jamba).

The model is a stack of pre-norm residual blocks ``x += mixer(rmsnorm(x))`` (engine/ssm/spec.py
names the mixers; Mamba layers are Mamba-2's, or Mamba-1's when the spec says so), then a final
RMSNorm and the lm_head. Attention blocks use the paged KV pool,
which holds only them: ``num_kv_layers`` tells the runner how many layers the pool has, and
attention block i reads pool layer ``kv_index[i]``. Mamba blocks keep their per-sequence state in
``conv_states`` / ``ssm_states`` (one slot per running sequence, engine/executor/state_cache.py),
allocated by ``allocate_states`` before the KV pool; the step's slots come in the attention
metadata (``state_slots``).

Weights per engine directory, one file per tensor-parallel rank: ``embed_tokens.weight`` and
``lm_head.weight`` (unless tied; both split by vocab rows), ``norm.weight``, and per block i
``blocks.{i}.norm.weight`` and the mixer's: Mamba (engine/ssm/mamba2.py, split by heads as
engine/ssm/mamba_shard.py says; Mamba-1 engine/ssm/mamba1.py, one rank only), attention ``qkv_proj.weight`` (rows [q_r | k_r | v_r] of the rank's
heads; with partial rotary each q/k head's dims in kernels.rotary.partial_rotary_order) and
``o_proj.weight`` (the rank's input columns, row-parallel), MLP ``up_proj.weight`` ([gate_r | up_r]
rows when gated) and ``down_proj.weight`` (row-parallel), routed experts engine/models/moe.py's
``router.weight``, ``gate_up_proj`` (E, 2I_r, H) and ``down_proj`` (E, H, I_r) of each expert's width
slice (Jamba: one rank; Nemotron-H: ``gate_up_proj`` (E, I_r, H) of up rows only for its relu^2
experts, and a float32 ``router.weight`` with ``score_bias``), under ``experts.`` beside the shared MLP's
``shared.up_proj.weight`` / ``shared.down_proj.weight`` (Granite 4.0 and Nemotron-H MoE: SharedMlpMoe). With ``quantization`` "fp8" the linear
layers of the blocks (in_proj, out_proj, qkv_proj, o_proj, up_proj, down_proj) hold E4M3 weights
with a ``weight_scale`` per output channel; embeddings, lm_head, norms, the conv, A_log, D and
dt_bias stay in the model dtype.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ConfigError, ModelConfig
from engine.models.layers import (Linear, Norm, RowParallelLinear, VocabParallelEmbedding, qkv_heads, tp_all_reduce,
                                  vocab_parallel_logits)
from engine.models.moe import SparseMoeBlock, warm_up_experts
from engine.ssm.mamba1 import Mamba1Mixer
from engine.ssm.mamba2 import Mamba2Mixer, StepStates, step_states
from engine.ssm.mamba_shard import mamba_shard
from engine.ssm.spec import SsmSpec
from kernels.activation import silu_and_mul
from kernels.attention import paged_attention, write_kv_cache
from kernels.attention_metadata import AttentionMetadata
from kernels.rmsnorm import rms_norm
from kernels.rope_attention import rope_paged_attention
from kernels.rotary import build_cos_sin_cache

# Linear-layer weight formats the blocks take (engine/models/layers.py Linear): the model dtype, per-channel
# FP8 (--quantization fp8), or block FP8 (fp8_block checkpoints).
QUANTIZATIONS = (None, "fp8", "fp8_block")
TORCH_STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Attention(nn.Module):
    """One rank's heads (num_heads / tp, num_kv_heads / tp); o_proj row-parallel."""

    def __init__(self, config: ModelConfig, kv_index: int, rope: bool, *, dtype, device, scale: float | None = None,
                 tp_size: int = 1, tp_group=None, quantization=None):
        super().__init__()
        c = config
        self.kv_index, self.rope = kv_index, rope
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads // tp_size, c.num_kv_heads // tp_size, c.head_dim
        self.scale = c.head_dim**-0.5 if scale is None else scale
        q_size, kv_size = self.num_heads * c.head_dim, self.num_kv_heads * c.head_dim
        kw = {"dtype": dtype, "device": device, "quantization": quantization}
        self.qkv_proj = Linear(c.hidden_size, q_size + 2 * kv_size, bias=False, **kw)
        self.o_proj = RowParallelLinear(q_size, c.hidden_size, bias=False, tp_group=tp_group, **kw)

    def forward(self, h, positions, cos_sin_cache, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = qkv_heads(self.qkv_proj(h), self.num_heads, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache[self.kv_index, 0], kv_cache[self.kv_index, 1]
        if self.rope:
            out = rope_paged_attention(q, k, v, positions, cos_sin_cache, k_cache, v_cache, meta, self.scale)
        else:  # Nemotron-H: no position encoding in its attention layers
            write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
            out = paged_attention(q, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out.reshape(out.shape[0], -1))


class MLP(nn.Module):
    """One rank's intermediate_size / tp columns; down_proj row-parallel."""

    def __init__(self, config: ModelConfig, act: str, *, dtype, device, tp_size: int = 1, tp_group=None,
                 quantization=None, intermediate_size: int | None = None):
        super().__init__()
        self.gated = act == "silu"
        inter = (intermediate_size or config.intermediate_size) // tp_size
        kw = {"dtype": dtype, "device": device, "quantization": quantization}
        self.up_proj = Linear(config.hidden_size, 2 * inter if self.gated else inter, bias=False, **kw)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=False, tp_group=tp_group, **kw)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        up = self.up_proj(h)
        return self.down_proj(silu_and_mul(up) if self.gated else F.relu(up).square())


class SharedMlpMoe(nn.Module):
    """Granite 4.0's and Nemotron-H's MoE layer: routed experts (engine/models/moe.py SparseMoeBlock) and a
    shared MLP of width spec.moe_shared_size read the same normed input; out = experts(h) + shared(h).
    Over tensor-parallel ranks both are partial sums (each rank's slice of every expert's width and of
    the shared MLP's, built without their own all-reduce) that meet in one all-reduce here, as a dense
    MLP's row-parallel down_proj does."""

    def __init__(self, experts: SparseMoeBlock, shared: MLP, tp_group):
        super().__init__()
        self.experts, self.shared, self.tp_group = experts, shared, tp_group

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = self.experts.routed_experts(h, self.experts.logits(h)) + self.shared(h)
        return out if self.tp_group is None else tp_all_reduce(out, self.tp_group)


class ParallelMambaAttention(nn.Module):
    """Falcon-H1's mixer: a Mamba-2 layer and attention read the same normed input; their outputs
    add (the checkpoint's input/output multipliers are folded into the weights at build)."""

    def __init__(self, mamba: Mamba2Mixer, attention: Attention):
        super().__init__()
        self.mamba, self.attention = mamba, attention


class Block(nn.Module):
    def __init__(self, kind: str, mixer: nn.Module, hidden_size: int, *, dtype, device):
        super().__init__()
        self.kind = kind
        self.norm = Norm(hidden_size, bias=False, dtype=dtype, device=device)
        self.mixer = mixer


class HybridForCausalLM(nn.Module):
    """The one rank of a hybrid model (module docstring)."""

    uses_state_cache = True  # the executor gives each sequence a state slot (engine/executor/state_cache.py)

    def __init__(self, config: ModelConfig, *, tp_rank: int = 0, tp_size: int = 1, tp_group=None,
                 dtype: torch.dtype = torch.float32, device=None, max_positions: int | None = None,
                 quantization=None):
        super().__init__()
        if quantization not in QUANTIZATIONS:
            raise ConfigError(f"{config.architecture}: quantization {quantization!r} is not supported for hybrid "
                              f"Mamba models; allowed: {', '.join(q for q in QUANTIZATIONS if q)} or none")
        c = self.config = config
        spec = self.spec = SsmSpec.from_dict(config.ssm)
        if quantization is not None and spec.mamba_version == 1:
            raise ConfigError(f"{config.architecture}: quantization {quantization!r} is not supported for Mamba-1 "
                              "layers; build without --quantization")
        if quantization is not None and "moe" in spec.blocks and spec.mlp_act != "silu":
            raise ConfigError(f"{config.architecture}: quantization {quantization!r} is not supported for its "
                              f"{spec.mlp_act} routed experts (Nemotron-H MoE layers); build without --quantization")
        # This rank's Mamba layer shape (heads and B/C groups split; refused by name where they cannot be)
        shard = mamba_shard(spec, tp_rank, tp_size)
        self.state_spec = shard.spec
        kw = {"dtype": dtype, "device": device}
        parallel = {**kw, "tp_group": tp_group, "quantization": quantization}
        self.dtype = dtype
        self.tp_group = tp_group
        self.embed_tokens = VocabParallelEmbedding(c.vocab_size // tp_size, c.hidden_size, tp_rank=tp_rank,
                                                   tp_group=tp_group, **kw)

        def attention(kv: int) -> Attention:
            return Attention(c, kv, spec.attention_rope, scale=spec.attention_scale, tp_size=tp_size, **parallel)

        blocks, kv_index, mamba_index = [], 0, 0
        for kind in spec.blocks:
            if kind == "mamba":
                mixer = (Mamba1Mixer(spec, c.hidden_size, c.norm_eps, **kw) if spec.mamba_version == 1 else
                         Mamba2Mixer(shard, c.hidden_size, c.norm_eps, **parallel))
                mixer.state_index = mamba_index
                mamba_index += 1
            elif kind == "attention":
                mixer = attention(kv_index)
                kv_index += 1
            elif kind == "parallel":
                mixer = ParallelMambaAttention(Mamba2Mixer(shard, c.hidden_size, c.norm_eps, **parallel),
                                               attention(kv_index))
                mixer.mamba.state_index = mamba_index
                mamba_index += 1
                kv_index += 1
            elif kind == "moe":  # (its forward may leave the top-k rows unsummed: the next norm sums them)
                experts = SparseMoeBlock(c, tp_size=tp_size, tp_group=None if spec.moe_shared_size else tp_group,
                                         fp8=quantization, activation=spec.mlp_act, **kw)
                mixer = experts if not spec.moe_shared_size else SharedMlpMoe(
                    experts, MLP(c, spec.mlp_act, tp_size=tp_size, intermediate_size=spec.moe_shared_size, **kw,
                                 quantization=quantization), tp_group)
            else:
                mixer = MLP(c, spec.mlp_act, tp_size=tp_size, **parallel)
            blocks.append(Block(kind, mixer, c.hidden_size, **kw))
        self.blocks = nn.ModuleList(blocks)
        self.num_kv_layers = max(1, kv_index)  # the paged pool's layers: the attention blocks only
        self.num_state_layers = mamba_index
        self.norm = Norm(c.hidden_size, bias=False, **kw)
        if not c.tie_word_embeddings:
            self.lm_head = Linear(c.hidden_size, c.vocab_size // tp_size, bias=False, **kw)
        self.max_positions = max_positions or c.max_position_embeddings
        self.cos_sin_cache: torch.Tensor | None = None
        self.conv_states: torch.Tensor | None = None  # (mamba blocks, slots, conv_dim, d_conv - 1)
        # (mamba blocks, slots, *state_spec.ssm_state_shape): Mamba-2 (H, head_dim, d_state), Mamba-1
        # (d_inner, d_state); conv_dim and H are this rank's (state_spec)
        self.ssm_states: torch.Tensor | None = None

    # ---- state pool ----
    def state_dtype(self) -> torch.dtype:
        return TORCH_STATE_DTYPES[self.spec.state_dtype] if self.spec.state_dtype else self.dtype

    def state_slot_bytes(self) -> int:
        """Bytes one sequence's states take over every Mamba block, on this rank."""
        s = self.state_spec
        conv = s.conv_dim * (s.d_conv - 1) * torch.empty((), dtype=self.dtype).element_size()
        ssm = math.prod(s.ssm_state_shape) * torch.empty((), dtype=self.state_dtype()).element_size()
        return self.num_state_layers * (conv + ssm)

    def _state_pools(self, num_slots: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.state_spec
        return (torch.zeros(self.num_state_layers, num_slots, s.conv_dim, s.d_conv - 1, dtype=self.dtype,
                            device=device),
                torch.zeros(self.num_state_layers, num_slots, *s.ssm_state_shape, dtype=self.state_dtype(),
                            device=device))

    def allocate_states(self, num_slots: int, device) -> None:
        self.conv_states, self.ssm_states = self._state_pools(num_slots, device)

    def init_buffers(self, device: torch.device) -> None:
        c = self.config
        if self.spec.attention_rope:
            self.cos_sin_cache = build_cos_sin_cache(self.max_positions, c.head_dim, c.rope_theta, c.rope_scaling,
                                                     device, rotary_dim=c.rotary_dim)
        for block in self.blocks:
            if block.kind in ("mamba", "parallel"):
                (block.mixer if block.kind == "mamba" else block.mixer.mamba).init_buffers()

    def _states(self, meta: AttentionMetadata, device) -> tuple[torch.Tensor, torch.Tensor, StepStates]:
        """This forward's state pools and StepStates. A CUDA graph's meta has no host lists: a
        decode-only step over ``meta.state_slots`` (padding rows -1, skipped). Without slots (engine
        warm-up, memory profiling, before any request) sequence i uses slot i (modulo their number)
        of the pool, or of scratch states when no pool is allocated."""
        if meta.cu_seqlens_q_host is None:
            return self.conv_states, self.ssm_states, StepStates(decode_slots=meta.state_slots)
        if meta.state_slots_host is not None:
            return self.conv_states, self.ssm_states, step_states(meta, meta.state_slots_host, meta.state_slots)
        num_seqs = len(meta.cu_seqlens_q_host) - 1
        conv, ssm = self.conv_states, self.ssm_states
        if conv is None:
            conv, ssm = self._state_pools(num_seqs, device)
        # (sequences may share a slot here: what they leave in it is never read)
        return conv, ssm, step_states(meta, [i % conv.shape[1] for i in range(num_seqs)], None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                attn_meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: (num_tokens,) -> final-normed hidden states (num_tokens, hidden)."""
        if self.cos_sin_cache is None and self.spec.attention_rope:
            self.init_buffers(input_ids.device)
        conv_states, ssm_states, step = self._states(attn_meta, input_ids.device)
        x, residual = self.embed_tokens(input_ids), None
        if self.spec.embedding_multiplier != 1.0:
            x = x * self.spec.embedding_multiplier
        eps, scale_out = self.config.norm_eps, self.spec.residual_multiplier
        for block in self.blocks:
            h, residual = rms_norm(x, block.norm.weight, eps, residual)
            if block.kind == "mamba":
                i = block.mixer.state_index
                x = block.mixer(h, conv_states[i], ssm_states[i], step)
            elif block.kind == "attention":
                x = block.mixer(h, positions, self.cos_sin_cache, kv_cache, attn_meta)
            elif block.kind == "parallel":
                mamba, i = block.mixer.mamba, block.mixer.mamba.state_index
                x = (mamba(h, conv_states[i], ssm_states[i], step)
                     + block.mixer.attention(h, positions, self.cos_sin_cache, kv_cache, attn_meta))
            else:
                x = block.mixer(h)
            if scale_out != 1.0:  # Granite 4.0: before the residual add (the norm below makes it)
                x = x * scale_out
        return rms_norm(x, self.norm.weight, eps, residual)[0]

    def warm_up_kernels(self, max_tokens: int = 8192) -> None:
        """Jamba, Granite 4.0 MoE: compile the routed experts' kernel variants before the first request
        (engine/models/moe.py)."""
        warm_up_experts(next((getattr(b.mixer, "experts", b.mixer) for b in self.blocks if b.kind == "moe"), None),
                        max_tokens)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        logits = vocab_parallel_logits(hidden, weight, self.tp_group)
        return logits if self.spec.logits_scaling == 1.0 else logits / self.spec.logits_scaling
