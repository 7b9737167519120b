"""The Mamba-2 mixer over a ragged, packed batch, with each sequence's state in a slot.

    zxbcdt = in_proj(h)                          (T, inner + conv_dim + H)   rows [z | xBC | dt]
    xBC = silu(causal_conv1d(xBC))               conv state: last d_conv - 1 xBC rows (kernels/causal_conv1d.py)
    x | B | C = xBC                              (T, H*P), (T, G*N), (T, G*N)
    y = ssd(x, dt, A, B, C) + D * x              SSM state (H, P, N) (kernels/ssd_scan.py)
    out = out_proj(rmsnorm_per_group(y * silu(z)) * norm_weight)

Weights (engine-directory names, per block): ``in_proj.weight`` (+ ``.bias``), ``conv_weight``
(conv_dim, d_conv), ``conv_bias`` (conv_dim,), ``dt_bias``, ``A_log``, ``D`` (H,),
``gate_norm.weight`` (inner,), ``out_proj.weight`` (+ ``.bias``). A = -exp(A_log) in float32,
as transformers computes it.

Which path a sequence takes: one new token after a state (a decode) goes through the one-token
update; any other chunk (a prompt's first or a later chunk, or a 1-token prompt) through the
chunked prefill, which starts from zeros at position 0 and from the slot's state after. That is
where transformers' generate sends the same tokens, so greedy ids follow it (the two differ in
one detail: prompt chunks clamp dt to ``dt_limit``, the one-token update does not).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.layers import Linear, Norm, RowParallelLinear, tp_all_reduce
from engine.ssm.mamba_shard import MambaShard
from kernels.causal_conv1d import causal_conv1d_decode, causal_conv1d_prefill
from kernels.ssd_scan import ssd_prefill, ssm_decode
from kernels.ssm_chunks import SequenceChunks


@dataclass
class StepStates:
    """What every Mamba layer of one forward needs to find its sequences' states, made once per
    forward (engine/ssm/hybrid.py) and shared by the layers.

    ``decode_slots`` (device int32): the slot of each row taking the one-token update, at packed
    rows ``decode_rows`` (None: every row, in order: a decode-only step); ``prefill``: the other
    sequences' chunks (kernels/ssm_chunks.py) at packed rows ``prefill_rows`` (None: every row).
    A sequence takes the one-token update when it has one new token after a state."""

    decode_slots: torch.Tensor | None = None
    decode_rows: torch.Tensor | None = None
    prefill: SequenceChunks | None = None
    prefill_rows: torch.Tensor | None = None


def step_states(meta, slots_host: list[int], slots: torch.Tensor | None) -> StepStates:
    """StepStates of an eager forward (``meta`` has its host lists): sequence i uses ``slots_host[i]``
    (``slots``: the same on the device, or None to copy them)."""
    cu = meta.cu_seqlens_q_host
    device = meta.context_lens.device
    lens = [cu[i + 1] - cu[i] for i in range(len(cu) - 1)]
    has_state = [ctx > n for ctx, n in zip(meta.context_lens_host, lens)]
    decode = [i for i, (n, has) in enumerate(zip(lens, has_state)) if n == 1 and has]
    if len(decode) == len(lens):  # a decode-only step
        if slots is None:
            slots = torch.tensor(slots_host, dtype=torch.int32, device=device)
        return StepStates(decode_slots=slots)
    prefill = [i for i in range(len(lens)) if i not in set(decode)]
    chunk_cu = [0]
    for i in prefill:
        chunk_cu.append(chunk_cu[-1] + lens[i])
    step = StepStates(prefill=SequenceChunks([slots_host[i] for i in prefill], chunk_cu,
                                             [has_state[i] for i in prefill], device))
    if decode:  # a mixed step: each path over its own rows
        step.decode_slots = torch.tensor([slots_host[i] for i in decode], dtype=torch.int32, device=device)
        step.decode_rows = torch.tensor([cu[i] for i in decode], device=device)
        rows = [r for i in prefill for r in range(cu[i], cu[i + 1])]
        step.prefill_rows = torch.tensor(rows, device=device)
    return step


def by_path(step: StepStates, decode, prefill, *rows: torch.Tensor) -> torch.Tensor:
    """``decode(*rows)`` over the step's decode rows and ``prefill(*rows)`` over its prompt chunks'
    rows, in packed row order: each of ``rows`` (num_tokens, ...) is indexed by the path's rows and
    the results (rows of one width) are put back in place. A decode-only step (CUDA graphs replay
    it: no host data) or a prefill-only step passes the tensors whole."""
    if step.prefill is None:
        return decode(*rows)
    if step.decode_slots is None:
        return prefill(*rows)
    decoded = decode(*(t[step.decode_rows] for t in rows))
    out = decoded.new_empty(rows[0].shape[0], *decoded.shape[1:])
    out[step.decode_rows] = decoded
    out[step.prefill_rows] = prefill(*(t[step.prefill_rows] for t in rows))
    return out


def gated_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float,
                   mode: str = "norm_after_gate", mean_square=None) -> torch.Tensor:
    """The Mamba output's gate and grouped RMSNorm (over groups of ``group_size`` channels), in
    float32, as transformers computes each ``mode`` (engine/ssm/spec.py GATED_NORMS):
    norm_after_gate: weight * rmsnorm(y * silu(z)), rounded to y's dtype before the weight (Mamba-2,
    Bamba, Nemotron-H, Granite); norm_before_gate: weight * rmsnorm(y) * silu(z) (Falcon-H1's
    FalconH1RMSNormGated, weight applied in float32); gate_only: y * silu(z).
    ``mean_square``: (T, inner) float32 -> (T, 1) for a group wider than these channels (a
    tensor-parallel rank's part of a group, summed across ranks: Mamba2Mixer); group_size is then
    ignored and all channels form one group."""
    gate = F.silu(z.float())
    if mode == "gate_only":
        return (y.float() * gate).to(y.dtype)
    h = y.float() * gate if mode == "norm_after_gate" else y.float()
    if mean_square is None:
        groups = h.view(*h.shape[:-1], -1, group_size)
        groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + eps)
    else:
        groups = h * torch.rsqrt(mean_square(h) + eps)
    if mode == "norm_after_gate":
        return weight * groups.view(h.shape).to(y.dtype)
    return (weight.float() * groups.view(h.shape) * gate).to(y.dtype)


# torch._scaled_mm (cuBLASLt's FP8 product: prefill rows on CUDA, kernels/fp8.py) takes weights whose
# rows and columns are multiples of 16.
FP8_ROW_MULTIPLE = 16


def pad_fp8_rows(linear: Linear) -> int:
    """Append zero rows (scale 1, bias 0) to an FP8 weight whose rows are not a multiple of
    FP8_ROW_MULTIPLE; the number appended (the product's extra columns are zeros, for the caller to
    drop). in_proj's 2 * inner + 2 * G * N + H rows are not when the heads are not (Mamba-2 130M's
    24, a rank's share at some tp, the tiny test models' 4)."""
    pad = -linear.weight.shape[0] % FP8_ROW_MULTIPLE
    if not linear.is_fp8 or pad == 0:
        return 0

    def grow(t: torch.Tensor, fill) -> nn.Parameter:
        return nn.Parameter(torch.cat([t, fill((pad, *t.shape[1:]), dtype=t.dtype, device=t.device)]),
                            requires_grad=False)

    linear.weight = grow(linear.weight, torch.zeros)
    linear.weight_scale = grow(linear.weight_scale, torch.ones)
    if linear.bias is not None:
        linear.bias = grow(linear.bias, torch.zeros)
    linear.out_features += pad
    return pad


class Mamba2Mixer(nn.Module):
    """One rank's Mamba-2 layer (engine/ssm/mamba_shard.py: ``shard.spec`` is its local shape, the
    whole layer's at tp 1): in_proj column-parallel, out_proj row-parallel over ``tp_group``;
    ``quantization`` ("fp8" ...) applies to the two projections only (conv, A, D, dt_bias and the
    norm stay in the model dtype)."""

    def __init__(self, shard: MambaShard, hidden_size: int, norm_eps: float, *, dtype, device, tp_group=None,
                 quantization=None):
        super().__init__()
        spec = self.spec = shard.spec
        self.shard, self.tp_group = shard, tp_group
        self.eps = norm_eps
        H, conv_dim = spec.num_heads, spec.conv_dim
        self.in_proj = Linear(hidden_size, spec.inner + conv_dim + H, bias=spec.proj_bias, dtype=dtype, device=device,
                              quantization=quantization)
        self.conv_weight = nn.Parameter(torch.empty(conv_dim, spec.d_conv, dtype=dtype, device=device),
                                        requires_grad=False)
        self.conv_bias = (nn.Parameter(torch.empty(conv_dim, dtype=dtype, device=device), requires_grad=False)
                          if spec.conv_bias else None)
        self.dt_bias = nn.Parameter(torch.empty(H, dtype=dtype, device=device), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(H, dtype=dtype, device=device), requires_grad=False)
        self.D = nn.Parameter(torch.empty(H, dtype=dtype, device=device), requires_grad=False)
        # (gated_norm "gate_only": no norm, so no weight)
        self.gate_norm = Norm(spec.inner, bias=False, dtype=dtype, device=device) if spec.gated_norm != "gate_only" \
            else None
        self.out_proj = RowParallelLinear(spec.inner, hidden_size, bias=spec.proj_bias, tp_group=tp_group,
                                          dtype=dtype, device=device, quantization=quantization)
        self.A: torch.Tensor | None = None  # -exp(A_log) in float32, made by init_buffers
        self.in_pad = 0  # zero rows appended to an FP8 in_proj (pad_fp8_rows), dropped from its output

    def init_buffers(self) -> None:
        """Once after loading: A, and an FP8 in_proj padded for cuBLASLt."""
        self.A = -torch.exp(self.A_log.float())
        self.in_pad += pad_fp8_rows(self.in_proj)

    def forward(self, h: torch.Tensor, conv_states: torch.Tensor, ssm_states: torch.Tensor,
                step: StepStates) -> torch.Tensor:
        """h: (num_tokens, hidden) normed -> (num_tokens, hidden). conv_states (slots, conv_dim,
        d_conv - 1) and ssm_states (slots, H, P, N): this layer's pools."""
        s = self.spec
        if self.A is None:
            self.init_buffers()
        z, xbc, dt, _ = self.in_proj(h).split([s.inner, s.conv_dim, s.num_heads, self.in_pad], dim=-1)
        y = by_path(step, lambda xbc, dt: self._decode(xbc, dt, conv_states, ssm_states, step.decode_slots),
                    lambda xbc, dt: self._prefill(xbc, dt, conv_states, ssm_states, step.prefill), xbc, dt)
        norm_weight = None if self.gate_norm is None else self.gate_norm.weight
        spans = self.shard.norm_spans_ranks
        return self.out_proj(gated_rms_norm(y, z, norm_weight, self.shard.norm_group, self.eps, s.gated_norm,
                                            self._group_mean_square if spans else None))

    def _group_mean_square(self, h: torch.Tensor) -> torch.Tensor:
        """h (T, inner) float32, this rank's channels of one norm group that spans several ranks ->
        the group's mean square (T, 1): each rank puts its sum of squares in its group's column of a
        (T, G) tensor, the all-reduce sums the ranks that share each group."""
        sums = h.new_zeros(h.shape[0], self.shard.norm_groups)
        g = self.shard.first_group
        sums[:, g] = h.pow(2).sum(-1)
        sums = tp_all_reduce(sums, self.tp_group)
        return sums[:, g:g + 1] / self.shard.norm_group

    def _split(self, xbc: torch.Tensor):
        s = self.spec
        x, B, C = xbc.split([s.inner, s.n_groups * s.d_state, s.n_groups * s.d_state], dim=-1)
        rows = xbc.shape[0]
        return (x.view(rows, s.num_heads, s.head_dim), B.view(rows, s.n_groups, s.d_state),
                C.view(rows, s.n_groups, s.d_state))

    def _decode(self, xbc, dt, conv_states, ssm_states, slots: torch.Tensor) -> torch.Tensor:
        xbc = causal_conv1d_decode(xbc, self.conv_weight, self.conv_bias, conv_states, slots)
        x, B, C = self._split(xbc)
        y = ssm_decode(x, dt, self.A, B, C, self.D, self.dt_bias, ssm_states, slots)
        return y.reshape(y.shape[0], -1)

    def _prefill(self, xbc, dt, conv_states, ssm_states, chunks: SequenceChunks) -> torch.Tensor:
        xbc = causal_conv1d_prefill(xbc.contiguous(), self.conv_weight, self.conv_bias, conv_states, chunks)
        x, B, C = self._split(xbc)
        y = ssd_prefill(x, dt, self.A, B, C, self.D, self.dt_bias, ssm_states, chunks, self.spec.dt_range())
        return y.reshape(y.shape[0], -1)
