"""The executor's runtime settings: ``ExecutorConfig`` (the Triton model maps its parameters onto
these names: serving/executor_config.py), ``SpeculativeConfig``, and the checks that refuse a
value out of range with a message naming the field, the value and the rule (``ExecutorConfigError``).

Re-exported by engine/executor/executor.py and ``engine.executor``, where callers import them.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.executor.lookahead_sizes import LookaheadConfigError, sizes_of_config
from engine.executor.scheduler import POLICIES

MAX_LORA_RANK = 256


class ExecutorConfigError(ValueError):
    """An ExecutorConfig value is out of range; the message names field, value and rule."""


SPECULATIVE_MODES = ("ngram", "draft_model", "medusa", "lookahead", "eagle", "mtp", "redrafter")
SPECULATIVE_MODE_ALIASES = {"explicit_draft_tokens": "redrafter"}  # TensorRT-LLM's DecodingMode name for ReDrafter
MAX_SPECULATIVE_DRAFT_LEN = 64  # a verify step is a (k + 1)-token chunk per sequence; past this it is a prefill


@dataclass
class SpeculativeConfig:
    """Per-step drafts for decoding sequences (engine/executor/speculative/).

    ``mode``: "ngram" (prompt lookup: the tokens that followed the latest earlier occurrence of the
    sequence's last n tokens, n = max_matching_ngram_size down to 1) or "draft_model" (a second,
    smaller engine in ``draft_engine_dir`` with the target's tokenizer, drafting greedily with its
    own KV pool, as many tokens as the target's, and CUDA graphs: speculative/draft_model.py) or
    "medusa" (heads on the target's hidden states drafting a token tree: speculative/medusa.py) or
    "lookahead" (Jacobi window and n-gram pool, no extra weights: speculative/lookahead.py). Each
    step verifies up to ``max_draft_len`` drafts per sequence.
    """

    mode: str
    max_draft_len: int = 4
    max_matching_ngram_size: int = 3
    draft_engine_dir: str | None = None
    # "medusa": FasterDecoding medusa_lm_head heads on the target's hidden states (speculative/medusa.py),
    # drafting the tree medusa_choices spells ("{0}, {0, 0}, {1}" or a list of rank paths; None: a
    # small default); max_draft_len caps the tree's nodes.
    medusa_model_path: str | None = None
    medusa_choices: str | list[list[int]] | None = None
    # "lookahead": TensorRT-LLM's LookaheadDecodingConfig sizes (window W, n-gram N, verification set
    # G), all three required; max_draft_len becomes the tree's (N-1)*(W+G) drafts.
    lookahead_window_size: int | None = None
    lookahead_ngram_size: int | None = None
    lookahead_verification_set_size: int | None = None
    # "eagle": EAGLE-3 heads (speculative/eagle3.py; default <engine>/eagle3) drafting the eagle_choices
    # tree (rank paths; None: a small default), or with eagle_dynamic_tree EAGLE-2's dynamic tree
    # (eagle_dynamic_depth levels, eagle_dynamic_top_k children per expanded node and nodes expanded per
    # level: TensorRT-LLM's num_eagle_layers and dynamic_tree_max_topK). max_draft_len caps the nodes.
    eagle_model_path: str | None = None
    eagle_choices: str | list[list[int]] | None = None
    eagle_dynamic_tree: bool = False
    eagle_dynamic_depth: int = 5
    eagle_dynamic_top_k: int = 8
    # the head's products in FP8 (E4M3 weights quantized at load, W8A8: speculative/eagle3.py); None:
    # as the target (on for an FP8 engine, off otherwise)
    eagle_fp8_head: bool | None = None
    # "mtp": the engine's own multi-token prediction module (DeepSeek-V3's; speculative/mtp.py), run
    # max_draft_len times a step, each run reading the one before (one rank).
    # "redrafter" (alias "explicit_draft_tokens"): Apple's recurrent drafter (speculative/redrafter.py;
    # default <engine>/redrafter), beam search of redrafter_num_beams beams x redrafter_draft_len_per_beam
    # drafts (None: the checkpoint's, else 5 x 5); max_draft_len becomes their product.
    redrafter_model_path: str | None = None
    redrafter_num_beams: int | None = None
    redrafter_draft_len_per_beam: int | None = None

    def validate(self) -> "SpeculativeConfig":
        def require(ok: bool, message: str) -> None:
            if not ok:
                raise ExecutorConfigError(message)

        self.mode = str(self.mode).lower()
        self.mode = SPECULATIVE_MODE_ALIASES.get(self.mode, self.mode)
        require(self.mode in SPECULATIVE_MODES,
                f"SpeculativeConfig.mode value of '{self.mode}' is not supported; allowed: {', '.join(SPECULATIVE_MODES)}")
        require(self.mode != "draft_model" or (isinstance(self.draft_engine_dir, str) and bool(self.draft_engine_dir)),
                f"SpeculativeConfig.draft_engine_dir must name the draft engine's directory with mode 'draft_model', "
                f"got {self.draft_engine_dir!r}")
        if self.mode == "lookahead":
            self.max_draft_len = self._lookahead_draft_len()
        require(isinstance(self.max_draft_len, int) and 1 <= self.max_draft_len <= MAX_SPECULATIVE_DRAFT_LEN,
                f"SpeculativeConfig.max_draft_len must be an integer in 1..{MAX_SPECULATIVE_DRAFT_LEN}, "
                f"got {self.max_draft_len!r}")
        for name in ("eagle_dynamic_depth", "eagle_dynamic_top_k"):
            value = getattr(self, name)
            require(isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_SPECULATIVE_DRAFT_LEN,
                    f"SpeculativeConfig.{name} must be an integer in 1..{MAX_SPECULATIVE_DRAFT_LEN}, got {value!r}")
        require(self.eagle_fp8_head is None or isinstance(self.eagle_fp8_head, bool),
                f"SpeculativeConfig.eagle_fp8_head must be true, false or unset (as the target), got {self.eagle_fp8_head!r}")
        require(isinstance(self.max_matching_ngram_size, int) and self.max_matching_ngram_size >= 1,
                f"SpeculativeConfig.max_matching_ngram_size must be an integer >= 1, got {self.max_matching_ngram_size!r}")
        return self

    def _lookahead_draft_len(self) -> int:
        try:
            return sizes_of_config(self).check(limit=MAX_SPECULATIVE_DRAFT_LEN).num_draft_tokens
        except LookaheadConfigError as err:
            raise ExecutorConfigError(str(err)) from None


@dataclass
class ExecutorConfig:
    """Runtime knobs of the executor (the Triton model maps its parameters onto these names).

    ``max_batch_size``/``max_num_tokens`` default to (and may not exceed) the engine's build
    limits. The KV pool holds ``max_tokens_in_paged_kv_cache`` tokens when set, else
    ``kv_cache_free_gpu_mem_fraction`` of the free device memory (CPU: the runner's default).
    """

    max_batch_size: int | None = None
    max_num_tokens: int | None = None
    max_queue_size: int | None = None  # None or 0: unbounded
    max_beam_width: int = 1
    batch_scheduler_policy: str = "guaranteed_no_evict"
    batching_type: str = "inflight"  # or "static" (TRT-LLM's gpt_model_type v1): batches run to completion
    kv_cache_free_gpu_mem_fraction: float = 0.9
    max_tokens_in_paged_kv_cache: int | None = None
    enable_kv_cache_reuse: bool = True
    # KV host tier (engine/executor/kv_host_tier.py, TRT-LLM's names): with reuse on, reusable blocks
    # evicted from the device pool are kept in this many bytes of host memory (pinned on CUDA) and
    # copied back on a prefix hit; 0: none (leader mode: bytes per rank, each keeping its shard).
    # kv_cache_onboard_blocks False: host hits are not brought back, which here (kernels read KV from
    # the device pool only) makes them misses: no tier is made.
    kv_cache_host_memory_bytes: int = 0
    kv_cache_onboard_blocks: bool = True
    # KV events (engine/executor/kv_events.py): a ZMQ address to bind a PUB socket at (tcp://*:5557)
    # publishing vLLM-shaped block stored/removed batches under this topic; "": none.
    kv_cache_events_endpoint: str = ""
    kv_cache_events_topic: str = "kv-events"
    enable_chunked_context: bool = False
    exclude_input_from_output: bool = False
    normalize_log_probs: bool = True
    # The KV pool's element type: None/"auto" (the engine's build choice) or "fp8" (E4M3, half the bytes).
    kv_cache_dtype: str | None = None
    # Overlapped scheduling (engine/executor/overlap.py) is on unless this is set (TRT-LLM's name).
    disable_overlap_scheduler: bool = False
    # A streaming response carries at least this many new tokens (SGLang's and vLLM's name). The
    # first token and the final response go out at once; between them a stream's tokens wait until
    # this many are ready. 1 sends every token. Larger values cut the responses each stream costs
    # the serving path, for small fast models whose streams outrun it.
    stream_interval: int = 1
    iter_stats_max_iterations: int = 1000
    device: str | None = None
    # Guided decoding (engine/executor/guided.py): "xgrammar" enables it; unset, a guided request is
    # refused. The grammar vocabulary comes from tokenizer_dir (default: the engine directory's
    # tokenizer files); grammar_cache_size compiled grammars are kept (LRU).
    guided_decoding_backend: str | None = None
    tokenizer_dir: str | None = None
    grammar_cache_size: int = 512
    # LoRA (engine/lora/): enable_lora allocates device slots for adapters of rank up to
    # max_lora_rank (the reference's lora_cache_max_adapter_size) on every adapted projection:
    # max_loras of them, or else as many as lora_cache_gpu_memory_fraction of the free device
    # memory holds (CPU: 8), at most max_batch_size. Parsed adapters stay in a host tier of
    # lora_cache_host_memory_bytes. lora_prefetch_dir: adapters loaded at start (engine/lora/prefetch.py).
    enable_lora: bool = False
    max_lora_rank: int = 64
    max_loras: int | None = None
    lora_cache_gpu_memory_fraction: float = 0.05
    lora_cache_host_memory_bytes: int = 1 << 30
    lora_prefetch_dir: str | None = None
    # Speculative decoding (engine/executor/speculative/): per-step drafts (None: off), and the most
    # draft tokens a request may send itself (Request.external_draft; TensorRT-LLM's max_draft_len).
    speculative: SpeculativeConfig | None = None
    max_draft_len: int = 8
    # Encoder-decoder engines (engine/encoder_decoder/): the encoder's engine directory (None: the one
    # the decoder's config.json names, ../encoder) and the share of the KV memory that holds the
    # requests' cross-attention K/V (None: 0.5; the rest is the decoder's self-attention pool).
    encoder_engine_dir: str | None = None
    cross_kv_cache_fraction: float | None = None
    # The cross-KV pool's element type: None/"auto" (the self pool's, kv_cache_dtype above) or "fp8"
    # (E4M3 whatever the self pool's type: half the bytes every decode step's cross-attention reads).
    cross_kv_cache_dtype: str | None = None

    def validate(self) -> "ExecutorConfig":
        def require(ok: bool, message: str) -> None:
            if not ok:
                raise ExecutorConfigError(message)

        for name in ("max_batch_size", "max_num_tokens", "max_tokens_in_paged_kv_cache"):
            value = getattr(self, name)
            require(value is None or (isinstance(value, int) and value > 0),
                    f"ExecutorConfig.{name} must be a positive integer or None, got {value!r}")
        require(self.max_queue_size is None or self.max_queue_size >= 0,
                f"ExecutorConfig.max_queue_size must be >= 0 (0 or None: unbounded), got {self.max_queue_size!r}")
        require(isinstance(self.max_beam_width, int) and self.max_beam_width >= 1,
                f"ExecutorConfig.max_beam_width must be an integer >= 1, got {self.max_beam_width!r}")
        self.batch_scheduler_policy = str(self.batch_scheduler_policy).lower()
        require(self.batch_scheduler_policy in POLICIES,
                f"batch_scheduler_policy value of '{self.batch_scheduler_policy}' is not supported; "
                f"allowed: {', '.join(POLICIES)}")
        self.batching_type = {"inflight_fused_batching": "inflight", "inflight_batching": "inflight",
                              "v1": "static"}.get(str(self.batching_type).lower(), str(self.batching_type).lower())
        require(self.batching_type in ("inflight", "static"),
                f"batching_type value of '{self.batching_type}' is not supported; allowed: inflight, static")
        require(0 < self.kv_cache_free_gpu_mem_fraction <= 1,
                f"ExecutorConfig.kv_cache_free_gpu_mem_fraction must be in (0, 1], got {self.kv_cache_free_gpu_mem_fraction!r}")
        require(self.cross_kv_cache_fraction is None or 0 < self.cross_kv_cache_fraction < 1,
                f"ExecutorConfig.cross_kv_cache_fraction must be in (0, 1), got {self.cross_kv_cache_fraction!r}")
        require(self.kv_cache_dtype in (None, "auto", "fp8"),
                f"kv_cache_dtype value of '{self.kv_cache_dtype}' is not supported; allowed: auto, fp8")
        require(self.cross_kv_cache_dtype in (None, "auto", "fp8"),
                f"cross_kv_cache_dtype value of '{self.cross_kv_cache_dtype}' is not supported; allowed: auto, fp8")
        require(isinstance(self.stream_interval, int) and self.stream_interval >= 1,
                f"ExecutorConfig.stream_interval must be an integer >= 1 (tokens per streamed response), "
                f"got {self.stream_interval!r}")
        self.guided_decoding_backend = (str(self.guided_decoding_backend).lower()
                                        if self.guided_decoding_backend else None)
        require(self.guided_decoding_backend in (None, "xgrammar"),
                f"guided_decoding_backend value of '{self.guided_decoding_backend}' is not supported; "
                "allowed: xgrammar (or leave it unset to refuse guided requests)")
        require(isinstance(self.grammar_cache_size, int) and self.grammar_cache_size >= 1,
                f"ExecutorConfig.grammar_cache_size must be an integer >= 1, got {self.grammar_cache_size!r}")
        require(isinstance(self.max_lora_rank, int) and 1 <= self.max_lora_rank <= MAX_LORA_RANK,
                f"ExecutorConfig.max_lora_rank must be an integer in 1..{MAX_LORA_RANK}, got {self.max_lora_rank!r}")
        require(self.max_loras is None or (isinstance(self.max_loras, int) and self.max_loras >= 1),
                f"ExecutorConfig.max_loras must be a positive integer or None, got {self.max_loras!r}")
        require(0 < self.lora_cache_gpu_memory_fraction <= 1,
                f"ExecutorConfig.lora_cache_gpu_memory_fraction must be in (0, 1], got {self.lora_cache_gpu_memory_fraction!r}")
        require(isinstance(self.lora_cache_host_memory_bytes, int) and self.lora_cache_host_memory_bytes >= 0,
                f"ExecutorConfig.lora_cache_host_memory_bytes must be an integer >= 0, got {self.lora_cache_host_memory_bytes!r}")
        require(self.speculative is None or isinstance(self.speculative, SpeculativeConfig),
                f"ExecutorConfig.speculative must be a SpeculativeConfig or None, got {type(self.speculative).__name__}")
        if self.speculative is not None:
            self.speculative.validate()
        require(isinstance(self.max_draft_len, int) and 0 <= self.max_draft_len <= MAX_SPECULATIVE_DRAFT_LEN,
                f"ExecutorConfig.max_draft_len must be an integer in 0..{MAX_SPECULATIVE_DRAFT_LEN}, got {self.max_draft_len!r}")
        require(isinstance(self.kv_cache_host_memory_bytes, int) and not isinstance(self.kv_cache_host_memory_bytes, bool)
                and self.kv_cache_host_memory_bytes >= 0,
                f"ExecutorConfig.kv_cache_host_memory_bytes must be an integer >= 0, got {self.kv_cache_host_memory_bytes!r}")
        require(isinstance(self.kv_cache_events_endpoint, str) and (not self.kv_cache_events_endpoint
                or "://" in self.kv_cache_events_endpoint),
                f"ExecutorConfig.kv_cache_events_endpoint must be empty or a ZMQ address such as tcp://*:5557, "
                f"got {self.kv_cache_events_endpoint!r}")
        require(isinstance(self.kv_cache_events_topic, str),
                f"ExecutorConfig.kv_cache_events_topic must be a string, got {self.kv_cache_events_topic!r}")
        require(isinstance(self.kv_cache_onboard_blocks, bool),
                f"ExecutorConfig.kv_cache_onboard_blocks must be true or false, got {self.kv_cache_onboard_blocks!r}")
        require(self.iter_stats_max_iterations >= 1,
                f"ExecutorConfig.iter_stats_max_iterations must be >= 1, got {self.iter_stats_max_iterations!r}")
        return self
