"""SsmSpec: what a hybrid model's ``ModelConfig.ssm`` holds, validated once.

A hybrid model is a stack of pre-norm residual blocks, ``x += mixer(norm(x))``, each mixer one of:

- "mamba": a Mamba-2 layer (engine/ssm/mamba2.py), with a per-request state;
- "attention": GQA attention over the paged KV cache, with rope (Bamba: partial rotary) or none
  (Nemotron-H);
- "mlp": the feed-forward, gated SiLU (Bamba: ``down(silu(gate) * up)``) or not
  (Nemotron-H: ``down(relu(up)^2)``);
- "parallel": a Mamba-2 layer and attention side by side on the same normed input, their outputs
  summed (Falcon-H1);
- "moe": top-k routed experts (Jamba, Granite 4.0 H-Tiny / H-Small, Nemotron-H MoE layers), ModelConfig's
  num_experts / num_experts_per_tok / moe_intermediate_size / norm_topk_prob (and Nemotron-H's
  topk_method noaux_tc, n_group, topk_group, routed_scaling_factor), run by engine/models/moe.py's
  SparseMoeBlock with ``mlp_act`` as the experts' activation (silu: SwiGLU; relu2: relu(up x)^2);
  with ``moe_shared_size`` > 0 (Granite 4.0, Nemotron-H) a dense MLP of that width (``mlp_act``)
  reads the same normed input beside the experts and the two outputs add.

Bamba's and Granite 4.0's decoder layers are two such blocks (mixer, then MLP); a Nemotron-H
layer is one. ``blocks``
lists the kinds in order; ``ModelConfig.num_layers`` stays the checkpoint's layer count.

Mamba-2 shape: ``num_heads`` x ``head_dim`` channels (the layer's inner width), ``n_groups``
groups of B and C of ``d_state`` each, a ``d_conv``-tap causal conv over x|B|C, ``dt_limit``
[min, max or null] clamping dt in prompt chunks (kernels/ssd_scan.py), ``state_dtype`` the SSM
state's dtype (null: the model's; Nemotron-H keeps it in float32).

Mamba-1 (``mamba_version`` 1: MambaForCausalLM, Jamba; engine/ssm/mamba1.py): every channel of
the inner width is its own "head" (``num_heads`` = d_inner, ``head_dim`` 1: each has its own dt),
``n_groups`` 1 (B and C shared by all channels), dt from a ``dt_rank``-wide projection, A a full
(d_inner, d_state) matrix, the conv over x only, no gated norm (``gated_norm`` gate_only), and with
``dt_norms`` (Jamba) RMSNorms on dt, B and C after x_proj. Its SSM state per sequence is
(d_inner, d_state), Mamba-2's (heads, head_dim, d_state): ``ssm_state_shape`` says which, so the
state pool (engine/ssm/hybrid.py) holds either without a branch.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from engine.config import ConfigError

BLOCK_KINDS = ("mamba", "attention", "mlp", "parallel", "moe")  # parallel: mamba(h) + attention(h), one norm (Falcon-H1)
MAMBA_VERSIONS = (1, 2)
# Where the Mamba output's gate sits: rmsnorm(y * silu(z)) (Mamba-2's), rmsnorm(y) * silu(z), or
# y * silu(z) with no norm (Falcon-H1's mamba_rms_norm False).
GATED_NORMS = ("norm_after_gate", "norm_before_gate", "gate_only")
MLP_ACTIVATIONS = ("silu", "relu2")  # silu: gated [gate | up]; relu2: relu(up)^2, not gated
STATE_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class SsmSpec:
    blocks: list
    num_heads: int
    head_dim: int
    d_state: int
    n_groups: int
    d_conv: int
    conv_bias: bool = True
    proj_bias: bool = False
    dt_limit: list = (0.0, None)
    mlp_act: str = "silu"
    attention_rope: bool = True
    state_dtype: str | None = None
    # Granite 4.0 (muP-style scalars; 1.0 / None elsewhere): embeddings times embedding_multiplier,
    # every block's output times residual_multiplier before it joins the residual, attention scores
    # times attention_scale (None: head_dim ** -0.5), logits divided by logits_scaling.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_scale: float | None = None
    logits_scaling: float = 1.0
    gated_norm: str = "norm_after_gate"  # GATED_NORMS
    # Falcon-H1: the checkpoint's muP multipliers that the build folded into the weights (what it
    # multiplied by, for the record; the engine reads none of them). None elsewhere.
    folded_multipliers: dict | None = None
    # Mamba-1 (module docstring): the selective scan of Mamba / Jamba instead of Mamba-2's SSD.
    mamba_version: int = 2
    dt_rank: int = 0  # Mamba-1: x_proj's dt rows, projected up to d_inner by dt_proj
    dt_norms: bool = False  # Jamba: RMSNorm (eps = norm_eps) on dt, B and C after x_proj
    # "moe" blocks: the width of the shared MLP beside the routed experts (Granite 4.0's shared_mlp);
    # 0: none (Jamba)
    moe_shared_size: int = 0

    @property
    def inner(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels the conv runs over: Mamba-2 x (inner), B and C (n_groups * d_state each);
        Mamba-1 x only."""
        return self.inner if self.mamba_version == 1 else self.inner + 2 * self.n_groups * self.d_state

    @property
    def ssm_state_shape(self) -> tuple[int, ...]:
        """One sequence's SSM state in one Mamba layer: Mamba-2 (heads, head_dim, d_state), Mamba-1
        (d_inner, d_state)."""
        if self.mamba_version == 1:
            return (self.inner, self.d_state)
        return (self.num_heads, self.head_dim, self.d_state)

    def dt_range(self) -> tuple[float, float]:
        low, high = self.dt_limit
        return float(low), float("inf") if high is None else float(high)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["blocks"], data["dt_limit"] = list(self.blocks), list(self.dt_limit)
        return data

    @classmethod
    def from_dict(cls, data) -> "SsmSpec":
        if not isinstance(data, dict):
            raise ConfigError(f"ModelConfig.ssm must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"ModelConfig.ssm: unknown keys {unknown}; allowed keys are {sorted(known)}")
        try:
            spec = cls(**data)
        except TypeError as err:
            raise ConfigError(f"ModelConfig.ssm: {err}") from None
        return spec.validate()

    def validate(self) -> "SsmSpec":
        def require(ok: bool, message: str) -> None:
            if not ok:
                raise ConfigError(f"ModelConfig.ssm: {message}")

        require(isinstance(self.blocks, (list, tuple)) and self.blocks and all(k in BLOCK_KINDS for k in self.blocks),
                f"blocks must list one of {', '.join(BLOCK_KINDS)} per residual block, got {self.blocks!r}")
        require("mamba" in self.blocks or "parallel" in self.blocks, "blocks must hold at least one mamba block")
        require(self.gated_norm in GATED_NORMS,
                f"gated_norm must be one of {', '.join(GATED_NORMS)}, got {self.gated_norm!r}")
        for name in ("num_heads", "head_dim", "d_state", "n_groups", "d_conv"):
            value = getattr(self, name)
            require(isinstance(value, int) and not isinstance(value, bool) and value > 0,
                    f"{name} must be a positive integer, got {value!r}")
        require(self.d_conv >= 2, f"d_conv must be >= 2, got {self.d_conv}")
        require(self.num_heads % self.n_groups == 0,
                f"num_heads ({self.num_heads}) must be a multiple of n_groups ({self.n_groups})")
        require(isinstance(self.dt_limit, (list, tuple)) and len(self.dt_limit) == 2 and self.dt_limit[0] >= 0
                and (self.dt_limit[1] is None or self.dt_limit[1] > self.dt_limit[0]),
                f"dt_limit must be [min >= 0, max > min or null], got {self.dt_limit!r}")
        require(self.mlp_act in MLP_ACTIVATIONS,
                f"mlp_act must be one of {', '.join(MLP_ACTIVATIONS)}, got {self.mlp_act!r}")
        for name in ("embedding_multiplier", "residual_multiplier", "logits_scaling"):
            value = getattr(self, name)
            require(isinstance(value, (int, float)) and value > 0, f"{name} must be a positive number, got {value!r}")
        require(self.attention_scale is None or (isinstance(self.attention_scale, (int, float)) and self.attention_scale > 0),
                f"attention_scale must be a positive number or null, got {self.attention_scale!r}")
        require(self.state_dtype is None or self.state_dtype in STATE_DTYPES,
                f"state_dtype must be null or one of {', '.join(STATE_DTYPES)}, got {self.state_dtype!r}")
        require(isinstance(self.moe_shared_size, int) and self.moe_shared_size >= 0,
                f"moe_shared_size must be a non-negative integer, got {self.moe_shared_size!r}")
        require(self.mamba_version in MAMBA_VERSIONS,
                f"mamba_version must be one of {MAMBA_VERSIONS}, got {self.mamba_version!r}")
        if self.mamba_version == 1:
            require(self.head_dim == 1 and self.n_groups == 1 and self.gated_norm == "gate_only"
                    and "parallel" not in self.blocks,
                    "mamba_version 1 takes head_dim 1 (num_heads = the inner width), n_groups 1, gated_norm "
                    f"gate_only and no parallel blocks, got head_dim {self.head_dim}, n_groups {self.n_groups}, "
                    f"gated_norm {self.gated_norm!r}")
            require(isinstance(self.dt_rank, int) and self.dt_rank > 0,
                    f"mamba_version 1 needs dt_rank > 0, got {self.dt_rank!r}")
        else:
            require(self.dt_rank == 0 and not self.dt_norms, "dt_rank and dt_norms are Mamba-1's (mamba_version 1)")
        return self


def _nemotron_h_shape(**overrides) -> dict:
    """ModelConfig fields of a dense Nemotron-H (benchmarks' random-weight engines: --model)."""
    base = dict(hidden_size=4096, num_layers=52, num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=21504,
                vocab_size=131072, mamba_heads=128, mamba_head_dim=64, n_groups=8, d_state=128, attention_every=13)
    base.update(overrides)
    layers = base["num_layers"]
    # Nemotron-H-8B: 24 Mamba-2, 4 attention and 24 MLP layers; the positions of the attention layers
    # are spread evenly here (a step's work and memory do not depend on where they sit).
    blocks = []
    for i in range(layers):
        if (i + 1) % base["attention_every"] == 0:
            blocks.append("attention")
        else:
            blocks.append("mamba" if len([b for b in blocks if b != "attention"]) % 2 == 0 else "mlp")
    spec = SsmSpec(blocks=blocks, num_heads=base["mamba_heads"], head_dim=base["mamba_head_dim"], d_state=base["d_state"],
                   n_groups=base["n_groups"], d_conv=4, dt_limit=[0.001, None], mlp_act="relu2", attention_rope=False,
                   state_dtype="float32").validate()
    return dict(architecture="NemotronHForCausalLM", vocab_size=base["vocab_size"], hidden_size=base["hidden_size"],
                num_layers=layers, num_heads=base["num_heads"], num_kv_heads=base["num_kv_heads"],
                head_dim=base["head_dim"], intermediate_size=base["intermediate_size"], norm_eps=1e-5,
                max_position_embeddings=131072, hidden_act="silu", ssm=spec.to_dict())


# Nemotron-H-8B's published shape (52 layers: 24 Mamba-2, 4 attention, 24 relu^2 MLP), and a tiny
# one for CPU smoke runs of the benchmarks.
NEMOTRON_H_8B_SHAPE = _nemotron_h_shape()
NEMOTRON_H_TINY_SHAPE = _nemotron_h_shape(hidden_size=64, num_layers=8, num_heads=4, num_kv_heads=2, head_dim=16,
                                          intermediate_size=128, vocab_size=512, mamba_heads=4, mamba_head_dim=16,
                                          n_groups=2, d_state=16, attention_every=4)


def _jamba_shape(**overrides) -> dict:
    """ModelConfig fields of a Jamba (benchmarks' random-weight engines), its layers laid out by
    JambaConfig's rules: attention every attn_period layers from attn_offset, routed experts every
    expert_period layers from expert_offset (engine/ssm/convert.py reads the same from a checkpoint)."""
    base = dict(hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, intermediate_size=14336,
                vocab_size=65536, num_experts=16, top_k=2, d_state=16, dt_rank=256, attn_period=8, attn_offset=4,
                expert_period=2, expert_offset=1)
    base.update(overrides)
    blocks = []
    for i in range(base["num_layers"]):
        blocks.append("attention" if i % base["attn_period"] == base["attn_offset"] else "mamba")
        blocks.append("moe" if i % base["expert_period"] == base["expert_offset"] else "mlp")
    spec = SsmSpec(blocks=blocks, num_heads=2 * base["hidden_size"], head_dim=1, d_state=base["d_state"], n_groups=1,
                   d_conv=4, mlp_act="silu", attention_rope=False, gated_norm="gate_only", mamba_version=1,
                   dt_rank=base["dt_rank"], dt_norms=True).validate()
    return dict(architecture="JambaForCausalLM", vocab_size=base["vocab_size"], hidden_size=base["hidden_size"],
                num_layers=base["num_layers"], num_heads=base["num_heads"], num_kv_heads=base["num_kv_heads"],
                head_dim=base["hidden_size"] // base["num_heads"], intermediate_size=base["intermediate_size"],
                norm_eps=1e-6, max_position_embeddings=262144, hidden_act="silu", num_experts=base["num_experts"],
                num_experts_per_tok=base["top_k"], moe_intermediate_size=base["intermediate_size"],
                norm_topk_prob=False, ssm=spec.to_dict())


# Jamba-1.5-Mini's published shape (32 layers: 28 Mamba-1 of width 8192, 4 attention; 16 of 16 MLPs
# routed over 16 experts, top 2: 52B parameters, 12B active), and a tiny one for CPU smoke runs.
JAMBA_MINI_SHAPE = _jamba_shape()
JAMBA_TINY_SHAPE = _jamba_shape(hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=128,
                                vocab_size=512, num_experts=4, dt_rank=4, attn_period=4, attn_offset=2)
