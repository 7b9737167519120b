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

from engine.convert import reorder_rotary_dims, rotary_dim_order, shard
from engine.lora.adapter import LoraAdapter, LoraError
from kernels.lora import KERNEL_ALIGNMENT, LoraBatch, add_lora, kernels_take

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
        self.rotary_order = rotary_dim_order(cfg)
        self.kinds: dict[str, _Kind] = {}
        self._copy_stream = None
        self._in_transit: list = []  # (event, pinned staging) of copies that may still run
        for name, modules in PROJECTIONS.items():
            layers = [i for i, layer in enumerate(model.layers) if getattr(layer, name, None) is not None]
            if not layers:
                continue
            first = model.layers[layers[0]]
            linear = getattr(first, name)
            out_local, in_local = linear.out_features, linear.in_features
            sizes = _slice_sizes(first, name, out_local)
            kind = _Kind(name, layers, sizes,
                         a=torch.zeros(len(layers), num_slots, len(modules), max_rank, in_local, dtype=dtype, device=device),
                         b=torch.zeros(len(layers), num_slots, out_local, max_rank, dtype=dtype, device=device),
                         ranks=torch.zeros(len(layers), num_slots, len(modules), dtype=torch.int32, device=device))
            starts = tuple(sum(sizes[:j]) for j in range(len(sizes) + 1))
            if self.device.type == "cuda" and not kernels_take(in_local, starts):
                raise ValueError(f"LoRA on CUDA needs adapted projections whose widths are multiples of "
                                 f"{KERNEL_ALIGNMENT} (the kernels' tiles); {cfg.architecture}'s {name} has "
                                 f"in_features {in_local} and output slices at {starts}")
            for row, index in enumerate(layers):
                getattr(model.layers[index], name).lora = LinearLora(kind.a[row], kind.b[row], kind.ranks[row], starts)
            self.kinds[name] = kind

    @staticmethod
    def slot_bytes(model: torch.nn.Module, max_rank: int, dtype: torch.dtype) -> int:
        """Device bytes one slot takes over every adapted projection (what sizes the pool)."""
        size = torch.empty((), dtype=dtype).element_size()
        total = 0
        for name, modules in PROJECTIONS.items():
            for layer in model.layers:
                linear = getattr(layer, name, None)
                if linear is not None:
                    out_local, in_local = linear.out_features, linear.in_features
                    total += max_rank * (len(modules) * in_local + out_local) * size
        return total

    def modules_of(self, layer: int) -> set[str]:
        return {m for name, kind in self.kinds.items() if layer in kind.layers for m in PROJECTIONS[name]}

    def check(self, adapter: LoraAdapter) -> None:
        """LoraError unless every module/layer of ``adapter`` has a place here and fits max_rank."""
        for (layer, module), (a, _) in adapter.weights.items():
            kind = next((k for n, k in self.kinds.items() if module in PROJECTIONS[n]), None)
            if kind is None or layer not in kind.layers:
                # A model layer without this projection: a mixture-of-experts MLP (the routed
                # experts take no adapter); the attention projections exist on every layer.
                raise LoraError(f"{adapter.source}: module {module} of layer {layer} cannot take an adapter on "
                                f"{self.config.architecture}: that layer's MLP is a mixture of experts, which "
                                f"takes no adapter (adaptable there: {', '.join(sorted(self.modules_of(layer)))})")
            if a.shape[0] > self.max_rank:
                raise LoraError(f"{adapter.source}: rank {a.shape[0]} of module {module} in layer {layer} "
                                f"exceeds max_lora_rank {self.max_rank}")

    @torch.inference_mode()
    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """Load ``adapter`` into ``slot`` (this rank's shards). The adapter is staged per projection
        kind on the host in the pool's dtype, then copied with one transfer per tensor (a few
        instead of one per layer and module). Stream-ordered with the forwards, so a step already
        queued still reads what the slot held before (it never reads this slot: the slot was free)."""
        self.check(adapter)
        staged = {name: self._stage(kind, adapter) for name, kind in self.kinds.items()}
        if self.device.type != "cuda":
            self._copy(slot, staged)
            return
        # On a side stream, so the copy does not queue behind the step in flight (which never
        # reads this slot); the compute stream waits for it before the next forward is queued.
        # The pinned staging stays referenced until the copy has finished.
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        compute = torch.cuda.current_stream(self.device)
        self._copy_stream.wait_stream(compute)  # what earlier forwards wrote stays ordered (pool reuse)
        with torch.cuda.stream(self._copy_stream):
            self._copy(slot, staged)
            done = torch.cuda.Event()
            done.record()
        compute.wait_event(done)
        self._in_transit = [(e, t) for e, t in self._in_transit if not e.query()] + [(done, staged)]

    def _copy(self, slot: int, staged: dict) -> None:
        for name, kind in self.kinds.items():
            a, b, ranks = staged[name]
            r = a.shape[2]
            if r:
                kind.a[:, slot, :, :r].copy_(a, non_blocking=True)
                kind.b[:, slot, :, :r].copy_(b, non_blocking=True)
            kind.ranks[:, slot].copy_(ranks, non_blocking=True)

    def _stage(self, kind: _Kind, adapter: LoraAdapter) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(a (layers, n_slices, r, in_local), b (layers, out_local, r), ranks (layers, n_slices))
        on the host for ``kind``, r the adapter's largest rank there. Entries past a module's rank
        are left unset: the kernels read A and B only up to ``ranks`` (kernels/lora.py)."""
        modules = PROJECTIONS[kind.name]
        entries = [(layer, module, w) for (layer, module), w in adapter.weights.items() if module in modules]
        r = max((a.shape[0] for _, _, (a, _) in entries), default=0)
        pin = self.device.type == "cuda"
        dtype = kind.a.dtype
        a_host = torch.empty(len(kind.layers), len(modules), r, kind.a.shape[-1], dtype=dtype, pin_memory=pin)
        b_host = torch.empty(len(kind.layers), kind.b.shape[2], r, dtype=dtype, pin_memory=pin)
        ranks = torch.zeros(len(kind.layers), len(modules), dtype=torch.int32, pin_memory=pin)
        for layer, module, (a, b) in entries:
            row, j = kind.layers.index(layer), modules.index(module)
            a_local, b_local = self._shard(kind.name, module, layer, a, b)
            rank = a_local.shape[0]
            a_host[row, j, :rank] = a_local
            start = sum(kind.slice_sizes[:j])
            b_host[row, start:start + kind.slice_sizes[j], :rank] = b_local
            ranks[row, j] = rank
        return a_host, b_host, ranks

    def _shard(self, name: str, module: str, layer: int, a: torch.Tensor, b: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(a (r, in_local), b (out_local, r)) of this rank, in the base weight's row order."""
        cfg = self.config
        if module in ("q", "k") and layer not in cfg.layers_without_rope:
            b = reorder_rotary_dims(b, self.rotary_order, cfg.head_dim)
        if name in ROW_PARALLEL:
            return shard(a, 1, self.tp_rank, self.tp_size), b
        return a, shard(b, 0, self.tp_rank, self.tp_size)


def _slice_sizes(layer: torch.nn.Module, name: str, out_local: int) -> tuple[int, ...]:
    """This rank's output rows of each module a projection fuses: q, k, v from the layer's
    local head counts, gate and up halves, else one slice."""
    if name == "qkv_proj":
        return (layer.num_heads * layer.head_dim,) + (layer.num_kv_heads * layer.head_dim,) * 2
    if name == "gate_up_proj":
        return (out_local // 2, out_local // 2)
    return (out_local,)
