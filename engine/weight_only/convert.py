"""Integer weight-only engines (kernels/wna16.py's scheme): one rank's tensors, either quantized at
build from float weights (``--quantization int8_wo / int4_wo / int4_awq``) or carried over from a
checkpoint that ships integer weights (AWQ, GPTQ, compressed-tensors; checkpoint_formats.py).

Which engine tensors are integer: every ``<linear>.weight`` whose model declares a
``<linear>.weight_zero`` (the decoder blocks' projections), and every block of experts
``<moe>.gate_up_proj`` / ``<moe>.down_proj`` with a ``_zero`` beside it. Embeddings, norms, routers
and the lm_head stay in the model dtype.

Build-time quantization is round-to-nearest per group: 4-bit asymmetric (zero points, as AWQ
stores them: a group's [min, max] spans the 16 codes), 8-bit symmetric (zero 128, TensorRT-LLM's
INT8 weight-only). It runs on each rank's shard, which gives the same codes as quantizing the
whole weight, because a shard holds whole groups (``check_groups``).

Checkpoint weights keep their exact codes, scales and zeros. They are carried through the
family's ordinary conversion (fusing q/k/v and gate/up, tensor-parallel splits, partial-rotary
row reorders) by converting stand-ins shaped like the weight: the codes (N, K) themselves, the
scales and zeros (N, groups), and with act-order the permutation repeated on every row. Every
fuse concatenates rows and every split cuts rows or columns, so each stand-in lands where its
weight lands. A per-channel scale (N, 1) stands in widened to (N, tp_size), so a row-parallel
split leaves each rank its (N, 1). Parts a checkpoint left unquantized stand in as NaN (a float
3-D stack of experts too); an engine tensor with any NaN part is quantized afresh from the
dequantized conversion (printed).

Act-order (GPTQ ``desc_act``): a layer's groups are sets of input columns named by ``g_idx``. The
codes are stored sorted by group (``perm = argsort(g_idx)``, so each group is contiguous again) and
the layer gathers its input by the same permutation (``input_perm``). Fused parts must share it
(q/k/v, gate/up see the same input, and GPTQ's order depends only on that input). A row-parallel
layer's permutation must stay within each rank's columns, else the build says so.
"""
from __future__ import annotations

import sys
from dataclasses import replace
from typing import Iterator

import torch

from engine.config import BuildConfig, ConfigError, ModelConfig, WeightOnlyScheme
from engine.convert import TensorGetter, iter_rank_weights
from engine.row_chunks import by_rows
from kernels.wna16 import pack_codes, quantize


def integer_tensor_names(names: list[str]) -> list[str]:
    """The engine names (of one rank) whose tensors hold integer codes: a weight with a zero beside it."""
    present = set(names)
    return [name for name in names if _zero_name(name) in present]


def _scale_name(name: str) -> str:
    return name + "_scale"


def _zero_name(name: str) -> str:
    return name + "_zero"


def _perm_name(weight_name: str) -> str:
    return weight_name[: -len("weight")] + "input_perm"


def build_time_quantized(name: str, tensor: torch.Tensor, scheme: WeightOnlyScheme) -> dict[str, torch.Tensor]:
    """The engine tensors of one integer weight quantized at build: its codes, scale, zero (and with act-order an
    identity input_perm), round to nearest per group (module docstring)."""
    *lead, n, k = tensor.shape
    group = k if scheme.group_size == 0 else scheme.group_size
    check_groups(name, k, group)
    # A row chunk at a time (engine/row_chunks.py): groups lie along rows, so the codes are the same.
    codes, scale, zero = by_rows(lambda rows: quantize(rows, scheme.bits, group, symmetric=scheme.bits == 8),
                                 tensor.reshape(-1, k))
    codes, scale, zero = (t.reshape(*lead, n, t.shape[-1]) for t in (codes, scale, zero))
    out = {name: codes, _scale_name(name): scale, _zero_name(name): zero}
    if scheme.act_order and name.endswith(".weight"):
        out[_perm_name(name)] = torch.arange(tensor.shape[-1], dtype=torch.int32)
    return out


def input_widths(model: ModelConfig, tp_size: int) -> list[int]:
    """Input columns of every integer layer on one rank: qkv/gate_up read the hidden state, o_proj
    the local heads, down_proj the local MLP (dense or expert) width."""
    widths = [model.hidden_size, model.num_heads * model.head_dim // tp_size, model.intermediate_size // tp_size]
    if model.num_experts:
        widths.append(model.moe_intermediate_size // tp_size)
    return widths


def resolve_group_size(build: BuildConfig, model: ModelConfig) -> BuildConfig:
    """A 4-bit build without --group_size takes groups of 128, or of 64 or 32 where 128 does not
    divide every layer's input width on a rank (SmolLM2-135M's 576); said on stderr. Anything else
    is left for the quantizer to check and name."""
    scheme = build.weight_only
    if scheme is None or build.quant_group_size is not None or scheme.bits != 4:
        return build
    widths = input_widths(model, build.tp_size)
    group = next((g for g in (128, 64, 32) if all(w % g == 0 for w in widths)), 128)
    if group != 128:
        print(f"note: groups of 128 do not divide this model's layer widths {sorted(set(widths))}; "
              f"quantizing with groups of {group}", file=sys.stderr)
    return replace(build, quant_group_size=group)


def check_groups(name: str, columns: int, group_size: int) -> None:
    if columns % group_size:
        raise ConfigError(f"{name}: {columns} input columns on this rank do not divide into groups of {group_size}; "
                          "the group size must divide every layer's input width after the tensor-parallel split")


# ---- checkpoints with integer weights -------------------------------------------------------

class CheckpointStandIns:
    """Getters that stand in for a checkpoint's linear weights during conversion (module docstring).

    ``reader``: engine.weight_only.checkpoint_formats.QuantizedLinearReader of the checkpoint;
    ``get``: its raw tensor getter."""

    def __init__(self, reader, get: TensorGetter, scheme: WeightOnlyScheme, tp_size: int):
        self.reader, self.get, self.scheme, self.tp_size = reader, get, scheme, tp_size
        self._last: dict[str, object] = {}

    def _module(self, name: str) -> str | None:
        """The module of a 2-D ``.weight`` the checkpoint quantized, else None."""
        if not name.endswith(".weight"):
            return None
        module = name[: -len(".weight")]
        return module if self.reader.is_quantized(module) else None

    def _read(self, module: str):
        """(codes sorted by group, scale, zero, perm or None), the last few modules kept."""
        if module not in self._last:
            if len(self._last) > 8:
                self._last.clear()
            q = self.reader.read(module)
            codes, perm = q.codes, None
            if q.g_idx is not None:
                perm = torch.argsort(q.g_idx.long(), stable=True)
                sizes = torch.bincount(q.g_idx.long(), minlength=q.scale.shape[1])
                if not bool((sizes == sizes[0]).all()):
                    raise ConfigError(f"{module}.g_idx puts {sizes.min()}..{sizes.max()} columns in a group; "
                                      "supported: act-order with every group the same size")
                codes = codes[:, perm]
            self._last[module] = (codes, q.scale, q.zero, perm)
        return self._last[module]

    def _stand_in(self, name: str, quantized, unquantized) -> torch.Tensor:
        """``quantized(parts)`` of a quantized module's weight (parts: ``_read``'s tuple);
        ``unquantized(rows, columns)`` for another 2-D ``.weight``; any other tensor as it is."""
        module = self._module(name)
        if module is not None:
            return quantized(self._read(module))
        raw = self.get(name)
        if raw.dim() == 3 and raw.is_floating_point():
            # A stack of experts the checkpoint left unquantized (a Parameter, not Linears: Llama 4's
            # experts.gate_up_proj, which compressed-tensors cannot quantize): NaN in every stand-in, so the
            # engine's expert block is quantized afresh. Expanded, so the stand-in holds no memory of its own.
            return torch.tensor(float("nan")).expand(raw.shape)
        if raw.dim() != 2 or not name.endswith(".weight"):
            return raw
        return unquantized(*raw.shape)

    def _groups_wide(self, t: torch.Tensor) -> torch.Tensor:
        return t.float().expand(t.shape[0], self.tp_size) if t.shape[1] == 1 else t.float()

    def codes(self, name: str) -> torch.Tensor:
        return self._stand_in(name, lambda parts: parts[0].float(), lambda rows, columns: _nan(rows, columns))

    def scale(self, name: str) -> torch.Tensor:
        return self._stand_in(name, lambda parts: self._groups_wide(parts[1]),
                              lambda rows, columns: _nan(rows, self._groups(columns)))

    def zero(self, name: str) -> torch.Tensor:
        return self._stand_in(name, lambda parts: self._groups_wide(parts[2]),
                              lambda rows, columns: _nan(rows, self._groups(columns)))

    def perm(self, name: str) -> torch.Tensor:
        """The act-order permutation on every row (N, K), identity where there is none."""
        def of_module(parts) -> torch.Tensor:
            codes, perm = parts[0], parts[3]
            perm = torch.arange(codes.shape[1]) if perm is None else perm
            return perm.float().expand(codes.shape[0], codes.shape[1])

        return self._stand_in(name, of_module,
                              lambda rows, columns: torch.arange(columns, dtype=torch.float32).expand(rows, columns))

    def _groups(self, columns: int) -> int:
        return self.tp_size if self.scheme.group_size == 0 else columns // self.scheme.group_size


def carried_integer_tensors(stand_ins: CheckpointStandIns, model: ModelConfig, build: BuildConfig, rank: int,
                            names: list[str]) -> Iterator[tuple[str, dict[str, torch.Tensor] | None]]:
    """Yield (engine name, carried) for every tensor of this rank in the order the conversion yields them: for
    an integer engine name whose parts the checkpoint all quantized, ``carried`` holds its codes (stored), scale,
    zero and (act-order) input_perm; None for every other name, whose tensor is the conversion's, to be
    quantized afresh (``build_time_quantized``) where it is an integer one. The stand-ins are converted side by
    side, one tensor of each at a time."""
    scheme, tp = stand_ins.scheme, build.tp_size
    integer = set(integer_tensor_names(names))
    parts = [stand_ins.codes, stand_ins.scale, stand_ins.zero] + ([stand_ins.perm] if scheme.act_order else [])
    for converted in zip(*(iter_rank_weights(getter, model, rank, tp, torch.float32) for getter in parts)):
        name = converted[0][0]
        yield name, (_carried(name, [t for _, t in converted], scheme, rank, tp) if name in integer else None)


def _carried(name: str, parts: list[torch.Tensor], scheme: WeightOnlyScheme, rank: int, tp: int
             ) -> dict[str, torch.Tensor] | None:
    """One integer engine tensor's carried codes, scale, zero (and input_perm) from its converted stand-ins
    (codes, scale, zero[, perm]); None (said on stderr) when the checkpoint left any part of it unquantized."""
    c, s, z = parts[:3]
    if torch.isnan(c).any() or torch.isnan(s).any():
        print(f"note: {name} is not quantized (or only in part) in the checkpoint; quantizing it to "
              f"{scheme.bits} bits with round-to-nearest", file=sys.stderr)
        return None
    if scheme.group_size == 0:
        s, z = s[..., :1], z[..., :1]
    group = c.shape[-1] // s.shape[-1]
    if s.shape[-1] * group != c.shape[-1] or (scheme.group_size and group != scheme.group_size):
        raise ConfigError(f"{name}: {c.shape[-1]} input columns on rank {rank} hold {s.shape[-1]} scale groups; "
                          f"the checkpoint's group size {scheme.group_size or 'per channel'} must divide each "
                          f"rank's columns (tp_size {tp})")
    out = {name: pack_codes(c.to(torch.uint8), scheme.bits)}
    out[_scale_name(name)], out[_zero_name(name)] = s.contiguous(), z.to(torch.uint8).contiguous()
    if len(parts) > 3:
        _add_input_perm(out, name, parts[3], c.shape[-1], rank)
    return out


def unquantized_linears(stand_ins: CheckpointStandIns, model: ModelConfig, tp_size: int,
                        names: list[str]) -> list[str]:
    """The integer engine names among ``names`` that are Linear weights (``.weight``) none of whose parts the
    checkpoint quantized: their code stand-ins are NaN throughout (on rank 0, so on every rank: the same
    modules split). A fused weight of quantized and unquantized parts is not among them."""
    linears = [name for name in integer_tensor_names(names) if name.endswith(".weight")]
    wanted = set(linears)
    floats = {name for name, codes in iter_rank_weights(stand_ins.codes, model, 0, tp_size, torch.float32)
              if name in wanted and bool(torch.isnan(codes).all())}  # one stand-in at a time
    return [name for name in linears if name in floats]


def _nan(rows: int, columns: int) -> torch.Tensor:
    """The stand-in of a part the checkpoint left unquantized."""
    return torch.full((rows, columns), float("nan"))


# Engine linears split along their input columns (the Llama-family names; engine/models/layers.py).
ROW_PARALLEL_SUFFIXES = ("o_proj.weight", "down_proj.weight")


def _add_input_perm(out: dict, name: str, perm_rows: torch.Tensor, columns: int, rank: int) -> None:
    if not name.endswith(".weight"):  # a block of experts: no input gather there
        if not torch.equal(perm_rows, torch.arange(columns, dtype=perm_rows.dtype).expand_as(perm_rows)):
            raise ConfigError(f"{name}: act-order (desc_act) experts are not supported; supported: act-order on "
                              "attention and dense MLP layers, experts quantized without it")
        return
    perm = perm_rows[0]
    if not bool((perm_rows == perm).all()):
        raise ConfigError(f"{name}: its fused parts were quantized with different act-order (g_idx) orders; "
                          "supported: q/k/v and gate/up sharing one order")
    local = perm.long()
    low = rank * columns if name.endswith(ROW_PARALLEL_SUFFIXES) else 0
    if not torch.equal(torch.sort(local).values, torch.arange(low, low + columns)):
        raise ConfigError(f"{name}: the act-order (g_idx) of a row-parallel layer crosses tensor-parallel ranks; "
                          "supported: such checkpoints at tp_size 1, or quantized without desc_act")
    out[_perm_name(name)] = (local - low).to(torch.int32)
