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

from engine.models.layers import Linear, Norm
from engine.ssm.spec import SsmSpec
from kernels.causal_conv1d import causal_conv1d_decode, causal_conv1d_prefill
from kernels.ssd_scan import ssd_prefill, ssm_decode


@dataclass
class StepStates:
    """What every Mamba layer of one forward needs to find its sequences' states.

    ``slots`` (num_seqs,) int32 on the device and ``slots_host``: each sequence's slot;
    ``has_state``: its chunk continues a state (it starts after position 0); ``decode_rows``:
    the sequences taking the one-token update (all of them when ``decode_only``)."""

    slots: torch.Tensor
    slots_host: list[int]
    cu_seqlens: list[int]
    has_state: list[bool]
    decode_only: bool
    decode_rows: list[int]


def step_states(meta, num_slots_fallback: int) -> StepStates:
    """StepStates from the attention metadata (the runner's ``state_slots``). Without slots (engine
    warm-up, memory profiling) sequence i uses scratch slot i."""
    cu = meta.cu_seqlens_q_host
    lens = [cu[i + 1] - cu[i] for i in range(len(cu) - 1)]
    has_state = [ctx > n for ctx, n in zip(meta.context_lens_host, lens)]
    slots_host = meta.state_slots_host
    if slots_host is None:
        slots_host = list(range(min(len(lens), num_slots_fallback)))
        slots = torch.tensor(slots_host, dtype=torch.int32, device=meta.context_lens.device)
    else:
        slots = meta.state_slots
    decode_rows = [i for i, (n, has) in enumerate(zip(lens, has_state)) if n == 1 and has]
    return StepStates(slots, slots_host, cu, has_state, len(decode_rows) == len(lens), decode_rows)


def gated_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float) -> torch.Tensor:
    """weight * rmsnorm(y * silu(z)) over groups of ``group_size`` channels, in float32, rounded to
    y's dtype before the weight multiplies (transformers' MambaRMSNormGated, norm after the gate)."""
    h = y.float() * F.silu(z.float())
    groups = h.view(*h.shape[:-1], -1, group_size)
    groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + eps)
    return weight * groups.view(h.shape).to(y.dtype)


class Mamba2Mixer(nn.Module):
    def __init__(self, spec: SsmSpec, hidden_size: int, norm_eps: float, *, dtype, device):
        super().__init__()
        self.spec = spec
        self.eps = norm_eps
        H, conv_dim = spec.num_heads, spec.conv_dim
        self.in_proj = Linear(hidden_size, spec.inner + conv_dim + H, bias=spec.proj_bias, dtype=dtype, device=device)
        self.conv_weight = nn.Parameter(torch.empty(conv_dim, spec.d_conv, dtype=dtype, device=device),
                                        requires_grad=False)
        self.conv_bias = (nn.Parameter(torch.empty(conv_dim, dtype=dtype, device=device), requires_grad=False)
                          if spec.conv_bias else None)
        self.dt_bias = nn.Parameter(torch.empty(H, dtype=dtype, device=device), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(H, dtype=dtype, device=device), requires_grad=False)
        self.D = nn.Parameter(torch.empty(H, dtype=dtype, device=device), requires_grad=False)
        self.gate_norm = Norm(spec.inner, bias=False, dtype=dtype, device=device)
        self.out_proj = Linear(spec.inner, hidden_size, bias=spec.proj_bias, dtype=dtype, device=device)
        self.A: torch.Tensor | None = None  # -exp(A_log) in float32, made by init_buffers

    def init_buffers(self) -> None:
        self.A = -torch.exp(self.A_log.float())

    def forward(self, h: torch.Tensor, conv_states: torch.Tensor, ssm_states: torch.Tensor,
                step: StepStates) -> torch.Tensor:
        """h: (num_tokens, hidden) normed -> (num_tokens, hidden). conv_states (slots, conv_dim,
        d_conv - 1) and ssm_states (slots, H, P, N): this layer's pools."""
        s = self.spec
        if self.A is None:
            self.init_buffers()
        z, xbc, dt = self.in_proj(h).split([s.inner, s.conv_dim, s.num_heads], dim=-1)
        if step.decode_only:
            y = self._decode(xbc, dt, conv_states, ssm_states, step.slots)
        elif not step.decode_rows:
            y = self._prefill(xbc, dt, conv_states, ssm_states, step, list(range(len(step.slots_host))))
        else:  # a mixed step: decodes and prompt chunks each through their own path
            y = xbc.new_empty(xbc.shape[0], s.inner)
            rows = torch.tensor([step.cu_seqlens[i] for i in step.decode_rows], device=h.device)
            y[rows] = self._decode(xbc[rows], dt[rows], conv_states, ssm_states, step.slots[step.decode_rows])
            chunks = [i for i in range(len(step.slots_host)) if i not in set(step.decode_rows)]
            token_rows = torch.cat([torch.arange(step.cu_seqlens[i], step.cu_seqlens[i + 1]) for i in chunks])
            token_rows = token_rows.to(h.device)
            y[token_rows] = self._prefill(xbc[token_rows], dt[token_rows], conv_states, ssm_states, step, chunks)
        return self.out_proj(gated_rms_norm(y, z, self.gate_norm.weight, s.inner // s.n_groups, self.eps))

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

    def _prefill(self, xbc, dt, conv_states, ssm_states, step: StepStates, seqs: list[int]) -> torch.Tensor:
        """The chunks of sequences ``seqs`` (their tokens packed in xbc in that order)."""
        lens = [step.cu_seqlens[i + 1] - step.cu_seqlens[i] for i in seqs]
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        slots = [step.slots_host[i] for i in seqs]
        has_state = [step.has_state[i] for i in seqs]
        xbc = causal_conv1d_prefill(xbc.contiguous(), self.conv_weight, self.conv_bias, conv_states, slots, cu,
                                    has_state)
        x, B, C = self._split(xbc)
        y = ssd_prefill(x, dt, self.A, B, C, self.D, self.dt_bias, ssm_states, slots, cu, has_state,
                        self.spec.dt_range())
        return y.reshape(y.shape[0], -1)
