"""EAGLE-3 drafting heads (Li et al. 2025) in their published checkpoint format, drafting a token tree
for tree verification: in the in-flight executor (``decoding_mode eagle``: Eagle3DraftProposer) and
for one sequence through tree_step.py's ``TreeDecoder`` (Eagle3TreeProposer).

The draft is one Llama decoder layer over the target's own features:

    g_t = fc([low_t ; mid_t ; high_t])                     (3H -> H; the target's residual stream
                                                            after three of its layers, at token t)
    a_t = [input_layernorm(embed(x_{t+1})) ; hidden_norm(g_t)]        (2H: q/k/v read 2H)
    h_t = g_t + o_proj(attention(a_<=t));  h_t += mlp(post_attention_layernorm(h_t))
    draft logits_t = lm_head(norm(h_t))  over draft_vocab_size ids; target id = id + d2t[id]

h_t guesses x_{t+2}. Deeper drafts feed h back as the next position's g (EAGLE's "training-time
test"). Checkpoint (EAGLE-3 authors' / SpecForge layout): ``config.json`` (hidden_size,
intermediate_size, num_attention_heads, num_key_value_heads, head_dim, rms_norm_eps, rope_theta,
vocab_size, draft_vocab_size; optional eagle_config.eagle_aux_hidden_state_layer_ids) and
``model.safetensors`` with ``fc.weight``, ``midlayer.{hidden_norm,input_layernorm,
post_attention_layernorm}.weight``, ``midlayer.self_attn.{q,k,v,o}_proj.weight``,
``midlayer.mlp.{gate,up,down}_proj.weight``, ``norm.weight``, ``lm_head.weight``, ``d2t`` (and
``t2d``, unused here). The token embedding is the target's.

The executor's proposer keeps the draft layer's KV cache and drafts static or dynamic (EAGLE-2)
trees (speculative/eagle3_drafter.py); the one-sequence TreeDecoder proposer recomputes the layer
over the whole sequence per drafted depth (``draft_tree``: the plain reference the cached drafter is
tested against). The target's layers are tapped by engine/executor/layer_taps.py, CUDA graph
replays included.
"""
from __future__ import annotations

import copy
import json
import os

import torch
from safetensors.torch import load_file

from engine.executor.layer_taps import LayerTaps
from engine.executor.speculative.device_drafts import DeviceDrafts, device_drafts_enabled
from engine.executor.speculative.eagle3_drafter import DraftCache, StaticPlan, draft_dynamic, draft_static
from engine.executor.speculative.eagle3_graphs import StaticDraftGraphs, eagle_graphs_enabled
from engine.executor.speculative.proposer import ProposerConfigError, draft_room, refuse_unless_one_rank_without_state
from engine.executor.speculative.tree import TreeChoicesError, parse_choices, shape_from_choices
from kernels.fp8 import choose_fp8_skinny_variants, fp8_gated_linear, fp8_linear, quantize_weight
from kernels.linear import choose_gated_weights, choose_skinny_weights, gated_linear, linear, linear_float32_out
from kernels.rmsnorm import rms_norm
from kernels.rotary import apply_rotary

DEFAULT_EAGLE_CHOICES = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
REQUIRED_CONFIG = ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads")
REQUIRED_WEIGHTS = ("fc.weight", "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
                    "midlayer.post_attention_layernorm.weight", *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
                    *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")), "norm.weight",
                    "lm_head.weight", "d2t")


class Eagle3ConfigError(ValueError):
    """A checkpoint that does not fit the target (the message names the field)."""


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama's RMSNorm of x (..., H) (+ residual first, when given; in float32, as the EAGLE-3 authors'
    layer) -> (normed, x + residual): kernels/rmsnorm.py, one launch on CUDA (the eager form was six)."""
    shape = x.shape
    out, summed = rms_norm(x.reshape(-1, shape[-1]), weight, eps,
                           None if residual is None else residual.reshape(-1, shape[-1]))
    return out.reshape(shape), summed.reshape(shape)


# The head's products (names of Eagle3Head.products): an FP8 head holds these in E4M3 (the norms stay).
PRODUCTS = ("fc", "qkv", "o", "gate_up", "down", "lm_head")


class Eagle3Head:
    """The draft layer's weights (``dtype`` on ``device``: float32 on the CPU, the target's dtype on a
    GPU) and its forward, whole sequences at once (``forward``) or in the pieces a KV cache of the
    draft layer needs (``qkv``, ``attend``, ``finish``, ``logits``: speculative/eagle3_drafter.py).

    ``fp8``: the six products' weights (fc, qkv, o, gate_up, down, lm_head: all but the norms) held
    in E4M3 with one float32 scale per output row, quantized here from the published bf16 head
    (kernels/fp8.py quantize_weight, the target's ``--quantization fp8`` scheme) and multiplied by
    kernels/fp8.py's W8A8 products (CUDA: the skinny FP8 kernel / cuBLASLt; CPU: the reference,
    dequantize then matmul). Drafting reads the weights once per drafted depth, so this halves the
    bytes a proposal reads; the drafts may differ from the bf16 head's, the verified ids do not."""

    def __init__(self, config: dict, state: dict[str, torch.Tensor], device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, fp8: bool = False):
        self.config, self.dtype, self.fp8 = config, dtype, fp8
        self.w = {k: v.to(device=device, dtype=dtype) for k, v in state.items() if k not in ("d2t", "t2d")}
        self.eps, self.theta = float(config.get("rms_norm_eps", 1e-6)), float(config.get("rope_theta", 10000.0))
        self.num_heads, self.num_kv_heads = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
        self.head_dim = int(config.get("head_dim") or config["hidden_size"] // self.num_heads)
        self.d2t = state["d2t"].long().to(device)
        # fewer launches per drafted depth: q, k, v in one product, gate and up in another (the
        # separate q..up copies are dropped: only the fused ones are read)
        w = self.w
        self.products = {
            "fc": w.pop("fc.weight"),
            "qkv": torch.cat([w.pop(f"midlayer.self_attn.{p}_proj.weight") for p in "qkv"]),
            "o": w.pop("midlayer.self_attn.o_proj.weight"),
            "gate_up": torch.cat([w.pop("midlayer.mlp.gate_proj.weight"), w.pop("midlayer.mlp.up_proj.weight")]),
            "down": w.pop("midlayer.mlp.down_proj.weight"), "lm_head": w.pop("lm_head.weight")}
        self.hidden_size = self.products["fc"].shape[0]
        # name -> (N,) float32 row scales of an FP8 head's E4M3 weights; empty for a head in ``dtype``
        self.scales: dict[str, torch.Tensor] = {}
        if fp8:
            for name in PRODUCTS:
                self.products[name], self.scales[name] = quantize_weight(self.products[name])
        self._cos_sin = torch.empty(0, self.head_dim, device=device)  # (positions, [cos | sin] of head_dim / 2)

    def choose_kernels(self) -> dict:
        """On CUDA, the skinny-GEMM kernel (kernels/linear.py, as the target's decode products) for each
        of the layer's products where the load-time timing at 1 and 8 rows finds it faster than the
        library: a proposal's products have 1 to ~16 rows a sequence (the root, a depth's expanded
        nodes). Before the drafting graphs are recorded (they capture the choice). A no-op elsewhere."""
        p = self.products
        plain = [p["qkv"], p["o"], p["down"], p["lm_head"]]
        if self.fp8:  # (the target's FP8 engines choose their tilings so: engine/executor/runner.py)
            chosen = choose_fp8_skinny_variants(plain, gated=[p["gate_up"]])
            return {("fp8",) + key: {"variant": variant} for key, variant in chosen.items()}
        choices = choose_skinny_weights(plain)
        choices.update({("gated",) + shape: choice for shape, choice in choose_gated_weights([p["gate_up"]]).items()})
        return choices

    def product(self, name: str, x: torch.Tensor, *, gated: bool = False, float32_out: bool = False) -> torch.Tensor:
        """x (..., K) times the ``name`` product's weight (N, K).T as 2-D rows (the skinny kernels count
        x's first dimension as rows) -> (..., N): kernels/linear.py's products (linear, gated_linear:
        silu(gate) * up, linear_float32_out), or kernels/fp8.py's W8A8 ones for an FP8 head (the
        float32 logits there too: the accumulators as they are, not rounded to x's dtype)."""
        weight, scale, rows = self.products[name], self.scales.get(name), x.reshape(-1, x.shape[-1])
        if scale is not None:
            out = (fp8_gated_linear(rows, weight, scale) if gated else
                   fp8_linear(rows, weight, scale, out_dtype=torch.float32 if float32_out else None))
        else:
            out = (gated_linear if gated else linear_float32_out if float32_out else linear)(rows, weight)
        return out.reshape(*x.shape[:-1], -1)

    def features(self, low: torch.Tensor, mid: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
        """The target's three streams (T, H) each -> g (T, H)."""
        if not self.fp8:  # (one library product: a chunk's rows, or a step's few)
            return torch.cat([low, mid, high], dim=-1).to(self.dtype) @ self.products["fc"].T
        return self.product("fc", torch.cat([low, mid, high], dim=-1).to(self.dtype))

    def qkv(self, embeds: torch.Tensor, g: torch.Tensor, first_position: int, same_position: bool = False
            ) -> tuple[torch.Tensor, ...]:
        """Rows of x_{t+1}'s embedding and g_t at positions first_position, first_position + 1, ...
        (all at first_position when ``same_position``: a tree's nodes of one depth) -> rotated q
        (T, heads, d), k and v (T, kv_heads, d): a row's k and v depend on nothing else (one layer),
        so a cache keeps them."""
        T, device = embeds.shape[0], self._cos_sin.device
        self.cos_sin(first_position, T, same_position)  # (grows the table to these positions)
        positions = (torch.full((T,), first_position, device=device) if same_position
                     else torch.arange(first_position, first_position + T, device=device))
        return self.qkv_at(embeds, g, positions, self._cos_sin)

    def qkv_at(self, embeds: torch.Tensor, g: torch.Tensor, positions: torch.Tensor, table: torch.Tensor
               ) -> tuple[torch.Tensor, ...]:
        """``qkv`` with each row's position given (T,) on the device and the [cos | sin] rows of
        ``table`` (positions, head_dim) (eagle3_graphs.py: positions that live in tensors)."""
        w, T = self.w, embeds.shape[0]
        a = torch.cat([_rms(embeds.to(self.dtype), w["midlayer.input_layernorm.weight"], self.eps)[0],
                       _rms(g, w["midlayer.hidden_norm.weight"], self.eps)[0]], dim=-1)
        heads, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qk, v = self.product("qkv", a).split([(heads + kv) * d, kv * d], dim=-1)
        # q's and k's heads rotated together (kernels/rotary.py: one launch on CUDA, in place there)
        q, k = apply_rotary(*qk.reshape(T, heads + kv, d).split([heads, kv], dim=1), positions, table)
        return q, k, v.reshape(T, kv, d)

    def cos_sin(self, first: int, count: int, same: bool = False) -> torch.Tensor:
        """(count, head_dim) float32 [cos | sin] rows of positions first.. (or of first, ``same``) from
        a table grown by doubling: slices, so no index tensor crosses to the device."""
        top = first + (1 if same else count)
        if top > self._cos_sin.shape[0]:
            size = max(top, 2 * self._cos_sin.shape[0], 64)
            half = self.head_dim // 2
            device = self._cos_sin.device
            inv = 1.0 / self.theta ** (torch.arange(half, dtype=torch.float32, device=device) / half)
            angles = torch.arange(size, dtype=torch.float32, device=device)[:, None] * inv[None]
            self._cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)
        return self._cos_sin[first:first + 1].expand(count, -1) if same else self._cos_sin[first:first + count]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """q (R, heads, d) over keys k, v (S, kv_heads, d); mask (R, S) bool (True: seen) or None for
        causal rows ending at the last key -> (R, heads * d). Batched (eagle3_graphs.py: a window's
        slots): q (B, R, heads, d), k, v (B, S, kv_heads, d), mask (B, R, S) -> (B, R, heads * d)."""
        causal = mask is None and q.shape[-3] == k.shape[-3]
        if mask is not None and mask.dim() == 3:
            mask = mask[:, None]  # (B, 1, R, S): the same for every head
        attn = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(-3, -2), k.transpose(-3, -2), v.transpose(-3, -2), attn_mask=mask, is_causal=causal,
            enable_gqa=self.num_heads != self.num_kv_heads)
        return attn.transpose(-3, -2).reshape(*q.shape[:-2], -1)

    def finish(self, g: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The layer's output h (R, H) from its input stream g and its attention rows."""
        w = self.w
        normed, h = _rms(self.product("o", attn), w["midlayer.post_attention_layernorm.weight"], self.eps,
                         residual=g)  # h = g + o(attn)
        return h + self.product("down", self.product("gate_up", normed, gated=True))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h (R, H) -> float32 draft-vocabulary logits (R, draft_vocab); target id = id + d2t[id]."""
        return self.product("lm_head", _rms(h, self.w["norm.weight"], self.eps)[0], float32_out=True)

    def forward(self, embeds: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """embeds (T, H) of x_{t+1}, g (T, H), rows at positions 0..T-1 -> (h (T, H), target-vocab ids
        ranked by the draft at the last row: (draft_vocab,)). Whole sequences, causal, no cache."""
        q, k, v = self.qkv(embeds, g, 0)
        h = self.finish(g, self.attend(q, k, v, None))
        draft_ids = self.logits(h[-1:])[0].argsort(descending=True)
        return h, draft_ids + self.d2t[draft_ids]


def load_eagle3(path: str, *, hidden_size: int, vocab_size: int, num_layers: int, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32, fp8: bool = False) -> tuple[Eagle3Head, list[int]]:
    """An EAGLE-3 checkpoint directory -> (the head, the target layers whose output streams it reads);
    ``fp8``: its products' weights quantized to E4M3 here (Eagle3Head)."""
    config_path, weights_path = os.path.join(path, "config.json"), os.path.join(path, "model.safetensors")
    if not (os.path.isfile(config_path) and os.path.isfile(weights_path)):
        raise Eagle3ConfigError(f"eagle model path {path!r}: expected config.json and model.safetensors (an EAGLE-3 "
                                f"checkpoint)")
    with open(config_path) as f:
        config = json.load(f)
    state = load_file(weights_path)
    missing = [f"config.json {name}" for name in REQUIRED_CONFIG if name not in config]
    missing += [f"model.safetensors {name}" for name in REQUIRED_WEIGHTS if name not in state]
    if missing:
        raise Eagle3ConfigError(f"eagle model path {path!r} lacks {', '.join(missing)} (an EAGLE-3 checkpoint in the "
                                f"authors' layout has them all)")
    for field, want in (("hidden_size", hidden_size), ("vocab_size", vocab_size)):
        if int(config.get(field, -1)) != want:
            raise Eagle3ConfigError(f"eagle config.json: {field} {config.get(field)} does not match the target's {want}")
    if tuple(state["fc.weight"].shape) != (hidden_size, 3 * hidden_size):
        raise Eagle3ConfigError(f"eagle fc.weight is {tuple(state['fc.weight'].shape)}; the target needs "
                                f"({hidden_size}, {3 * hidden_size})")
    draft_vocab = int(config.get("draft_vocab_size", vocab_size))
    if tuple(state["lm_head.weight"].shape) != (draft_vocab, hidden_size) or state["d2t"].numel() != draft_vocab:
        raise Eagle3ConfigError(f"eagle lm_head.weight {tuple(state['lm_head.weight'].shape)} / d2t "
                                f"({state['d2t'].numel()},) do not match draft_vocab_size {draft_vocab}")
    layers = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if layers is None:  # the authors' default: low, middle and high layers (clamped for targets of < 6 layers)
        layers = [min(max(i, 0), num_layers - 1) for i in (1, num_layers // 2 - 1, num_layers - 4)]
    elif (not isinstance(layers, list) or len(layers) != 3
          or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers for i in layers)):
        # a layer outside the target would tap features the heads were not trained on
        raise Eagle3ConfigError(f"eagle_config.eagle_aux_hidden_state_layer_ids must be 3 layer indices in "
                                f"0..{num_layers - 1} (the target's layers), got {layers!r}")
    return Eagle3Head(config, state, device, dtype, fp8=fp8), layers


def draft_tree(head: Eagle3Head, shape, g: torch.Tensor, tokens: list[int], embed) -> tuple[list[int], list[int]]:
    """g (n, H): the features of tokens[-1-n:-1] (the last token, the root, has none yet) -> (parents
    with -1 for the root, drafted target ids) of ``shape``'s nodes. Row t of the draft layer embeds
    the token after g's t-th; rows past the known tokens read the draft's own output at the row
    before (EAGLE's training-time test)."""
    known = tokens[len(tokens) - g.shape[0]:]  # the tokens after each feature's token, root included
    parents, drafts = [], []
    hidden_of, ranked_of = {}, {}
    for i in range(1, shape.num_nodes):
        parent = shape.parents[i]
        if parent not in ranked_of:  # draft after the parent's path: one layer over the whole sequence
            path = []
            node = parent
            while node > 0:
                path.append(node)
                node = shape.parents[node]
            path.reverse()
            feats = torch.cat([g] + [hidden_of[p][None] for p in ([0] + path)[:len(path)]])
            ids = torch.tensor(known + [drafts[p - 1] for p in path], device=feats.device)
            h, ranked = head.forward(embed(ids).float(), feats)
            hidden_of[parent], ranked_of[parent] = h[-1], ranked.tolist()
        parents.append(parent - 1)
        drafts.append(ranked_of[parent][shape.ranks[i]])
    return parents, drafts


class Eagle3TreeProposer:
    """A TreeDecoder proposer (tree_step.py ``TreeProposer``). It taps the target's three layers with
    forward hooks (their outputs plus the deferred residual adds: the residual stream), keeps g for
    every token whose target forward is done, and drafts ``choices``' tree: the node at rank path
    (r_1..r_d) takes the r_d-th draft token after its parent's path. After a tree step it finds the
    accepted path by walking the previous tree with the emitted tokens (greedy acceptance takes the
    first matching child, as here)."""

    def __init__(self, runner, head: Eagle3Head, layers: list[int], choices: list[list[int]] | None = None):
        self.runner, self.head = runner, head
        self.shape = shape_from_choices(choices or DEFAULT_EAGLE_CHOICES, field="eagle_choices")
        self.taps = LayerTaps(runner.model, layers)  # (TreeDecoder runs no graphs)
        self._g: torch.Tensor | None = None  # (tokens with target features, H)
        self._previous: tuple[int, list[int], list[int]] | None = None  # (len(tokens), parents, node tokens)

    def close(self) -> None:
        self.taps.close()

    def __call__(self, tokens: list[int], last_hidden: torch.Tensor) -> tuple[list[int], list[int]]:
        rows = self.head.features(*self.taps.streams)  # the last forward's tokens
        if self._previous is None:  # the prompt's forward: every row is a token of the prompt
            self._g = rows
        else:
            self._g = torch.cat([self._g, rows[self._accepted_rows(tokens, rows.shape[0])]])
        parents, drafts = draft_tree(self.head, self.shape, self._g, tokens, self.runner.model.embed_tokens)
        self._previous = (len(tokens), [-1] + [p + 1 for p in parents], [tokens[-1]] + drafts)
        return parents, drafts

    def _accepted_rows(self, tokens: list[int], num_rows: int) -> list[int]:
        """The previous tree's accepted path (root included) as rows of its forward: nodes kept in
        order when the decoder cut the tree to a depth, so a node's row is its rank among the kept."""
        length, parents, node_tokens = self._previous
        accepted = tokens[length:-1]  # emitted = accepted drafts + the bonus token
        depths = [0] * len(parents)
        for i in range(1, len(parents)):
            depths[i] = depths[parents[i]] + 1
        max_depth = max(d for d in set(depths) if sum(x <= d for x in depths) == num_rows)
        kept = [i for i in range(len(parents)) if depths[i] <= max_depth]
        row_of = {node: r for r, node in enumerate(kept)}
        path = [0]
        for token in accepted:
            path.append(next(c for c in kept if parents[c] == path[-1] and node_tokens[c] == token))
        return [row_of[node] for node in path]


class Eagle3DraftProposer:
    """The in-flight executor's DraftProposer for ``decoding_mode eagle`` (proposer.py's interface),
    plus ``observe_batch``: after each forward, the rows the taps kept (every scheduled token, in
    plan order; CUDA graph replays included: engine/executor/layer_taps.py) become each sequence's
    features, for the tokens it computed: a chunk's known tokens, then a verified tree's accepted path
    or a chain's accepted drafts. They go into the sequence's draft-layer cache (eagle3_drafter.py
    DraftCache), which starts where the sequence's computation starts (a prefix-cache hit or a
    recompute after preemption restarts it there; the draft layer attends to what it has) and is
    freed in ``release`` (finish, cancel, failure). Trees: ``choices``' static tree, or with
    ``dynamic`` = (depth, top_k) EAGLE-2's dynamic tree of max_draft_len nodes. Greedy rows verify by
    argmax, sampled ones by multi-draft rejection sampling (the target's law is kept)."""

    drafts_trees = True  # verify steps replay the tree graphs (runner.tree_graph_width)

    def __init__(self, runner, head: Eagle3Head, layers: list[int], choices: list[list[int]],
                 dynamic: tuple[int, int] | None = None):
        self.runner, self.head, self.dynamic = runner, head, dynamic
        self.shape = shape_from_choices(choices, field="eagle_choices")
        self.plan = StaticPlan(self.shape, runner.device)
        self.taps = runner.tap_layers(layers)
        self._caches: dict[int, DraftCache] = {}
        self.gemm_choices = head.choose_kernels() if runner.device.type == "cuda" else {}
        # static trees: one recorded replay a proposal on CUDA (eagle3_graphs.py)
        self.graphs = None if dynamic is not None else StaticDraftGraphs(
            head, self.plan, runner.model.embed_tokens, max_positions=runner.build_config.max_seq_len,
            device=runner.device, use_graphs=eagle_graphs_enabled())
        if self.graphs is not None:  # CUDA: every bucket up to the longest sequence, before the KV pool
            self.graphs.record_all(runner.build_config.max_seq_len, runner.build_config.max_batch_size)
        # the windows' drafts stay on the device until the verify step is launched (device_drafts.py);
        # the ring grows before the runner's graphs are captured (they read it), so not after
        self.device_drafts = None
        if (self.graphs is not None and device_drafts_enabled() and hasattr(runner, "add_draft_slots")
                and runner.decode_graphs is None and runner.prefill_graphs is None):
            self.device_drafts = DeviceDrafts(runner, runner.build_config.max_batch_size, len(self.plan.parents))

    def observe_batch(self, scheduled: list, verified: dict | None) -> None:
        rows = self.head.features(*self.taps.streams)
        offset = 0
        for item in scheduled:
            seq, n, k = item.seq, item.num_new_tokens, item.num_draft_tokens
            chunk = rows[offset:offset + n]
            offset += n
            keep = chunk[:n - k]
            v = verified.get(seq.seq_id) if verified and k else None
            if v is not None and v.num_accepted:
                accepted = v.path[1:] if v.path is not None else range(1, v.num_accepted + 1)
                if list(accepted) == list(range(1, v.num_accepted + 1)):  # (a chain, a tree's first nodes)
                    keep = chunk[:n - k + v.num_accepted]  # the rows right after the root's: one slice
                else:  # the rows by a tensor sent ahead (a Python list index copies it with a stream sync)
                    rows_at = torch.tensor([n - k - 1 + j for j in accepted]).to(chunk.device, non_blocking=True)
                    keep = torch.cat([keep, chunk.index_select(0, rows_at)])
            cache = self._caches.get(seq.seq_id)
            if cache is None or cache.end != item.start:  # a restart (preemption, prefix hit): features from here
                cache = self._caches[seq.seq_id] = DraftCache(item.start, self.head, rows.device)
            cache.add_features(keep)

    def propose(self, seqs: list, max_draft_len: int) -> list[list[int]]:
        drafts = []
        embed = self.runner.model.embed_tokens
        windowed = []  # (index in drafts, seq, room, its draft cache): drafted together at the end
        for seq in seqs:
            seq.draft_parents = None
            cache = self._caches.get(seq.seq_id)
            room = draft_room(seq, max_draft_len)
            if cache is None or not room or seq.num_unresolved_tokens or cache.end != len(seq.token_ids) - 1:
                drafts.append([])
                continue
            if self.graphs is not None and self.graphs.fits(cache):  # the commit and the tree: below
                windowed.append((len(drafts), seq, room, cache))
                drafts.append([])
                continue
            cache.commit(self.head, seq.token_ids, embed)
            if cache.last_q is None:
                drafts.append([])
                continue
            if self.dynamic is None:
                parents, tokens = draft_static(self.head, cache, self.plan, embed)
            else:
                depth, top_k = self.dynamic
                parents, tokens = draft_dynamic(self.head, cache, embed, depth=depth, top_k=top_k, num_nodes=room)
            seq.draft_parents, seq.draft_tree_keeps_law = parents[:room], True
            drafts.append(tokens[:room])
        if windowed:  # every sequence's commit and tree in one replay (a group's each, for long caches)
            if len(windowed) == 1:  # (read before the next replay: no copy of the window's tokens)
                drafted = self.graphs.run(windowed[0][3], windowed[0][1].token_ids)[None]
            else:
                drafted = self.graphs.run_batch([c for *_, c in windowed], [seq.token_ids for _, seq, _, _ in windowed])
            rooms = [room for _, _, room, _ in windowed]
            if self.device_drafts is not None and len(windowed) <= self.device_drafts.rows:
                lists = self.device_drafts.place(drafted, rooms)  # placeholders: nothing waits for the replay
            else:
                lists = [tokens[:room] for tokens, room in zip(drafted.tolist(), rooms)]
            for (i, seq, room, _), tokens in zip(windowed, lists):
                seq.draft_parents, seq.draft_tree_keeps_law = self.plan.parents[:room], True
                drafts[i] = tokens
        return drafts

    def resolve_drafts(self, ids: list[int]) -> list[int]:
        """A sequence's drafts with the placeholders of drafts left on the device -> the ids (the
        executor calls it once the verify step is launched: executor_drafts.resolve_device_drafts)."""
        return ids if self.device_drafts is None else self.device_drafts.resolve(ids)

    def release(self, seq) -> None:
        self._caches.pop(seq.seq_id, None)

    def with_head(self, head: Eagle3Head, *, choose_kernels: bool = True) -> "Eagle3DraftProposer":
        """A proposer drafting the same tree with another head over the same taps, with no caches
        (benchmarks/speculative/tree_bench.py: an FP8 head beside the bf16 one on one engine, whose
        graphs tap the layers already). Its drafting graphs are recorded at their first replay.
        ``choose_kernels`` False: no load-time timing of the head's GEMM tilings (each product keeps
        its default: the skinny kernel's FP8 default, the library for bf16)."""
        other = copy.copy(self)
        other.head, other._caches = head, {}
        other.gemm_choices = head.choose_kernels() if choose_kernels and self.runner.device.type == "cuda" else {}
        if self.graphs is not None:
            other.graphs = StaticDraftGraphs(head, self.plan, self.runner.model.embed_tokens,
                                             max_positions=self.runner.build_config.max_seq_len,
                                             device=self.runner.device, use_graphs=self.graphs.use_graphs)
        return other


FP8_TARGETS = ("fp8", "fp8_block")  # build quantizations whose engines hold E4M3 weights


def eagle_head_fp8(spec, build_config) -> bool:
    """Whether the head's products run in FP8: ``spec.eagle_fp8_head`` when given, else as the target
    (an FP8 engine's head too: its users chose FP8's rounding; a bf16 target's head stays bf16, so
    its drafts stay the published head's unless asked)."""
    if spec.eagle_fp8_head is not None:
        return spec.eagle_fp8_head
    return getattr(build_config, "quantization", None) in FP8_TARGETS


def start_eagle3(runner, spec, *, engine_dir: str, has_state: bool) -> Eagle3DraftProposer:
    """The proposer of ``decoding_mode eagle`` (heads in ``spec.eagle_model_path``, default the
    engine directory's ``eagle3/``), or ProposerConfigError naming the field. Runs before the
    runner's CUDA graphs are captured: they keep the tapped layers' streams too."""
    refuse_unless_one_rank_without_state(runner, "eagle", has_state)
    path = spec.eagle_model_path or os.path.join(engine_dir, "eagle3")
    try:
        choices = spec.eagle_choices
        if isinstance(choices, str):
            choices = parse_choices(choices, field="eagle_choices")
        # float32 on the CPU (the tests compare with transformers there), the target's dtype on a GPU
        dtype = torch.float32 if runner.device.type == "cpu" else runner.dtype
        head, layers = load_eagle3(path, hidden_size=runner.model_config.hidden_size, vocab_size=runner.vocab_size,
                                   num_layers=len(runner.model.layers), device=runner.device, dtype=dtype,
                                   fp8=eagle_head_fp8(spec, runner.build_config))
        dynamic = (spec.eagle_dynamic_depth, spec.eagle_dynamic_top_k) if spec.eagle_dynamic_tree else None
        return Eagle3DraftProposer(runner, head, layers, choices or DEFAULT_EAGLE_CHOICES, dynamic)
    except (TreeChoicesError, ValueError, OSError) as err:
        raise ProposerConfigError(str(err)) from None
