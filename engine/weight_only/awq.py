"""AWQ (activation-aware weight quantization, Lin et al. 2023) as a float-to-float transform of a
Hugging Face model, run before the engine build's round-to-nearest (``--quantization int4_awq``).

What it does to each decoder layer, on a float32 copy, with inputs from a short calibration text:

1. Scales. Linears that read the same input form a group: (input_layernorm -> q, k, v),
   (v -> o, only without grouped-query attention: with it one v channel feeds several o columns),
   (post_attention_layernorm -> gate, up), (up -> down). For each group, per input channel c,
   s[c] = mean|x[:, c]| ** alpha normalised by sqrt(max(s) * min(s)); alpha is searched over
   0, 1/20, ..., 19/20 for the smallest || Q(W * s) (x / s) - W x ||^2 over the group's outputs,
   where Q is kernels.wna16's asymmetric round-to-nearest (quantize, then dequantize). The best s
   is folded in: the consumers' columns are multiplied by s, the producer's output channels (the
   norm's weight, or the rows of v / up) divided by it, so the float layer computes the same
   function while its salient input channels get finer quantization steps. alpha = 0 (s = 1) is
   plain RTN, so the search never does worse than RTN on the captured rows.
2. Clipping. For each of v, o, gate, up, down (not q and k: their errors go through the softmax,
   and AWQ leaves them whole; o too where GQA leaves it unscaled), each (row, group) of the weight is clamped to +-r * max|w| of the group,
   r in 1, 0.95, ..., 0.55, choosing r for the smallest error of that group's partial products
   on the captured inputs. This changes the float function slightly, by design.

Choices and scope:
- Calibration data: ``calibration_text.CALIBRATION_TEXT`` (or ``text``), its sections dealt into a
  few sequences of one length, ``max_tokens`` tokens in all (512 by default, as AutoAWQ's sequence).
- The scale search's loss is over the group's own linear outputs (as above); AutoAWQ measures the
  attention block's / MLP's output instead, which costs a full sub-module forward per alpha.
- Every layer is fed the outputs of the *original* float layers before it (the captured hidden
  states of the untransformed model), which is what AutoAWQ's loop computes in practice: it
  records a layer's output before transforming that layer.
- Llama-style layers (``self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``,
  ``input_layernorm``, ``post_attention_layernorm``): Llama, Mistral, Qwen2 (q/k/v biases stay, the
  scaling is on the input side), Qwen3 (q_norm/k_norm act on outputs, untouched); Phi-3's fused
  ``qkv_proj`` / ``gate_up_proj`` (the v and up rows are the fused modules' slices); Gemma's
  (1 + w) norms (the offset is found by probing the norm) and Gemma 2/3's
  ``pre_feedforward_layernorm``. Mixture-of-experts layers (``mlp.experts``): only attention is
  transformed, the experts and the router stay as they are (plain RTN later). The embeddings, the
  final norm and lm_head are never touched, so tied embeddings stay tied.
- After the scales are folded, the layer is run again on its inputs and must give the same
  output: a layer whose wiring differs from what the module names suggest is refused rather than
  silently changed.
- The result is a float32 copy of the whole state dict on the CPU; only one layer at a time is
  copied to ``device``. A half-precision model's layer-0 inputs and rotary tables are recorded in
  its dtype, everything after that runs in float32.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm import tqdm

from engine.config import ConfigError
from engine.weight_only.calibration_text import CALIBRATION_TEXT
from kernels.wna16 import round_to_nearest

SCALE_GRID = 20  # alpha in 0, 1/20, ..., 19/20
CLIP_GRID = 20
CLIP_STEPS = 10  # clip ratios 1, 0.95, ..., 0.55: AutoAWQ's max shrink of one half
CLIP_MAX_ROWS = 512  # calibration rows the clip search samples (evenly)
CLIP_ROW_BATCH = 256  # weight rows searched at once, to bound the (rows, tokens, groups) errors
CALIBRATION_SEQUENCES = 4
FOLD_TOLERANCE = 1e-3  # max |output change| / max |output| allowed after folding the scales
CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value")


def fake_quantize(weight: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """The weight (N, K) after asymmetric RTN quantization and dequantization, float32: exactly
    ``dequantize(*quantize(weight, bits, group_size, symmetric=False), bits)``, without packing and
    unpacking the codes (the searches call it ~8,000 times for a 135M model: 30% of the build)."""
    codes, scale, zero = round_to_nearest(weight, bits, group_size, symmetric=False)
    return ((codes - zero[..., None]) * scale[..., None]).reshape(weight.shape)


# ---- which modules feed which ---------------------------------------------------------------

@dataclass(eq=False)  # hashed by identity, like the modules it sits beside in dicts
class Rows:
    """Output channels ``rows`` of ``linear``: the v part of a fused qkv, the up part of gate_up."""

    linear: nn.Linear
    rows: slice = field(default_factory=lambda: slice(None))

    def weight(self) -> torch.Tensor:
        return self.linear.weight.data[self.rows]

    def channels(self) -> int:
        return len(range(self.linear.out_features)[self.rows])


@dataclass
class ScaleGroup:
    """Linears reading the same input, and the producer of that input (a norm or ``Rows``)."""

    name: str
    producer: nn.Module | Rows
    consumers: list[nn.Linear]


@dataclass
class LayerPlan:
    """What AWQ touches in one decoder layer: the scale groups in order, the clip targets."""

    groups: list[ScaleGroup]
    clip: list[Rows]
    captured: list[nn.Module] = field(default_factory=list)  # the modules whose inputs are recorded


def _attention_parts(attn: nn.Module, text_config, architecture: str) -> tuple[list[nn.Linear], Rows]:
    """(the linears reading the attention input, v's rows)."""
    if hasattr(attn, "qkv_proj"):
        heads = text_config.num_attention_heads
        kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
        head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        return [attn.qkv_proj], Rows(attn.qkv_proj, slice(q_size + kv_size, q_size + 2 * kv_size))
    if all(hasattr(attn, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj")):
        return [attn.q_proj, attn.k_proj, attn.v_proj], Rows(attn.v_proj)
    raise ConfigError(f"AWQ calibration does not support {architecture}: its attention has neither "
                      "q_proj/k_proj/v_proj/o_proj nor a fused qkv_proj")


def _mlp_parts(mlp: nn.Module) -> tuple[list[nn.Linear], Rows, nn.Linear] | None:
    """(the linears reading the MLP input, up's rows, down), or None where the MLP is left alone."""
    if hasattr(mlp, "gate_up_proj") and isinstance(mlp.gate_up_proj, nn.Linear):
        intermediate = mlp.gate_up_proj.out_features // 2  # Phi-3 chunks gate first, then up
        return [mlp.gate_up_proj], Rows(mlp.gate_up_proj, slice(intermediate, 2 * intermediate)), mlp.down_proj
    if all(isinstance(getattr(mlp, name, None), nn.Linear) for name in ("gate_proj", "up_proj", "down_proj")):
        return [mlp.gate_proj, mlp.up_proj], Rows(mlp.up_proj), mlp.down_proj
    return None


def layer_plan(layer: nn.Module, text_config, architecture: str) -> LayerPlan:
    """The scale groups and clip targets of a Llama-style decoder layer (module docstring)."""
    attn = layer.self_attn
    qkv, v_rows = _attention_parts(attn, text_config, architecture)
    groups = [ScaleGroup("input_layernorm -> qkv", layer.input_layernorm, qkv)]
    if v_rows.channels() == attn.o_proj.in_features:  # no GQA: v channel c is o's input column c
        groups.append(ScaleGroup("v -> o", v_rows, [attn.o_proj]))
    clip = [v_rows, Rows(attn.o_proj)]
    mlp = getattr(layer, "mlp", None)
    parts = None if mlp is None or hasattr(mlp, "experts") else _mlp_parts(mlp)
    if mlp is not None and not hasattr(mlp, "experts") and parts is None:
        raise ConfigError(f"AWQ calibration does not support {architecture}: its MLP has neither "
                          "gate_proj/up_proj/down_proj nor a fused gate_up_proj")
    if parts is not None:
        gate_up, up_rows, down = parts
        # Gemma 2/3 normalise the attention output with post_attention_layernorm; their MLP input
        # comes from pre_feedforward_layernorm.
        mlp_norm = getattr(layer, "pre_feedforward_layernorm", None)
        mlp_norm = layer.post_attention_layernorm if mlp_norm is None else mlp_norm
        groups += [ScaleGroup("mlp norm -> gate, up", mlp_norm, gate_up), ScaleGroup("up -> down", up_rows, [down])]
        clip += [Rows(linear) for linear in gate_up] + [Rows(down)]
    norms = [g.producer for g in groups if not isinstance(g.producer, Rows)]
    return LayerPlan(groups, clip, list(dict.fromkeys(qkv + [attn.o_proj] + [r.linear for r in clip] + norms)))


# ---- the searches ---------------------------------------------------------------------------

def search_scale(x: torch.Tensor, weight: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """x (T, K) the group's captured input, weight (N, K) its consumers stacked -> the best per-input
    channel scale (K,) (module docstring, step 1)."""
    reference = x @ weight.T
    magnitude = x.abs().mean(dim=0)
    best_loss, best_scale = float("inf"), torch.ones_like(magnitude)
    for step in range(SCALE_GRID):
        scale = magnitude.pow(step / SCALE_GRID).clamp(min=1e-4)
        scale = scale / (scale.max() * scale.min()).sqrt()
        scale = torch.where(torch.isfinite(scale), scale, torch.ones_like(scale))
        output = (x / scale) @ fake_quantize(weight * scale, bits, group_size).T
        loss = (output - reference).pow(2).mean().item()
        if loss < best_loss:
            best_loss, best_scale = loss, scale
    return best_scale


def search_clip(x: torch.Tensor, weight: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """x (T, K), weight (N, K) -> the clip limit (N, K // group_size) of each row's group (module
    docstring, step 2)."""
    x = x[:: max(1, x.shape[0] // CLIP_MAX_ROWS)][:CLIP_MAX_ROWS]
    n, k = weight.shape
    x_groups = x.reshape(x.shape[0], k // group_size, group_size)
    limits = []
    for start in range(0, n, CLIP_ROW_BATCH):
        rows = weight[start:start + CLIP_ROW_BATCH].reshape(-1, k // group_size, group_size)
        reference = torch.einsum("tgj,ngj->ntg", x_groups, rows)
        largest = rows.abs().amax(dim=-1)
        best_limit, best_error = largest.clone(), torch.full_like(largest, float("inf"))
        for step in range(CLIP_STEPS):
            limit = largest * (1 - step / CLIP_GRID)
            clipped = torch.clamp(rows, -limit[..., None], limit[..., None])
            quantized = fake_quantize(clipped.reshape(-1, k), bits, group_size).reshape(rows.shape)
            error = (torch.einsum("tgj,ngj->ntg", x_groups, quantized) - reference).pow(2).mean(dim=1)
            better = error < best_error
            best_error = torch.where(better, error, best_error)
            best_limit = torch.where(better, limit, best_limit)
        limits.append(best_limit)
    return torch.cat(limits)


# ---- folding --------------------------------------------------------------------------------

def _norm_offset(norm: nn.Module, x: torch.Tensor) -> float:
    """1.0 for norms that multiply by (1 + weight) (Gemma), 0.0 for plain ``weight *``: a copy with
    zero weight (and bias) gives zeros only in the second case."""
    probe = copy.deepcopy(norm)
    for parameter in probe.parameters():
        parameter.data.zero_()
    with torch.no_grad():
        return 0.0 if probe(x[:4]).abs().max().item() == 0 else 1.0


def fold_scale(group: ScaleGroup, scale: torch.Tensor, norm_input: torch.Tensor | None) -> None:
    """Divide the producer's output channels by ``scale`` and multiply the consumers' columns by it
    (``norm_input``: rows the producer norm reads, for probing its convention)."""
    producer = group.producer
    if isinstance(producer, Rows):
        producer.linear.weight.data[producer.rows] /= scale[:, None]
        if producer.linear.bias is not None:
            producer.linear.bias.data[producer.rows] /= scale
    else:
        offset = _norm_offset(producer, norm_input)
        producer.weight.data = (producer.weight.data + offset) / scale - offset
        if getattr(producer, "bias", None) is not None:
            producer.bias.data /= scale
    for linear in group.consumers:
        linear.weight.data *= scale


def _check_group_sizes(layer: nn.Module, plan: LayerPlan, group_size: int, where: str) -> None:
    names = {module: name for name, module in layer.named_modules()}
    for linear in (m for m in plan.captured if isinstance(m, nn.Linear)):
        if linear.in_features % group_size:
            raise ConfigError(f"{where}: group size {group_size} does not divide the {linear.in_features} input "
                              f"columns of {names[linear]}; choose one that divides every quantized linear's inputs")


# ---- running the layers ---------------------------------------------------------------------

def decoder_layers(hf_model: nn.Module) -> tuple[str, nn.ModuleList]:
    """(state-dict prefix, the decoder layers) of a Llama-style causal LM."""
    for name, module in hf_model.named_modules():
        if isinstance(module, nn.ModuleList) and name.endswith("layers") and len(module) \
                and hasattr(module[0], "self_attn") and hasattr(module[0], "input_layernorm"):
            return name, module
    raise ConfigError(f"AWQ calibration does not support {architecture_name(hf_model)}: no decoder layers with "
                      "self_attn and input_layernorm (Llama-style) were found")


def architecture_name(hf_model: nn.Module) -> str:
    architectures = getattr(hf_model.config, "architectures", None) or [type(hf_model).__name__]
    return architectures[0]


def calibration_ids(tokenizer, text: str, max_tokens: int) -> torch.Tensor:
    """(sequences, length) token ids: the text's blank-line separated sections dealt into up to
    CALIBRATION_SEQUENCES contiguous chunks of similar size, each tokenized and cut to one length,
    at most ``max_tokens`` in all."""
    sections = [s for s in text.split("\n\n") if s.strip()]
    if not sections or max_tokens < 1:
        raise ValueError("AWQ calibration needs a non-empty text and max_tokens >= 1")
    count = min(CALIBRATION_SEQUENCES, len(sections), max_tokens)
    total, done, chunks = sum(map(len, sections)), 0, [[] for _ in range(count)]
    for section in sections:
        chunks[min(count - 1, done * count // total)].append(section)
        done += len(section)
    ids = [list(tokenizer("\n\n".join(chunk))["input_ids"]) for chunk in chunks if chunk]
    length = min(min(map(len, ids)), max_tokens // len(ids))
    return torch.tensor([row[:length] for row in ids])


def _to_device(value, device: torch.device):
    if isinstance(value, torch.Tensor):
        return value.to(device, torch.float32 if value.is_floating_point() else value.dtype)
    if isinstance(value, (tuple, list)):
        return type(value)(_to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    return value


@torch.no_grad()
def layer_calls(hf_model: nn.Module, layers: nn.ModuleList, input_ids: torch.Tensor
                ) -> tuple[torch.Tensor, list[tuple[tuple, dict]]]:
    """One forward of the model -> (layer 0's hidden states, each layer's other call arguments).
    Each layer's own are kept: masks and rotary tables differ per layer type (sliding or global)."""
    calls: list = [None] * len(layers)
    first_hidden: list[torch.Tensor] = []

    def recorder(index: int):
        def record(module, args, kwargs):
            kwargs = dict(kwargs)
            hidden = args[0] if args else kwargs.pop("hidden_states")
            if index == 0:
                first_hidden.append(hidden.detach())
            kwargs.update({name: None for name in CACHE_ARGUMENTS if name in kwargs})
            if "use_cache" in kwargs:
                kwargs["use_cache"] = False
            calls[index] = (tuple(args[1:]), kwargs)
        return record

    handles = [layer.register_forward_pre_hook(recorder(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        device = next(hf_model.parameters()).device
        hf_model(input_ids=input_ids.to(device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return first_hidden[0], calls


def _run_layer(layer: nn.Module, hidden: torch.Tensor, call: tuple[tuple, dict]) -> torch.Tensor:
    output = layer(hidden, *call[0], **call[1])
    return output[0] if isinstance(output, tuple) else output


@torch.no_grad()
def _capture_inputs(layer: nn.Module, modules: list[nn.Module], hidden: torch.Tensor, call
                    ) -> tuple[torch.Tensor, dict[nn.Module, torch.Tensor]]:
    """Run the layer -> (its output, each module's input as (rows, features))."""
    captured: dict[nn.Module, list[torch.Tensor]] = {module: [] for module in modules}
    handles = [module.register_forward_hook(
        lambda module, args, output: captured[module].append(args[0].detach().reshape(-1, args[0].shape[-1])))
        for module in modules]
    try:
        output = _run_layer(layer, hidden, call)
    finally:
        for handle in handles:
            handle.remove()
    return output, {linear: torch.cat(parts) for linear, parts in captured.items()}


@torch.no_grad()
def transform_layer(layer: nn.Module, plan: LayerPlan, hidden: torch.Tensor, call, *, bits: int,
                    group_size: int, clip: bool, where: str, scale_fn=None) -> torch.Tensor:
    """Fold AWQ's scales into ``layer`` (float32, in place) and clip it; returns the layer's original
    output, the next layer's input. ``scale_fn(x, weight)``: the scales of a group from its input
    rows and stacked weights instead of AWQ's search (SmoothQuant's closed form)."""
    output, inputs = _capture_inputs(layer, plan.captured, hidden, call)
    for group in plan.groups:
        x = inputs[group.consumers[0]]
        weight = torch.cat([linear.weight.data for linear in group.consumers])
        scale = search_scale(x, weight, bits, group_size) if scale_fn is None else scale_fn(x, weight)
        fold_scale(group, scale, inputs.get(group.producer))
        for linear in group.consumers:  # what each consumer reads from now on
            inputs[linear] = inputs[linear] / scale
    change = (_run_layer(layer, hidden, call) - output).abs().max() / output.abs().max().clamp(min=1e-30)
    if change > FOLD_TOLERANCE:
        raise ConfigError(f"{where}: folding the smoothing scales changed the layer's output by {change:.2e} "
                          "(relative); "
                          "its wiring differs from the Llama-style layout this transform assumes")
    if clip:
        for target in plan.clip:
            weight = target.weight()
            limit = search_clip(inputs[target.linear], weight, bits, group_size)
            groups = weight.reshape(*limit.shape, group_size)
            target.linear.weight.data[target.rows] = torch.clamp(groups, -limit[..., None], limit[..., None]) \
                .reshape(weight.shape)
    return output


def awq_transform(hf_model, tokenizer, *, bits: int = 4, group_size: int = 128, text: str | None = None,
                  max_tokens: int = 512, device=None, progress: bool = False, clip: bool = True, scale_fn=None,
                  name: str = "AWQ") -> dict[str, torch.Tensor]:
    """The model's state dict (HF names, float32) with AWQ's scales folded in and weights clipped.

    ``hf_model`` is not modified: each decoder layer is transformed on a float32 copy on ``device``
    (CPU by default). ``text`` replaces the built-in calibration sample; ``clip=False`` folds the
    scales only (the float model's function is then unchanged up to rounding). ``scale_fn``: see
    ``transform_layer`` (engine/weight_only/smoothquant.py); ``group_size`` 0 skips the group check.
    """
    device = torch.device(device or "cpu")
    architecture = architecture_name(hf_model)
    text_config = hf_model.config.get_text_config()
    prefix, layers = decoder_layers(hf_model)
    state = {name: (t.detach().to("cpu", torch.float32) if t.is_floating_point() else t.detach().cpu()).clone()
             for name, t in hf_model.state_dict().items()}
    input_ids = calibration_ids(tokenizer, CALIBRATION_TEXT if text is None else text, max_tokens)
    hidden, calls = layer_calls(hf_model, layers, input_ids)
    hidden = _to_device(hidden, device)
    for index in tqdm(range(len(layers)), desc=name, unit="layer", disable=not progress):
        layer = copy.deepcopy(layers[index]).to(device=device, dtype=torch.float32).eval()
        plan = layer_plan(layer, text_config, architecture)
        where = f"{architecture} layer {index}"
        if group_size:
            _check_group_sizes(layer, plan, group_size, where)
        hidden = transform_layer(layer, plan, hidden, _to_device(calls[index], device), bits=bits,
                                 group_size=group_size, clip=clip, where=where, scale_fn=scale_fn)
        for name, tensor in layer.state_dict().items():
            if f"{prefix}.{index}.{name}" in state:
                state[f"{prefix}.{index}.{name}"] = tensor.detach().to("cpu", torch.float32).clone()
    return state
