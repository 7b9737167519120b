"""Adapter slots on the device: every adapted projection of a model holds ``num_slots`` adapters.

Layout, per projection kind (``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``), one
tensor stacked over the layers that have it, so loading an adapter is a few large copies:

- ``a``: (layers, slots, n_slices, R, in_local), R = max_lora_rank; a fused projection has one
  slice per module it fuses (q, k, v; gate, up), each with its own A;
- ``b``: (layers, slots, out_local, R), the scale (alpha / r) folded in; output row n belongs to
  the slice whose range ``slice_starts`` gives, and only that slice's rank columns are read;
- ``ranks``: (layers, slots, n_slices) int32, 0 where the adapter leaves a module alone.

Each projection's ``Linear.lora`` is a ``LinearLora`` over its layer's views; kernels/lora.py
reads ``[:rank]`` of A and B, so a slot never needs zeroing beyond its ranks.

Tensor parallelism splits A and B like the weights they attach to: column-parallel projections
(qkv, gate_up) keep A whole and take their rows of B; row-parallel ones (o, down) take their
columns of A and keep B whole (their partial products are summed by the layer's all-reduce).
Partial rotary (Phi-3): q/k rows of B are reordered like the base weight (engine.convert).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.lora.adapter import LoraAdapter, LoraError
from kernels.lora import LoraBatch, add_lora
from kernels.rotary import partial_rotary_order

# Engine projection -> the adapter modules it fuses, in its output-row order.
PROJECTIONS = {"qkv_proj": ("q", "k", "v"), "o_proj": ("o",), "gate_up_proj": ("gate", "up"), "down_proj": ("down",)}
ROW_PARALLEL = ("o_proj", "down_proj")


@dataclass
class LinearLora:
    """One projection's view of the pool in one layer (shapes in the module docstring, less the
    leading layers dimension)."""

    a: torch.Tensor
    b: torch.Tensor
    ranks: torch.Tensor
    slice_starts: tuple[int, ...]

    def add(self, x: torch.Tensor, out: torch.Tensor, batch: LoraBatch) -> None:
        """out (num_tokens, out_local) += each adapter token's product; x (num_tokens, in_local)."""
        add_lora(x, out, self.a, self.b, self.ranks, self.slice_starts, batch)


@dataclass
class _Kind:
    name: str
    layers: list[int]  # model layer index of each row of the stacked tensors
    slice_sizes: tuple[int, ...]  # local output rows of each slice
    a: torch.Tensor
    b: torch.Tensor
    ranks: torch.Tensor


class LoraPools:
    """The adapter slots of ``model`` (a Llama-family model: ``model.layers[i]`` with the
    projections of PROJECTIONS; a layer without one, such as a mixture-of-experts MLP, is not
    adapted there)."""

    def __init__(self, model: torch.nn.Module, *, num_slots: int, max_rank: int, tp_rank: int = 0,
                 tp_size: int = 1, dtype: torch.dtype, device: torch.device):
        if num_slots < 1 or max_rank < 1:
            raise ValueError(f"LoRA pools need num_slots >= 1 and max_rank >= 1, got {num_slots} and {max_rank}")
        self.num_slots, self.max_rank = num_slots, max_rank
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.config = model.config
        self.device = torch.device(device)
        cfg = self.config
        self.rotary_order = None if cfg.rotary_dim == cfg.head_dim else partial_rotary_order(cfg.head_dim, cfg.rotary_dim)
        self.kinds: dict[str, _Kind] = {}
        for name, modules in PROJECTIONS.items():
            layers = [i for i, layer in enumerate(model.layers) if getattr(layer, name, None) is not None]
            if not layers:
                continue
            weight = getattr(model.layers[layers[0]], name).weight
            out_local, in_local = weight.shape
            sizes = self._slice_sizes(name, out_local)
            kind = _Kind(name, layers, sizes,
                         a=torch.zeros(len(layers), num_slots, len(modules), max_rank, in_local, dtype=dtype, device=device),
                         b=torch.zeros(len(layers), num_slots, out_local, max_rank, dtype=dtype, device=device),
                         ranks=torch.zeros(len(layers), num_slots, len(modules), dtype=torch.int32, device=device))
            starts = tuple(sum(sizes[:j]) for j in range(len(sizes) + 1))
            for row, index in enumerate(layers):
                getattr(model.layers[index], name).lora = LinearLora(kind.a[row], kind.b[row], kind.ranks[row], starts)
            self.kinds[name] = kind

    def _slice_sizes(self, name: str, out_local: int) -> tuple[int, ...]:
        cfg = self.config
        if name == "qkv_proj":
            q = cfg.num_heads // self.tp_size * cfg.head_dim
            kv = cfg.num_kv_heads // self.tp_size * cfg.head_dim
            return (q, kv, kv)
        if name == "gate_up_proj":
            return (out_local // 2, out_local // 2)
        return (out_local,)

    @staticmethod
    def slot_bytes(model: torch.nn.Module, max_rank: int, dtype: torch.dtype) -> int:
        """Device bytes one slot takes over every adapted projection (what sizes the pool)."""
        size = torch.empty((), dtype=dtype).element_size()
        total = 0
        for name, modules in PROJECTIONS.items():
            for layer in model.layers:
                linear = getattr(layer, name, None)
                if linear is not None:
                    out_local, in_local = linear.weight.shape
                    total += max_rank * (len(modules) * in_local + out_local) * size
        return total

    @property
    def modules(self) -> set[str]:
        """The adapter modules this model can take."""
        return {m for name in self.kinds for m in PROJECTIONS[name]}

    def check(self, adapter: LoraAdapter) -> None:
        """LoraError unless every module/layer of ``adapter`` has a place here and fits max_rank."""
        for (layer, module), (a, _) in adapter.weights.items():
            kind = next((k for n, k in self.kinds.items() if module in PROJECTIONS[n]), None)
            if kind is None or layer not in kind.layers:
                where = "" if kind is None else f" of layer {layer}"
                raise LoraError(f"{adapter.source}: module {module}{where} cannot take an adapter on "
                                f"{self.config.architecture} (adaptable here: {', '.join(sorted(self.modules))}"
                                f"{'; a mixture-of-experts MLP takes none' if kind is not None else ''})")
            if a.shape[0] > self.max_rank:
                raise LoraError(f"{adapter.source}: rank {a.shape[0]} of module {module} in layer {layer} "
                                f"exceeds max_lora_rank {self.max_rank}")

    @torch.inference_mode()
    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """Load ``adapter`` into ``slot`` (this rank's shards). Stream-ordered with the forwards, so
        a step already queued still reads what the slot held before (it never reads this slot:
        the slot was free)."""
        self.check(adapter)
        for kind in self.kinds.values():
            kind.ranks[:, slot] = 0
        for (layer, module), (a, b) in adapter.weights.items():
            name = next(n for n in self.kinds if module in PROJECTIONS[n])
            kind = self.kinds[name]
            row, j = kind.layers.index(layer), PROJECTIONS[name].index(module)
            a_local, b_local = self._shard(name, module, layer, a, b)
            r = a_local.shape[0]
            kind.a[row, slot, j, :r].copy_(a_local)
            start = sum(kind.slice_sizes[:j])
            kind.b[row, slot, start:start + kind.slice_sizes[j], :r].copy_(b_local)
            kind.ranks[row, slot, j] = r

    def clear(self, slot: int) -> None:
        for kind in self.kinds.values():
            kind.ranks[:, slot] = 0

    def _shard(self, name: str, module: str, layer: int, a: torch.Tensor, b: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(a (r, in_local), b (out_local, r)) of this rank, in the base weight's row order."""
        cfg, rank, tp = self.config, self.tp_rank, self.tp_size
        if module in ("q", "k") and self.rotary_order is not None and layer not in cfg.layers_without_rope:
            b = b.unflatten(0, (-1, cfg.head_dim))[:, self.rotary_order].flatten(0, 1)
        if tp > 1:
            if name in ROW_PARALLEL:
                width = a.shape[1] // tp
                a = a[:, rank * width:(rank + 1) * width]
            else:
                height = b.shape[0] // tp
                b = b[rank * height:(rank + 1) * height]
        return a, b
