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

This implementation recomputes the draft layer over the whole sequence for every drafted depth
(no draft KV cache): correct, simple, and meant for CPU tests and small trees.
"""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file

from engine.executor.runner import ModelRunner
from engine.executor.speculative.proposer import ProposerConfigError, draft_room
from engine.executor.speculative.tree import TreeChoicesError, parse_choices, shape_from_choices

DEFAULT_EAGLE_CHOICES = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
REQUIRED_CONFIG = ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads")
REQUIRED_WEIGHTS = ("fc.weight", "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
                    "midlayer.post_attention_layernorm.weight", *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
                    *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")), "norm.weight",
                    "lm_head.weight", "d2t")


class Eagle3ConfigError(ValueError):
    """A checkpoint that does not fit the target (the message names the field)."""


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama rotary (rotate-half) on x (T, heads, head_dim) at positions (T,)."""
    half = x.shape[-1] // 2
    inv = 1.0 / theta ** (torch.arange(half, dtype=torch.float32) / half)
    angles = positions.float()[:, None] * inv[None]  # (T, half)
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


class Eagle3Head:
    """The draft layer's float32 weights and its forward (no KV cache: whole sequences)."""

    def __init__(self, config: dict, state: dict[str, torch.Tensor]):
        self.config, self.w = config, {k: v.float() for k, v in state.items()}
        self.eps, self.theta = float(config.get("rms_norm_eps", 1e-6)), float(config.get("rope_theta", 10000.0))
        self.num_heads, self.num_kv_heads = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
        self.head_dim = int(config.get("head_dim") or config["hidden_size"] // self.num_heads)
        self.d2t = state["d2t"].long()

    def features(self, low: torch.Tensor, mid: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
        """The target's three streams (T, H) each -> g (T, H)."""
        return torch.cat([low, mid, high], dim=-1).float() @ self.w["fc.weight"].T

    def forward(self, embeds: torch.Tensor, g: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """embeds (T, H) of x_{t+1}, g (T, H), positions (T,) -> (h (T, H), target-vocab ids ranked
        by the draft at the last row: (draft_vocab,))."""
        w, T = self.w, embeds.shape[0]
        a = torch.cat([_rms(embeds.float(), w["midlayer.input_layernorm.weight"], self.eps),
                       _rms(g, w["midlayer.hidden_norm.weight"], self.eps)], dim=-1)
        q = (a @ w["midlayer.self_attn.q_proj.weight"].T).view(T, self.num_heads, self.head_dim)
        k = (a @ w["midlayer.self_attn.k_proj.weight"].T).view(T, self.num_kv_heads, self.head_dim)
        v = (a @ w["midlayer.self_attn.v_proj.weight"].T).view(T, self.num_kv_heads, self.head_dim)
        q, k = _rotate(q, positions, self.theta), _rotate(k, positions, self.theta)
        group = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        attn = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                                                v.transpose(0, 1), is_causal=True)
        h = g + attn.transpose(0, 1).reshape(T, -1) @ w["midlayer.self_attn.o_proj.weight"].T
        m = _rms(h, w["midlayer.post_attention_layernorm.weight"], self.eps)
        m = torch.nn.functional.silu(m @ w["midlayer.mlp.gate_proj.weight"].T) * (m @ w["midlayer.mlp.up_proj.weight"].T)
        h = h + m @ w["midlayer.mlp.down_proj.weight"].T
        logits = _rms(h[-1], w["norm.weight"], self.eps) @ w["lm_head.weight"].T
        draft_ids = logits.argsort(descending=True)
        return h, draft_ids + self.d2t[draft_ids]


def load_eagle3(path: str, *, hidden_size: int, vocab_size: int, num_layers: int) -> tuple[Eagle3Head, list[int]]:
    """An EAGLE-3 checkpoint directory -> (the head, the target layers whose output streams it reads)."""
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
    return Eagle3Head(config, state), layers


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
            h, ranked = head.forward(embed(ids).float(), feats, torch.arange(len(ids)))
            hidden_of[parent], ranked_of[parent] = h[-1], ranked.tolist()
        parents.append(parent - 1)
        drafts.append(ranked_of[parent][shape.ranks[i]])
    return parents, drafts


def tap_layers(runner, layers: list[int], taps: dict[int, torch.Tensor]) -> list:
    """Forward hooks on the target's ``layers``: after each forward, taps[j] holds layers[j]'s residual
    stream (its output plus the deferred residual adds), float32 (tokens, H). Returns the handles."""
    def tap(j: int):
        def hook(module, inputs, output):  # (stream, pending add): a tensor (LlamaLayer) or a tuple (DecoderLayer)
            x, adds = output
            if isinstance(adds, torch.Tensor):
                x = x + adds
            else:
                for term in adds:
                    x = x + term
            taps[j] = x.detach().float()
        return hook
    return [runner.model.layers[i].register_forward_hook(tap(j)) for j, i in enumerate(layers)]


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
        self._taps: dict[int, torch.Tensor] = {}
        self._hooks = tap_layers(runner, layers, self._taps)
        self._g: torch.Tensor | None = None  # (tokens with target features, H)
        self._previous: tuple[int, list[int], list[int]] | None = None  # (len(tokens), parents, node tokens)

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()

    def __call__(self, tokens: list[int], last_hidden: torch.Tensor) -> tuple[list[int], list[int]]:
        rows = self.head.features(self._taps[0], self._taps[1], self._taps[2])  # the last forward's tokens
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
    plus ``observe_batch``: after each forward, the rows the hooks tapped (every scheduled token, in
    plan order) become each sequence's features, for the tokens it computed: a chunk's known tokens,
    then a verified tree's accepted path or a chain's accepted drafts. Features start where the
    sequence's computation starts (a prefix-cache hit or a recompute after preemption restarts them
    there); the draft layer attends to what it has. Greedy rows verify by argmax, sampled ones by
    multi-draft rejection sampling (the target's law is kept)."""

    def __init__(self, runner, head: Eagle3Head, layers: list[int], choices: list[list[int]]):
        self.runner, self.head = runner, head
        self.shape = shape_from_choices(choices, field="eagle_choices")
        self._taps: dict[int, torch.Tensor] = {}
        self._hooks = tap_layers(runner, layers, self._taps)
        self._features: dict[int, tuple[int, torch.Tensor]] = {}  # seq_id -> (first position, g (n, H))

    def observe_batch(self, scheduled: list, verified: dict | None) -> None:
        rows = self.head.features(self._taps[0], self._taps[1], self._taps[2])
        offset = 0
        for item in scheduled:
            seq, n, k = item.seq, item.num_new_tokens, item.num_draft_tokens
            chunk = rows[offset:offset + n]
            offset += n
            keep = chunk[:n - k]
            v = verified.get(seq.seq_id) if verified and k else None
            if v is not None and v.num_accepted:
                accepted = v.path[1:] if v.path is not None else range(1, v.num_accepted + 1)
                keep = torch.cat([keep, chunk[[n - k - 1 + j for j in accepted]]])
            start, g = self._features.get(seq.seq_id, (item.start, keep[:0]))
            if start + g.shape[0] != item.start:  # a restart (preemption, prefix hit): features from here
                start, g = item.start, keep[:0]
            self._features[seq.seq_id] = (start, torch.cat([g, keep]))

    def propose(self, seqs: list, max_draft_len: int) -> list[list[int]]:
        drafts = []
        for seq in seqs:
            seq.draft_parents = None
            start, g = self._features.get(seq.seq_id, (0, None))
            room = draft_room(seq, max_draft_len)
            if g is None or not g.shape[0] or not room or seq.num_unresolved_tokens \
                    or start + g.shape[0] != len(seq.token_ids) - 1:
                drafts.append([])
                continue
            parents, tokens = draft_tree(self.head, self.shape, g, seq.token_ids, self.runner.model.embed_tokens)
            seq.draft_parents, seq.draft_tree_keeps_law = parents[:room], True
            drafts.append(tokens[:room])
        return drafts

    def release(self, seq) -> None:
        self._features.pop(seq.seq_id, None)


def start_eagle3(runner, spec, *, engine_dir: str, has_state: bool) -> Eagle3DraftProposer:
    """The proposer of ``decoding_mode eagle`` (heads in ``spec.eagle_model_path``, default the
    engine directory's ``eagle3/``), or ProposerConfigError naming the field."""
    if not isinstance(runner, ModelRunner) or runner.build_config.tp_size > 1:
        raise ProposerConfigError("decoding_mode eagle runs on one rank (tp_size 1) in this release")
    if has_state:
        raise ProposerConfigError("decoding_mode eagle: models with recurrent state (Mamba layers) cannot verify "
                                  "token trees")
    if runner.device.type != "cpu":
        raise ProposerConfigError("decoding_mode eagle runs on the CPU in this release: its heads read three target "
                                  "layers through forward hooks, which CUDA graph replays skip")
    path = spec.eagle_model_path or os.path.join(engine_dir, "eagle3")
    try:
        choices = spec.eagle_choices
        if isinstance(choices, str):
            choices = parse_choices(choices, field="eagle_choices")
        head, layers = load_eagle3(path, hidden_size=runner.model_config.hidden_size, vocab_size=runner.vocab_size,
                                   num_layers=len(runner.model.layers))
        return Eagle3DraftProposer(runner, head, layers, choices or DEFAULT_EAGLE_CHOICES)
    except (TreeChoicesError, ValueError, OSError) as err:
        raise ProposerConfigError(str(err)) from None
