"""Medusa heads (Cai et al. 2024): extra next-next-token heads on the target's last hidden state,
drafting a token tree for tree verification (engine/executor/speculative/tree_step.py).

Head k (0-based) reads the target's final-normed hidden state h at the last accepted token t and
guesses the token at t + 2 + k (the target's own lm_head gives t + 1, the tree's root):

    head_k(h) = W_k · R_k,L(... R_k,1(h))      R(x) = x + SiLU(A x + b)   (L residual blocks)

Checkpoints in FasterDecoding's ``medusa_lm_head`` format: a directory with ``config.json``
(``medusa_num_heads``, ``medusa_num_layers``) and ``medusa_lm_head.safetensors`` (or ``.pt``), the
state dict of ``ModuleList[Sequential(ResBlock x L, Linear(hidden, vocab, bias=False))]``:
``{k}.{j}.linear.weight`` (hidden, hidden) and ``.bias`` (hidden,) for block j < L, and
``{k}.{L}.weight`` (vocab, hidden). Or TensorRT-LLM's converted checkpoint (examples/medusa
convert_checkpoint.py): ``config.json`` with ``num_medusa_heads``, ``num_medusa_layers``,
``max_draft_len`` (and ``mapping.tp_size``) beside ``rank{r}.safetensors``, whose heads are
``medusa_heads.{k}.medusa_layers.{j}.linear.weight/bias`` and ``medusa_heads.{k}.lm_head.weight``,
split along dim 0 over the ranks (trtllm_checkpoint.py; the target's own tensors are not read).
A ``medusa_choices`` entry in that config.json is the default tree.

The tree comes from ``medusa_choices`` (tree.py ``shape_from_choices``): the node at path
(r_1, ..., r_d) drafts head d-1's r_d-th most likely token below its parent.
"""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file

from engine.executor.speculative.proposer import draft_room
from engine.executor.speculative.trtllm_checkpoint import rank_tensors
from engine.executor.speculative.tree import TreeShape, shape_from_choices


class MedusaConfigError(ValueError):
    """Heads that cannot run with the target or the tree (the message names the field)."""


class MedusaHeads(torch.nn.Module):
    """``num_heads`` heads of ``num_layers`` residual blocks and an lm head each, float32 on ``device``."""

    def __init__(self, num_heads: int, num_layers: int, hidden_size: int, vocab_size: int, device="cpu"):
        super().__init__()
        self.num_heads, self.num_layers = num_heads, num_layers
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.default_choices = None  # a TensorRT-LLM checkpoint's medusa_choices, if its config has one
        self.block_weight = torch.nn.Parameter(torch.zeros(num_heads, num_layers, hidden_size, hidden_size, device=device),
                                               requires_grad=False)
        self.block_bias = torch.nn.Parameter(torch.zeros(num_heads, num_layers, hidden_size, device=device),
                                             requires_grad=False)
        self.lm_head = torch.nn.Parameter(torch.zeros(num_heads, vocab_size, hidden_size, device=device),
                                          requires_grad=False)

    @torch.inference_mode()
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (hidden_size,) -> float32 logits (num_heads, vocab): every head on the same state."""
        x = hidden.float().expand(self.num_heads, -1)  # (heads, hidden)
        for j in range(self.num_layers):
            x = x + torch.nn.functional.silu(torch.einsum("hod,hd->ho", self.block_weight[:, j], x) + self.block_bias[:, j])
        return torch.einsum("hvd,hd->hv", self.lm_head, x)


def load_medusa_heads(path: str, *, hidden_size: int, vocab_size: int, device="cpu") -> MedusaHeads:
    """A FasterDecoding ``medusa_lm_head`` directory -> MedusaHeads, checked against the target's
    hidden size and vocabulary."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise MedusaConfigError(f"medusa_model_path: {path!r} has no config.json (a FasterDecoding medusa_lm_head "
                                f"directory holds config.json and medusa_lm_head.safetensors or .pt)")
    with open(config_path) as f:
        config = json.load(f)
    trtllm = "num_medusa_heads" in config  # TensorRT-LLM's converted checkpoint
    try:
        num_heads, num_layers = (int(config["num_medusa_heads"]), int(config["num_medusa_layers"])) if trtllm else (
            int(config["medusa_num_heads"]), int(config["medusa_num_layers"]))
    except KeyError as e:
        raise MedusaConfigError(f"medusa_model_path: config.json lacks {e.args[0]}") from None
    state = _trtllm_state(path, config, num_heads, num_layers) if trtllm else _load_state(path)
    heads = MedusaHeads(num_heads, num_layers, hidden_size, vocab_size, device)
    heads.default_choices = config.get("medusa_choices")
    for k in range(num_heads):
        head = state.get(f"{k}.{num_layers}.weight")
        if head is None:
            raise MedusaConfigError(f"medusa heads: no '{k}.{num_layers}.weight' (head {k}'s lm head) in the checkpoint "
                                    f"of {num_heads} heads x {num_layers} residual blocks")
        if tuple(head.shape) != (vocab_size, hidden_size):
            raise MedusaConfigError(f"medusa heads: head {k}'s lm head is {tuple(head.shape)} (vocab, hidden); the "
                                    f"target has vocab_size {vocab_size} and hidden_size {hidden_size}")
        heads.lm_head.data[k] = head.float()
        for j in range(num_layers):
            weight, bias = state[f"{k}.{j}.linear.weight"], state[f"{k}.{j}.linear.bias"]
            if tuple(weight.shape) != (hidden_size, hidden_size):
                raise MedusaConfigError(f"medusa heads: block {k}.{j} is {tuple(weight.shape)}; the target's "
                                        f"hidden_size is {hidden_size}")
            heads.block_weight.data[k, j], heads.block_bias.data[k, j] = weight.float(), bias.float()
    return heads


def _trtllm_state(path: str, config: dict, num_heads: int, num_layers: int) -> dict[str, torch.Tensor]:
    """TensorRT-LLM's head tensors under FasterDecoding's names (``{k}.{j}.linear.*``, ``{k}.{L}.weight``)."""
    try:
        state = rank_tensors(path, config, "medusa_heads.")
    except FileNotFoundError as err:
        raise MedusaConfigError(f"medusa_model_path: {err}") from None
    renamed = {}
    for k in range(num_heads):
        renamed[f"{k}.{num_layers}.weight"] = state.get(f"medusa_heads.{k}.lm_head.weight")
        for j in range(num_layers):
            for part in ("weight", "bias"):
                name = f"medusa_heads.{k}.medusa_layers.{j}.linear.{part}"
                if name not in state:
                    raise MedusaConfigError(f"medusa heads: no '{name}' in the rank files of {num_heads} heads x "
                                            f"{num_layers} layers")
                renamed[f"{k}.{j}.linear.{part}"] = state[name]
    return {k: v for k, v in renamed.items() if v is not None}


def _load_state(path: str) -> dict[str, torch.Tensor]:
    safetensors_path, pt_path = (os.path.join(path, f"medusa_lm_head.{ext}") for ext in ("safetensors", "pt"))
    if os.path.isfile(safetensors_path):
        return load_file(safetensors_path)
    if os.path.isfile(pt_path):
        return torch.load(pt_path, map_location="cpu", weights_only=True)
    raise MedusaConfigError(f"medusa_model_path: {path!r} has neither medusa_lm_head.safetensors nor medusa_lm_head.pt")


class MedusaProposer:
    """A TreeProposer (tree_step.py): the heads' top-k tokens on the last hidden state, laid out as
    ``medusa_choices``' tree."""

    def __init__(self, heads: MedusaHeads, choices: list[list[int]]):
        self.heads, self.shape = heads, shape_from_choices(choices)
        if self.shape.max_depth > heads.num_heads:
            raise MedusaConfigError(f"medusa_choices: paths {self.shape.max_depth} deep need as many heads; the "
                                    f"checkpoint has {heads.num_heads}")
        self.top = max(self.shape.ranks) + 1
        if self.top > heads.vocab_size:
            raise MedusaConfigError(f"medusa_choices: rank {self.top - 1} is outside the vocabulary of {heads.vocab_size}")

    def __call__(self, tokens: list[int], hidden: torch.Tensor) -> tuple[list[int], list[int]]:
        return propose_tree(self.heads(hidden), self.shape, self.top)


def propose_tree(head_logits: torch.Tensor, shape: TreeShape, top: int) -> tuple[list[int], list[int]]:
    """head_logits (heads, vocab) -> (parents with -1 for the root, token ids) of the shape's
    drafted nodes (node 0, the root, left out)."""
    ranked = head_logits.topk(top, dim=-1).indices.tolist()  # (heads, top)
    depths = shape.depths
    drafts = [ranked[depths[i] - 1][shape.ranks[i]] for i in range(1, shape.num_nodes)]
    return [p - 1 for p in shape.parents[1:]], drafts


class LastHiddenTreeProposer:
    """A DraftProposer (proposer.py) drafting a tree per sequence from the target's final hidden
    state at its last computed token (Medusa, ReDrafter): the executor hands the step's hidden rows
    over after each forward (``observe``; the runner keeps them, ``keep_hidden_rows``). Subclasses
    give ``draft(hidden, root)`` -> (parents with -1 for the root, tokens) in topological order, so
    the first max_draft_len nodes are a subtree; ``keeps_law`` picks the sampled rows' acceptance
    (verify.py: rejection sampling when true, typical acceptance when false)."""

    keeps_law = False
    drafts_trees = True  # verify steps replay the tree graphs (runner.tree_graph_width)

    def __init__(self):
        self._hidden: dict[int, torch.Tensor] = {}  # seq_id -> (hidden,) at its last computed token

    def draft(self, hidden: torch.Tensor, root: int) -> tuple[list[int], list[int]]:
        raise NotImplementedError

    def observe(self, hidden_rows: torch.Tensor, last_rows: dict[int, int]) -> None:
        """hidden_rows: the step's rows (aligned with its logits rows); last_rows: seq_id -> the row
        of its last computed token after the step (the end of an accepted path)."""
        for seq_id, row in last_rows.items():
            self._hidden[seq_id] = hidden_rows[row].clone()

    def propose(self, seqs: list, max_draft_len: int) -> list[list[int]]:
        drafts = []
        for seq in seqs:
            hidden = self._hidden.pop(seq.seq_id, None)
            room = draft_room(seq, max_draft_len)
            seq.draft_parents = None
            if hidden is None or not room or seq.num_unresolved_tokens:
                drafts.append([])
                continue
            parents, tokens = self.draft(hidden, seq.token_ids[-1])
            seq.draft_parents, seq.draft_tree_keeps_law = parents[:room], self.keeps_law
            drafts.append(tokens[:room])
        return drafts

    def release(self, seq) -> None:
        self._hidden.pop(seq.seq_id, None)


class MedusaDraftProposer(LastHiddenTreeProposer):
    """The executor's DraftProposer for ``decoding_mode medusa``: every sequence verifies
    ``medusa_choices``' tree (its first max_draft_len nodes): greedy ones by argmax, sampled ones by
    Medusa's typical acceptance (verify.py, typical.py)."""

    def __init__(self, heads: MedusaHeads, choices: list[list[int]]):
        super().__init__()
        self.tree = MedusaProposer(heads, choices)

    def draft(self, hidden: torch.Tensor, root: int) -> tuple[list[int], list[int]]:
        return propose_tree(self.tree.heads(hidden), self.tree.shape, self.tree.top)
