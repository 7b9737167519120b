"""ReDrafter (Cheng et al. 2024, Apple's "recurrent drafter"): an RNN draft head over the target's
last hidden state and its token embeddings, beam search over drafts, the beams packed into one
token tree by shared prefixes and verified in one target forward (tree_step.py / the executor's
tree path).

The drafter (``Drafter``), for the target's final-normed hidden state h at the last computed
token t and the token x_{t+1} the target chose there (the tree's root, "init token"):

    s_0 = 0                                    RNN state (hidden,)
    s_i = SiLU(W e(y_{i-1}) + U s_{i-1} + b_U)  (rnn: true; else s_i = e(y_{i-1}) + s_{i-1})
    z_i = [h ; s_i]  (2 hidden) -> input_proj (when exit_dim != 2 hidden) -> ResBlock x L -> lm_head
    y_0 = x_{t+1}; y_i is drafted from log_softmax(top50(z_i's logits))

e is the target's input embedding. A beam search of ``num_beams`` beams, ``draft_len_per_beam``
drafts long (the first step grows only beam 0, so the beams differ), gives num_beams paths below
the root. Shared prefixes are merged (``pack_beams``), so the tree has at most
num_beams x draft_len_per_beam nodes.

Checkpoints, as published:
- Apple's ml-recurrent-drafter (the ``recurrent_drafting_drafter`` model): ``config.json``
  (``vocab_size``, ``hidden_size``, ``exit_dim``, ``num_draft_layers``, ``rnn``) and
  ``model.safetensors`` or ``model.pt``: ``input_proj.{weight,bias}`` (exit_dim, 2 hidden) when
  exit_dim != 2 hidden, ``lm_head.{j}.linear.{weight,bias}`` (exit_dim, exit_dim) for block j < L,
  ``lm_head.{L}.weight`` (vocab, exit_dim), ``rnn_u.{weight,bias}``, ``rnn_w.weight`` (hidden,
  hidden). The other spellings TensorRT-LLM's converter reads (``input_projs``/``lm_heads``, or
  ``0.{j}``) are read too.
- TensorRT-LLM's converted checkpoint (examples/redrafter/convert_checkpoint.py): ``config.json``
  with ``architecture: ReDrafterForCausalLM``, ``redrafter_num_layers``, ``redrafter_hidden_size``,
  ``redrafter_exit_dim``, ``redrafter_is_rnn``, ``redrafter_num_beams``,
  ``redrafter_draft_len_per_beam``, and ``rank{r}.safetensors`` whose ``drafter.*`` tensors
  (``drafter.input_proj``, ``drafter.layers.{j}.linear``, ``drafter.lm_head``, ``drafter.rnn_u``,
  ``drafter.rnn_w``) are split along dim 0 over ``mapping.tp_size`` ranks (concatenated back here).
"""
from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open

from engine.executor.speculative.medusa import LastHiddenTreeProposer
from engine.executor.speculative.proposer import ProposerConfigError, refuse_unless_one_rank_without_state
from engine.executor.speculative.trtllm_checkpoint import rank_tensors

LOG_0 = -50000.0  # the drafter's "log 0": masked logits and the dead beams of the first step
DRAFTER_TOP_K = 50  # the drafter's logits keep their top 50 before log_softmax (Apple's warp_logits)
DEFAULT_NUM_BEAMS = DEFAULT_DRAFT_LEN_PER_BEAM = 5  # TensorRT-LLM's converter defaults


class ReDrafterConfigError(ValueError):
    """A drafter that cannot run with the target (the message names the field)."""


class Drafter(torch.nn.Module):
    """The recurrent drafter's weights, float32 on ``device``; shapes in the module docstring."""

    def __init__(self, hidden_size: int, exit_dim: int, num_layers: int, vocab_size: int, rnn: bool, device="cpu"):
        super().__init__()
        self.hidden_size, self.exit_dim, self.num_layers = hidden_size, exit_dim, num_layers
        self.vocab_size, self.rnn = vocab_size, rnn

        def zeros(*shape):
            return torch.nn.Parameter(torch.zeros(*shape, device=device), requires_grad=False)

        projected = exit_dim != 2 * hidden_size
        self.input_proj_weight = zeros(exit_dim, 2 * hidden_size) if projected else None
        self.input_proj_bias = zeros(exit_dim) if projected else None
        self.block_weight, self.block_bias = zeros(num_layers, exit_dim, exit_dim), zeros(num_layers, exit_dim)
        self.lm_head = zeros(vocab_size, exit_dim)
        self.rnn_w, self.rnn_u, self.rnn_u_bias = (zeros(hidden_size, hidden_size), zeros(hidden_size, hidden_size),
                                                   zeros(hidden_size)) if rnn else (None, None, None)

    def step_state(self, state: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """(beams, hidden) RNN state and the embeddings of each beam's last token -> the next state."""
        if not self.rnn:
            return embeds + state
        return torch.nn.functional.silu(embeds @ self.rnn_w.T + state @ self.rnn_u.T + self.rnn_u_bias)

    def log_probs(self, context: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """context (beams, hidden), state (beams, hidden) -> (beams, vocab) log-probabilities over
        the drafter's top 50 (the rest LOG_0 before normalising, as Apple's compute_logits)."""
        x = torch.cat([context, state], dim=-1)
        if self.input_proj_weight is not None:
            x = x @ self.input_proj_weight.T + self.input_proj_bias
        for j in range(self.num_layers):
            x = x + torch.nn.functional.silu(x @ self.block_weight[j].T + self.block_bias[j])
        logits = x @ self.lm_head.T
        logits = logits - logits.max(dim=-1, keepdim=True).values
        kth = logits.topk(min(DRAFTER_TOP_K, logits.shape[-1]), dim=-1).values[..., -1:]
        return logits.masked_fill(logits < kth, LOG_0).log_softmax(dim=-1)

    @torch.inference_mode()
    def beam_search(self, hidden: torch.Tensor, init_token: int, embed, num_beams: int,
                    draft_len: int) -> torch.Tensor:
        """hidden (hidden,) at the last computed token, init_token = the root -> beams
        (num_beams, 1 + draft_len) int64, column 0 the root, best beam first."""
        device = self.lm_head.device
        context = hidden.float().to(device).expand(num_beams, -1)
        beams = torch.full((num_beams, 1), init_token, dtype=torch.int64, device=device)
        score = torch.full((num_beams,), LOG_0, device=device)
        score[0] = 0.0  # only beam 0 grows in the first step; top-k then spreads its children
        state = torch.zeros(num_beams, self.hidden_size, device=device)
        for _ in range(draft_len):
            state = self.step_state(state, embed(beams[:, -1].to(embed.weight.device)).float().to(device))
            joint = (self.log_probs(context, state) + score[:, None]).reshape(-1)  # (beams * vocab,)
            score, flat = joint.topk(num_beams)
            parent, token = flat // self.vocab_size, flat % self.vocab_size
            beams = torch.cat([beams[parent], token[:, None]], dim=1)
            state = state[parent]
        return beams


def pack_beams(beams: list[list[int]]) -> tuple[list[int], list[int]]:
    """Beams (each root first) -> (parents with -1 for the root, token ids) of the drafted nodes,
    shared prefixes merged; nodes in beam order, so every parent comes before its children and
    any first n nodes form a tree."""
    index: dict[tuple[int, ...], int] = {}
    parents, tokens = [], []
    for beam in beams:
        for depth in range(1, len(beam)):
            key = tuple(beam[1:depth + 1])
            if key not in index:
                index[key] = len(tokens)
                parents.append(index[key[:-1]] if depth > 1 else -1)
                tokens.append(beam[depth])
    return parents, tokens


# ----- checkpoints -----

def load_drafter(path: str, *, hidden_size: int, vocab_size: int, device="cpu") -> tuple[Drafter, dict]:
    """A drafter directory (either published layout) -> (Drafter checked against the target's hidden
    size and vocabulary, the beam settings its config carries: TensorRT-LLM's redrafter_num_beams /
    redrafter_draft_len_per_beam, empty for Apple's)."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ReDrafterConfigError(f"redrafter_model_path: {path!r} has no config.json (Apple's recurrent drafter "
                                   f"directory holds config.json and model.safetensors or model.pt; TensorRT-LLM's "
                                   f"converted one config.json and rank0.safetensors)")
    with open(config_path) as f:
        config = json.load(f)
    if "redrafter_num_layers" in config:
        keys = ("redrafter_hidden_size", "redrafter_exit_dim", "redrafter_num_layers", "vocab_size", "redrafter_is_rnn")
        state, names, settings = _trtllm_state(path, config), _TRTLLM_NAMES, {
            k: int(config[k]) for k in ("redrafter_num_beams", "redrafter_draft_len_per_beam") if k in config}
    else:
        keys = ("hidden_size", "exit_dim", "num_draft_layers", "vocab_size", "rnn")
        state, names, settings = _apple_state(path), _APPLE_NAMES, {}
    missing = [k for k in keys if k not in config]
    if missing:
        raise ReDrafterConfigError(f"redrafter_model_path: config.json lacks {', '.join(missing)}")
    hidden, exit_dim, layers, vocab, rnn = (config[k] for k in keys)
    hidden, exit_dim, layers, vocab = int(hidden), int(exit_dim), int(layers), int(vocab)
    if hidden != hidden_size or vocab != vocab_size:
        raise ReDrafterConfigError(f"redrafter: the drafter has hidden size {hidden} and vocab_size {vocab}; the "
                                   f"target has hidden_size {hidden_size} and vocab_size {vocab_size}")
    drafter = Drafter(hidden, exit_dim, layers, vocab, bool(rnn), device)

    def take(kind: str, index: int | None = None, shape: tuple[int, ...] = ()) -> torch.Tensor:
        for name in names[kind]:
            name = name.format(j=index)
            if name in state:
                if tuple(state[name].shape) != shape:
                    raise ReDrafterConfigError(f"redrafter: {name} is {tuple(state[name].shape)}, expected {shape} "
                                               f"(hidden {hidden}, exit_dim {exit_dim}, vocab {vocab})")
                return state[name].float()
        raise ReDrafterConfigError(f"redrafter: the checkpoint has no {names[kind][0].format(j=index)}")

    with torch.no_grad():
        if drafter.input_proj_weight is not None:
            drafter.input_proj_weight.copy_(take("input_proj.weight", shape=(exit_dim, 2 * hidden)))
            drafter.input_proj_bias.copy_(take("input_proj.bias", shape=(exit_dim,)))
        for j in range(layers):
            drafter.block_weight[j].copy_(take("block.weight", j, (exit_dim, exit_dim)))
            drafter.block_bias[j].copy_(take("block.bias", j, (exit_dim,)))
        drafter.lm_head.copy_(take("lm_head", layers, (vocab, exit_dim)))
        if drafter.rnn:
            drafter.rnn_w.copy_(take("rnn_w", shape=(hidden, hidden)))
            drafter.rnn_u.copy_(take("rnn_u.weight", shape=(hidden, hidden)))
            drafter.rnn_u_bias.copy_(take("rnn_u.bias", shape=(hidden,)))
    return drafter, settings


_APPLE_NAMES = {
    "input_proj.weight": ["input_proj.weight", "input_projs.weight"],
    "input_proj.bias": ["input_proj.bias", "input_projs.bias"],
    "block.weight": ["lm_head.{j}.linear.weight", "lm_heads.{j}.linear.weight", "0.{j}.linear.weight"],
    "block.bias": ["lm_head.{j}.linear.bias", "lm_heads.{j}.linear.bias", "0.{j}.linear.bias"],
    "lm_head": ["lm_head.{j}.weight", "lm_heads.{j}.weight", "0.{j}.weight"],
    "rnn_w": ["rnn_w.weight"], "rnn_u.weight": ["rnn_u.weight"], "rnn_u.bias": ["rnn_u.bias"],
}
_TRTLLM_NAMES = {
    "input_proj.weight": ["drafter.input_proj.weight"], "input_proj.bias": ["drafter.input_proj.bias"],
    "block.weight": ["drafter.layers.{j}.linear.weight"], "block.bias": ["drafter.layers.{j}.linear.bias"],
    "lm_head": ["drafter.lm_head.weight"],
    "rnn_w": ["drafter.rnn_w.weight"], "rnn_u.weight": ["drafter.rnn_u.weight"], "rnn_u.bias": ["drafter.rnn_u.bias"],
}


def _apple_state(path: str) -> dict[str, torch.Tensor]:
    safetensors_path, pt_path = os.path.join(path, "model.safetensors"), os.path.join(path, "model.pt")
    if os.path.isfile(safetensors_path):
        with safe_open(safetensors_path, framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    if os.path.isfile(pt_path):
        return torch.load(pt_path, map_location="cpu", weights_only=True)
    raise ReDrafterConfigError(f"redrafter_model_path: {path!r} has neither model.safetensors nor model.pt")


def _trtllm_state(path: str, config: dict) -> dict[str, torch.Tensor]:
    try:
        return rank_tensors(path, config, "drafter.")
    except FileNotFoundError as err:
        raise ReDrafterConfigError(f"redrafter_model_path: {err}") from None


# ----- the executor's proposer -----

class ReDrafterDraftProposer(LastHiddenTreeProposer):
    """The executor's DraftProposer for ``decoding_mode redrafter``. Like Medusa's, it reads the
    target's final hidden state at each sequence's last computed token; the root is the sequence's
    last token. Greedy rows are verified by argmax over the packed beams (the longest accepted beam
    prefix); sampled ones by multi-draft rejection sampling, which keeps the target's law
    (``keeps_law``; verify.py, acceptance.py)."""

    keeps_law = True

    def __init__(self, drafter: Drafter, embed, num_beams: int, draft_len_per_beam: int):
        super().__init__()
        self.drafter, self.embed = drafter, embed
        self.num_beams, self.draft_len_per_beam = num_beams, draft_len_per_beam

    def draft(self, hidden: torch.Tensor, root: int) -> tuple[list[int], list[int]]:
        beams = self.drafter.beam_search(hidden, root, self.embed, self.num_beams, self.draft_len_per_beam)
        return pack_beams(beams.tolist())


def start_redrafter(runner, spec, *, engine_dir: str, has_state: bool) -> ReDrafterDraftProposer:
    """The proposer of ``decoding_mode redrafter`` (the drafter in ``spec.redrafter_model_path``,
    default the engine directory's ``redrafter/``), or ProposerConfigError naming the field. Beam
    settings: the request's config, else the checkpoint's (TensorRT-LLM's), else 5 x 5; they set
    ``spec.max_draft_len`` to the tree's largest size. The runner keeps its scored rows' hidden
    states from now on."""
    refuse_unless_one_rank_without_state(runner, "redrafter", has_state)
    path = spec.redrafter_model_path or os.path.join(engine_dir, "redrafter")
    try:
        drafter, settings = load_drafter(path, hidden_size=runner.model_config.hidden_size,
                                         vocab_size=runner.vocab_size, device=runner.device)
    except (ValueError, OSError) as err:
        raise ProposerConfigError(str(err)) from None
    beams = spec.redrafter_num_beams or settings.get("redrafter_num_beams", DEFAULT_NUM_BEAMS)
    length = spec.redrafter_draft_len_per_beam or settings.get("redrafter_draft_len_per_beam",
                                                               DEFAULT_DRAFT_LEN_PER_BEAM)
    error = beam_settings_error(beams, length)
    if error:
        raise ProposerConfigError(error)
    spec.max_draft_len = beams * length
    runner.keep_hidden_rows = True
    return ReDrafterDraftProposer(drafter, runner.model.embed_tokens, beams, length)


MAX_TREE_NODES = 64  # = executor_config.MAX_SPECULATIVE_DRAFT_LEN (a tree step is one chunk per sequence)


def beam_settings_error(num_beams, draft_len_per_beam) -> str | None:
    """None, or why redrafter_num_beams x redrafter_draft_len_per_beam cannot run."""
    for name, value in (("redrafter_num_beams", num_beams), ("redrafter_draft_len_per_beam", draft_len_per_beam)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            return f"{name} must be an integer >= 1, got {value!r}"
    if num_beams * draft_len_per_beam > MAX_TREE_NODES:
        return (f"redrafter_num_beams x redrafter_draft_len_per_beam = {num_beams} x {draft_len_per_beam} drafts; "
                f"a tree holds at most {MAX_TREE_NODES}")
    return None
