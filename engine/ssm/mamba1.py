"""The Mamba-1 mixer (MambaForCausalLM, Jamba) over a ragged, packed batch, each sequence's state in a slot.

    x | z = in_proj(h)                           (T, D), (T, D)      D = d_inner
    x = silu(causal_conv1d(x))                   conv state: last d_conv - 1 x rows (kernels/causal_conv1d.py)
    dt | B | C = x_proj(x)                       (T, dt_rank), (T, N), (T, N)
    (Jamba: dt, B, C = rmsnorm(dt), rmsnorm(B), rmsnorm(C), each with its weight, eps = norm_eps)
    dt = dt_proj(dt)                             (T, D); the bias is added in the scan, softplus after
    y = selective_scan(x, dt, A, B, C) + Dskip * x, times silu(z)     SSM state (D, N) (kernels/selective_scan.py)
    out = out_proj(y)

Weights (engine-directory names, per block): ``in_proj.weight`` (2D, hidden) rows [x | z] (+ ``.bias``),
``conv_weight`` (D, d_conv), ``conv_bias`` (D,), ``x_proj.weight`` (dt_rank + 2N, D), ``dt_proj.weight``
(D, dt_rank), ``dt_bias`` (D,) (dt_proj's bias), ``A_log`` (D, N), ``D`` (D,), ``out_proj.weight``
(+ ``.bias``), and with dt_norms ``dt_norm.weight``, ``b_norm.weight``, ``c_norm.weight``.
A = -exp(A_log) in float32, as transformers computes it.

Which path a sequence takes is Mamba-2's (engine/ssm/mamba2.py StepStates): one new token after a
state takes the one-token update, any other chunk the prefill scan, from zeros at position 0 and
from the slot's state after. transformers' Mamba and Jamba do the same, so greedy ids follow theirs.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.models.layers import Linear, Norm
from engine.ssm.mamba2 import StepStates, by_path
from engine.ssm.spec import SsmSpec
from kernels.causal_conv1d import causal_conv1d_decode, causal_conv1d_prefill
from kernels.rmsnorm import rms_norm
from kernels.selective_scan import selective_scan_decode, selective_scan_prefill


class Mamba1Mixer(nn.Module):
    def __init__(self, spec: SsmSpec, hidden_size: int, norm_eps: float, *, dtype, device):
        super().__init__()
        self.spec = spec
        self.eps = norm_eps
        D, N, R = spec.inner, spec.d_state, spec.dt_rank

        def param(*shape):
            return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)

        self.in_proj = Linear(hidden_size, 2 * D, bias=spec.proj_bias, dtype=dtype, device=device)
        self.conv_weight = param(D, spec.d_conv)
        self.conv_bias = param(D) if spec.conv_bias else None
        self.x_proj = Linear(D, R + 2 * N, bias=False, dtype=dtype, device=device)
        self.dt_proj = Linear(R, D, bias=False, dtype=dtype, device=device)
        self.dt_bias, self.A_log, self.D = param(D), param(D, N), param(D)
        if spec.dt_norms:
            self.dt_norm, self.b_norm, self.c_norm = (Norm(n, bias=False, dtype=dtype, device=device)
                                                      for n in (R, N, N))
        self.out_proj = Linear(D, hidden_size, bias=spec.proj_bias, dtype=dtype, device=device)
        self.A: torch.Tensor | None = None  # -exp(A_log) (D, N) float32, made by init_buffers

    def init_buffers(self) -> None:
        self.A = -torch.exp(self.A_log.float()).contiguous()

    def forward(self, h: torch.Tensor, conv_states: torch.Tensor, ssm_states: torch.Tensor,
                step: StepStates) -> torch.Tensor:
        """h: (num_tokens, hidden) normed -> (num_tokens, hidden). conv_states (slots, D, d_conv - 1)
        and ssm_states (slots, D, N): this layer's pools."""
        s = self.spec
        if self.A is None:
            self.init_buffers()
        x, z = self.in_proj(h).split([s.inner, s.inner], dim=-1)
        x = by_path(step, lambda x: causal_conv1d_decode(x, self.conv_weight, self.conv_bias, conv_states,
                                                         step.decode_slots),
                    lambda x: causal_conv1d_prefill(x.contiguous(), self.conv_weight, self.conv_bias, conv_states,
                                                    step.prefill), x)
        dt, B, C = self.x_proj(x).split([s.dt_rank, s.d_state, s.d_state], dim=-1)
        if s.dt_norms:
            dt, B, C = (rms_norm(t.contiguous(), norm.weight, self.eps)[0]
                        for t, norm in ((dt, self.dt_norm), (B, self.b_norm), (C, self.c_norm)))
        dt = self.dt_proj(dt)
        y = by_path(step, lambda *rows: selective_scan_decode(*self._scan_args(*rows), ssm_states, step.decode_slots),
                    lambda *rows: selective_scan_prefill(*self._scan_args(*rows), ssm_states, step.prefill),
                    x, dt, B, C, z)
        return self.out_proj(y)

    def _scan_args(self, x, dt, B, C, z):
        return x, dt, self.A, B, C, self.D, self.dt_bias, z
