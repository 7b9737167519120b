"""Taps on a model's decoder layers: after every forward, chosen layers' residual streams (one row per
token of the step) wait where a drafter reads them (EAGLE-3 heads, engine/executor/speculative/eagle3.py),
also when the forward was a CUDA graph replay.

Why it works under graphs: forward hooks run while a graph is captured, so the tensors a hook makes
during a capture are that graph's static outputs, which every replay rewrites. The graph classes
(cuda_graphs.py, prefill_graphs.py) keep each capture's tensors beside its hidden output
(``captured``) and, after a replay, point the taps at them (``replayed``). Like the graphs' hidden
output, they are valid until the next forward (all graphs share one memory pool): read them first.

Invariants: ``streams[j]`` is layer ``layers[j]``'s stream, (num_tokens of the last forward, hidden),
in the model dtype, rows in the batch's token order (graph padding rows cut off).
"""
from __future__ import annotations

import torch

from kernels.fp8 import apply_scales


class LayerTaps:
    """Forward hooks on ``model.layers[i]`` for i in ``layers`` (a layer returns (output, pending
    residual add): the add a tensor (LlamaLayer) or a tuple of them (DecoderLayer), the output a
    tensor or, from FP8 layers, a ScaledProduct whose scales are still to apply; the stream is
    their sum)."""

    def __init__(self, model: torch.nn.Module, layers: list[int]):
        self.layers = list(layers)
        self._rows: dict[int, torch.Tensor] = {}
        self._handles = [model.layers[i].register_forward_hook(self._hook(j)) for j, i in enumerate(self.layers)]

    def _hook(self, j: int):
        def hook(module, inputs, output):
            x, adds = output
            x = apply_scales(x)  # (a tensor: itself)
            if x.dim() == 3:  # unsummed expert rows (T, parts, hidden), which the next norm sums: summed alike
                x = x.sum(dim=1)
            if isinstance(adds, torch.Tensor):
                x = x + adds
            elif adds:
                for term in adds:
                    x = x + term
            else:  # a copy: the next layer may add into its input in place
                x = x.clone()
            self._rows[j] = x.detach()
        return hook

    @property
    def streams(self) -> list[torch.Tensor]:
        return [self._rows[j] for j in range(len(self.layers))]

    def take(self) -> list[torch.Tensor] | None:
        """The last forward's streams, once: None when no forward ran since the last take (a reader
        that must not mistake an earlier step's rows for this one's)."""
        if not self._rows:
            return None
        streams, self._rows = self.streams, {}
        return streams

    def captured(self) -> list[torch.Tensor]:
        """The streams of the forward just captured into a graph (its static outputs)."""
        return self.streams

    def replayed(self, captured: list[torch.Tensor], num_tokens: int) -> None:
        """A graph whose capture left ``captured`` was replayed over ``num_tokens`` real tokens."""
        self._rows = {j: t[:num_tokens] for j, t in enumerate(captured)}

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
