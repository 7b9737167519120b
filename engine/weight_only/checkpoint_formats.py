"""Checkpoints whose linear layers ship as INT4/INT8 weight-only codes (AWQ, GPTQ,
compressed-tensors): their scheme from config.json, and each layer's codes, scales and zeros read
exactly into the engine's scheme (kernels/wna16.py):

    weight[n, k] = (code[n, k] - zero[n, g]) * scale[n, g],   g = g_idx[k]  (k // G without act-order)

Layouts read (packed int32 words always fill from their lowest bits):

- AutoAWQ GEMM (``quant_method: awq``, ``version: gemm``): ``qweight`` int32 (K, N/8) packed along N,
  nibble i of a word holding column ORDER[i] of its 8 (AWQ_ORDER); ``qzeros`` int32 (K/G, N/8) the
  same way; ``scales`` float16 (K/G, N). Without ``zero_point`` and without qzeros the zero is 8.
- GPTQ (AutoGPTQ, GPTQModel; ``checkpoint_format`` gptq or gptq_v2): ``qweight`` int32
  (K*bits/32, N) packed along K; ``qzeros`` int32 (K/G, N*bits/32) packed along N; ``scales``
  float16 (K/G, N); ``g_idx`` int32 (K,). The v1 format stores zero - 1: the zero is stored + 1
  modulo 2**bits (a zero of 0 is written as 2**bits - 1 by packers that mask); v2 stores the zero.
- compressed-tensors ``pack-quantized``: ``weight_packed`` int32 (N, ceil(K*bits/32)) packed along K,
  codes stored offset by 2**(bits-1) (signed -> unsigned, which is the engine's code); ``weight_scale``
  (N, K/G) or (N, 1) in the model dtype; ``weight_shape`` (N, K); asymmetric: ``weight_zero_point``
  signed, offset and packed the same way along N, int32 (ceil(N*bits/32), K/G) (int8 (N, K/G)
  unpacked is read too); act-order: ``weight_g_idx``. ``naive-quantized`` / ``int-quantized``:
  ``weight`` int8 (N, K) signed codes, ``weight_zero_point`` int8 unpacked.

Scales become float32, which holds float16/bfloat16 exactly, so nothing is rounded again.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from engine.config import ConfigError
from engine.convert import CheckpointError, TensorGetter

METHODS = ("awq", "gptq", "compressed-tensors")
GROUP_SIZES = (32, 64, 128, 256)  # and 0: per output channel
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column AWQ_ORDER[i] of its 8
CT_FORMATS = ("pack-quantized", "naive-quantized", "int-quantized")
GPTQ_FORMATS = ("gptq", "gptq_v2")
_SUPPORTED = ("supported: AWQ GEMM int4; GPTQ int4/int8 (checkpoint_format gptq, gptq_v2); "
              "compressed-tensors int4/int8 weight-only (pack-quantized, naive-quantized)")


@dataclass(frozen=True)
class CheckpointWeightQuant:
    """A checkpoint's weight-only integer scheme, as its quantization_config states it."""

    method: str  # "awq" | "gptq" | "compressed-tensors"
    bits: int  # 4 or 8
    group_size: int  # columns per group; 0 = per output channel (one group per row)
    symmetric: bool
    act_order: bool  # layers carry a g_idx (GPTQ desc_act, compressed-tensors actorder "group")
    ignore: tuple[str, ...] = ()  # module names and "re:" patterns (re.match) left unquantized
    version: str = ""  # GPTQ: "gptq" (zeros stored - 1) or "gptq_v2"; compressed-tensors: its format

    def describe(self) -> str:
        group = f"group {self.group_size}" if self.group_size else "per channel"
        text = f"{self.method} int{self.bits} {group} {'symmetric' if self.symmetric else 'asymmetric'}"
        return text + (", act-order" if self.act_order else "")

    def ignores(self, module: str) -> bool:
        """Whether ``module`` is one the config leaves unquantized."""
        return any(re.match(p[3:], module) if p.startswith("re:") else p == module for p in self.ignore)


def checkpoint_weight_quant(hf_config) -> CheckpointWeightQuant | None:
    """The integer weight-only scheme of a checkpoint; None when it has none (unquantized, GGUF,
    FP8 -- engine/fp8_checkpoint.py reads those). Anything else is a ConfigError naming the field."""
    quant = getattr(hf_config, "quantization_config", None)
    if quant is None:
        return None
    quant = quant if isinstance(quant, dict) else quant.to_dict()
    method = _plain(quant.get("quant_method"))
    if method in ("gguf", "fp8"):
        return None
    if method == "awq":
        return _awq_quant(quant)
    if method == "gptq":
        return _gptq_quant(quant)
    if method == "compressed-tensors":
        return _compressed_tensors_quant(quant)
    raise ConfigError(f"quantization_config.quant_method {method!r} is not supported; {_SUPPORTED}; "
                      "and FP8 (engine/fp8_checkpoint.py)")


def _plain(value):
    """An enum's value (transformers' configs may hold enums), lower-cased when a string."""
    value = getattr(value, "value", value)
    return value.lower() if isinstance(value, str) else value


def _group_size(value, field: str) -> int:
    group = 0 if value in (None, -1, 0) else value
    if group and group not in GROUP_SIZES:
        raise ConfigError(f"quantization_config.{field} {value} is not supported; "
                          f"supported: {', '.join(map(str, GROUP_SIZES))} or per channel (-1)")
    return group


def _awq_quant(quant: dict) -> CheckpointWeightQuant:
    version = _plain(quant.get("version", "gemm"))
    if version != "gemm":
        raise ConfigError(f"AWQ quantization_config.version {version!r} is not supported; supported: gemm "
                          "(gemv, marlin, exllama and ipex layouts pack differently)")
    bits = quant.get("bits", quant.get("w_bit"))
    if bits != 4:
        raise ConfigError(f"AWQ quantization_config.bits {bits} is not supported; supported: 4")
    group = _group_size(quant.get("group_size", quant.get("q_group_size")), "group_size")
    # AutoAWQ skips every module whose name contains one of these strings.
    ignore = tuple("re:.*" + re.escape(s) for s in quant.get("modules_to_not_convert") or ())
    return CheckpointWeightQuant("awq", 4, group, not quant.get("zero_point", True), False, ignore)


def _gptq_quant(quant: dict) -> CheckpointWeightQuant:
    if quant.get("is_marlin_format"):
        raise ConfigError("GPTQ quantization_config.is_marlin_format is set: the marlin layout is not supported; "
                          f"supported checkpoint_format: {', '.join(GPTQ_FORMATS)}")
    fmt = _plain(quant.get("checkpoint_format") or quant.get("format") or "gptq")
    if fmt not in GPTQ_FORMATS:
        raise ConfigError(f"GPTQ quantization_config.checkpoint_format {fmt!r} is not supported; "
                          f"supported: {', '.join(GPTQ_FORMATS)}")
    bits = quant.get("bits")
    if bits not in (4, 8):
        raise ConfigError(f"GPTQ quantization_config.bits {bits} is not supported; supported: 4, 8")
    ignore = list(quant.get("modules_to_not_convert") or ())
    for pattern in quant.get("dynamic") or {}:
        # GPTQModel's per-module overrides: "-:regex" skips modules; anything else changes the scheme.
        if not pattern.startswith("-:"):
            raise ConfigError(f"GPTQ quantization_config.dynamic override {pattern!r} gives modules their own scheme; "
                              "supported: one scheme for every module ('-:' exclusions only)")
        ignore.append("re:" + pattern[2:])
    return CheckpointWeightQuant("gptq", bits, _group_size(quant.get("group_size"), "group_size"),
                                 bool(quant.get("sym", True)), bool(quant.get("desc_act")), tuple(ignore), fmt)


def _compressed_tensors_quant(quant: dict) -> CheckpointWeightQuant | None:
    groups = quant.get("config_groups") or {}
    weights = {name: g.get("weights") or {} for name, g in groups.items()}
    if not weights:
        raise ConfigError("compressed-tensors quantization_config has no config_groups with weights")
    if all(w.get("type") == "float" and w.get("num_bits") == 8 for w in weights.values()):
        return None  # FP8: engine/fp8_checkpoint.py
    if all(is_ct_w8a8_int(group) for group in groups.values()):
        return None  # W8A8 INT8 (SmoothQuant as shipped): engine/fp8_checkpoint.py, an int8_sq engine
    if (quant.get("transform_config") or {}).get("config_groups"):
        raise ConfigError("compressed-tensors quantization_config.transform_config rotates the weights; "
                          "checkpoints with transforms are not supported")
    if (quant.get("sparsity_config") or {}).get("format", "dense") != "dense":
        raise ConfigError(f"compressed-tensors sparsity_config format {quant['sparsity_config']['format']!r} "
                          "is not supported; supported: dense")
    schemes = {}
    for name, group in groups.items():
        fmt = group.get("format") or quant.get("format")
        if fmt not in CT_FORMATS:
            raise ConfigError(f"compressed-tensors format {fmt!r} (config group {name!r}) is not supported; "
                              f"supported: {', '.join(CT_FORMATS)}")
        for field in ("input_activations", "output_activations"):
            if group.get(field):
                raise ConfigError(f"compressed-tensors group {name!r} quantizes {field} ({group[field].get('type')} "
                                  f"{group[field].get('num_bits')}-bit); supported: weight-only (W4A16, W8A16)")
        schemes[name] = (fmt, *_ct_weight_scheme(name, weights[name]))
    if len(set(schemes.values())) > 1:
        raise ConfigError(f"compressed-tensors config_groups use different schemes {schemes}; "
                          "supported: one weight scheme for every group")
    fmt, bits, group, symmetric, act_order = next(iter(schemes.values()))
    return CheckpointWeightQuant("compressed-tensors", bits, group, symmetric, act_order,
                                 tuple(quant.get("ignore") or ()), fmt)


def is_ct_w8a8_int(group: dict) -> bool:
    """A compressed-tensors config group of the int8_sq scheme (kernels/int8_sq.py): int8 weights per
    channel and int8 activations per token, dynamic, both symmetric (llm-compressor's W8A8 preset,
    usually after its SmoothQuantModifier)."""
    w, a = group.get("weights") or {}, group.get("input_activations") or {}
    return (w.get("type") == "int" and w.get("num_bits") == 8 and w.get("strategy") == "channel"
            and w.get("symmetric", True) and a.get("type") == "int" and a.get("num_bits") == 8
            and a.get("strategy") == "token" and bool(a.get("dynamic")) and a.get("symmetric", True)
            and not group.get("output_activations"))


def _ct_weight_scheme(name: str, w: dict) -> tuple[int, int, bool, bool]:
    """(bits, group size, symmetric, act-order) of one config group's weights."""
    where = f"compressed-tensors group {name!r} weights"
    if w.get("type", "int") != "int":
        raise ConfigError(f"{where} type {w.get('type')!r} {w.get('num_bits')}-bit is not supported here; "
                          "supported: int 4/8-bit, and float 8-bit (FP8, engine/fp8_checkpoint.py)")
    if w.get("num_bits") not in (4, 8):
        raise ConfigError(f"{where} num_bits {w.get('num_bits')} is not supported; supported: 4, 8")
    if w.get("dynamic"):
        raise ConfigError(f"{where} are dynamic; supported: static weight scales")
    strategy = w.get("strategy")
    if strategy == "group":
        group = _group_size(w.get("group_size"), f"config_groups.{name}.weights.group_size") or 0
        if not group:
            raise ConfigError(f"{where} strategy group has group_size {w.get('group_size')}; supported: "
                              f"{', '.join(map(str, GROUP_SIZES))}")
    elif strategy == "channel":
        group = 0
    else:
        raise ConfigError(f"{where} strategy {strategy!r} is not supported; supported: group, channel")
    actorder = _plain(w.get("actorder"))
    # "weight"/"static" reorder only during calibration: the stored groups stay contiguous.
    act_order = actorder in (True, "group", "dynamic")
    return w["num_bits"], group, bool(w.get("symmetric", True)), act_order


# ---- reading ---------------------------------------------------------------------------------

@dataclass
class QuantizedLinear:
    """One linear layer's stored quantization in the engine's scheme."""

    codes: torch.Tensor  # uint8 (N, K), in the checkpoint's column order
    scale: torch.Tensor  # float32 (N, K // G); per channel: (N, 1)
    zero: torch.Tensor  # uint8 (N, K // G)
    g_idx: torch.Tensor | None  # int32 (K,): each input column's group (act-order); None when k // G

    def dequantize(self) -> torch.Tensor:
        """The float32 weight (N, K) the layer stands for."""
        k, groups = self.codes.shape[1], self.scale.shape[1]
        index = self.g_idx.long() if self.g_idx is not None else torch.arange(k) // (k // groups)
        return (self.codes.float() - self.zero.float()[:, index]) * self.scale[:, index]


def unpack_int32(packed: torch.Tensor, bits: int, dim: int, count: int) -> torch.Tensor:
    """int32 words holding 32 // bits values each, lowest bits first, packed along ``dim`` ->
    uint8 values, the first ``count`` along ``dim``."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    words = packed.movedim(dim, -1)
    values = ((words[..., None] >> shifts) & ((1 << bits) - 1)).flatten(-2)[..., :count]
    return values.to(torch.uint8).movedim(-1, dim)


class QuantizedLinearReader:
    """Reads a checkpoint's quantized linear layers (by module name, e.g.
    ``model.layers.0.self_attn.q_proj`` or ``model.layers.0.mlp.experts.3.gate_proj``)."""

    def __init__(self, get: TensorGetter, quant: CheckpointWeightQuant):
        if quant.method not in METHODS:
            raise ConfigError(f"quantization method {quant.method!r} is not supported; supported: {', '.join(METHODS)}")
        self.get, self.quant = get, quant
        self._naive = quant.method == "compressed-tensors" and quant.version in ("naive-quantized", "int-quantized")
        self._quantized: dict[str, bool] = {}  # module -> is_quantized: a lookup loads the tensor

    def _packed_name(self, module: str) -> str:
        if self.quant.method == "compressed-tensors":
            return module + (".weight" if self._naive else ".weight_packed")
        return module + ".qweight"

    def _tensor(self, name: str, module: str) -> torch.Tensor:
        try:
            return self.get(name)
        except CheckpointError:
            raise CheckpointError(f"{name} is missing: the quantized module {module} needs it "
                                  f"({self.quant.describe()})") from None

    def _optional(self, name: str) -> torch.Tensor | None:
        try:
            return self.get(name)
        except CheckpointError:
            return None

    def is_quantized(self, module: str) -> bool:
        if module not in self._quantized:
            tensor = self._optional(self._packed_name(module))
            self._quantized[module] = tensor is not None and (not self._naive or tensor.dtype == torch.int8)
        return self._quantized[module]

    def read(self, module: str) -> QuantizedLinear:
        readers = {"awq": self._read_awq, "gptq": self._read_gptq, "compressed-tensors": self._read_ct}
        codes, scale, zero, g_idx = readers[self.quant.method](module)
        return QuantizedLinear(codes.contiguous(), scale.float().contiguous(), zero.contiguous(),
                               self._check_g_idx(g_idx, module, codes.shape[1], scale.shape[1]))

    def dequantized_getter(self) -> TensorGetter:
        """A getter serving each quantized module's ``<module>.weight`` as its float32 dequantized
        weight (N, K); every other name passes through."""
        def get(name: str) -> torch.Tensor:
            if name.endswith(".weight") and self.is_quantized(name[: -len(".weight")]):
                return self.read(name[: -len(".weight")]).dequantize()
            return self.get(name)

        return get

    # -- per format: (codes (N, K), scale (N, groups), zero (N, groups), g_idx or None) --

    def _groups(self, k: int, name: str) -> int:
        group = self.quant.group_size or k
        if k % group:
            raise CheckpointError(f"{name}: {k} input columns are not a multiple of the group size {group}")
        return k // group

    def _expect(self, tensor: torch.Tensor, shape: tuple, name: str, rule: str) -> None:
        if tuple(tensor.shape) != tuple(shape):
            raise CheckpointError(f"{name} has shape {tuple(tensor.shape)}; expected {tuple(shape)} ({rule})")

    def _read_awq(self, module: str):
        qweight = self._tensor(module + ".qweight", module)
        scales = self._tensor(module + ".scales", module)
        k, n = qweight.shape[0], scales.shape[-1]
        groups = self._groups(k, module + ".qweight")
        self._expect(qweight, (k, n // 8), module + ".qweight", f"K x N/8 for the {n} columns of scales")
        self._expect(scales, (groups, n), module + ".scales", f"K/G x N, K {k}")
        inverse = torch.tensor(AWQ_ORDER).argsort()  # stored nibble i -> column AWQ_ORDER[i]

        def unpack(packed):
            return unpack_int32(packed, 4, 1, n).reshape(-1, n // 8, 8)[..., inverse].reshape(-1, n).T

        qzeros = self._optional(module + ".qzeros")
        if qzeros is None and not self.quant.symmetric:
            self._tensor(module + ".qzeros", module)
        if qzeros is None:
            zero = torch.full((n, groups), 8, dtype=torch.uint8)
        else:
            self._expect(qzeros, (groups, n // 8), module + ".qzeros", "K/G x N/8")
            zero = unpack(qzeros)
        return unpack(qweight), scales.T, zero, None

    def _read_gptq(self, module: str):
        bits, per_word = self.quant.bits, 32 // self.quant.bits
        qweight = self._tensor(module + ".qweight", module)
        scales = self._tensor(module + ".scales", module)
        qzeros = self._tensor(module + ".qzeros", module)
        k, n = qweight.shape[0] * per_word, qweight.shape[1]
        groups = self._groups(k, module + ".qweight")
        self._expect(scales, (groups, n), module + ".scales", f"K/G x N for the {k} x {n} weight of qweight")
        self._expect(qzeros, (groups, -(-n // per_word)), module + ".qzeros", f"K/G x N*{bits}/32")
        zero = unpack_int32(qzeros, bits, 1, n)
        if self.quant.version == "gptq":
            zero = (zero.int() + 1) % (1 << bits)  # v1 stores zero - 1
        g_idx = self._optional(module + ".g_idx")
        if g_idx is None and self.quant.act_order:
            self._tensor(module + ".g_idx", module)
        return unpack_int32(qweight, bits, 0, k).T, scales.T, zero.to(torch.uint8).T, g_idx

    def _read_ct(self, module: str):
        bits, offset = self.quant.bits, 1 << (self.quant.bits - 1)
        scale = self._tensor(module + ".weight_scale", module)
        if self._naive:
            weight = self._tensor(module + ".weight", module)
            if weight.dtype != torch.int8 or weight.int().min() < -offset or weight.int().max() >= offset:
                raise CheckpointError(f"{module}.weight must hold int8 codes in [{-offset}, {offset}) for "
                                      f"{self.quant.describe()}; got {weight.dtype}")
            codes = (weight.int() + offset).to(torch.uint8)
        else:
            packed = self._tensor(module + ".weight_packed", module)
            shape = self._optional(module + ".weight_shape")
            n, k = (int(s) for s in shape) if shape is not None else (packed.shape[0], packed.shape[1] * 32 // bits)
            self._expect(packed, (n, -(-k * bits // 32)), module + ".weight_packed",
                         f"N x ceil(K*{bits}/32) for weight_shape {(n, k)}")
            codes = unpack_int32(packed, bits, 1, k)
        n, k = codes.shape
        groups = self._groups(k, module + ".weight_scale")
        self._expect(scale, (n, groups), module + ".weight_scale", f"N x K/G for a {n} x {k} weight")
        zero = torch.full((n, groups), offset, dtype=torch.uint8)
        if not self.quant.symmetric:
            zero = self._ct_zero(self._tensor(module + ".weight_zero_point", module), n, groups, module)
        g_idx = self._optional(module + ".weight_g_idx")
        if g_idx is None and self.quant.act_order:
            self._tensor(module + ".weight_g_idx", module)
        return codes, scale, zero, g_idx

    def _ct_zero(self, stored: torch.Tensor, n: int, groups: int, module: str) -> torch.Tensor:
        """compressed-tensors' signed zero points -> unsigned zeros (N, groups)."""
        bits, offset, name = self.quant.bits, 1 << (self.quant.bits - 1), module + ".weight_zero_point"
        if stored.dtype == torch.int32 and not self._naive:  # packed along N, offset like the codes
            self._expect(stored, (-(-n * bits // 32), groups), name, f"ceil(N*{bits}/32) x K/G, packed along N")
            return unpack_int32(stored, bits, 0, n)
        self._expect(stored, (n, groups), name, "N x K/G")
        if stored.int().min() < -offset or stored.int().max() >= offset:
            raise CheckpointError(f"{name} holds values outside [{-offset}, {offset})")
        return (stored.int() + offset).to(torch.uint8)

    def _check_g_idx(self, g_idx: torch.Tensor | None, module: str, k: int, groups: int) -> torch.Tensor | None:
        if g_idx is None:
            return None
        name = f"{module}.{'weight_g_idx' if self.quant.method == 'compressed-tensors' else 'g_idx'}"
        self._expect(g_idx, (k,), name, "one group index per input column")
        g_idx = g_idx.to(torch.int32)
        if g_idx.min() < 0 or g_idx.max() >= groups:
            raise CheckpointError(f"{name} holds group indices in [{int(g_idx.min())}, {int(g_idx.max())}]; "
                                  f"the layer has {groups} groups (valid: 0..{groups - 1})")
        sequential = torch.arange(k, dtype=torch.int32) // (k // groups)
        return None if torch.equal(g_idx, sequential) else g_idx
