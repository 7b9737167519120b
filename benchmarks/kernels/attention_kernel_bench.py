#!/usr/bin/env python3
"""Paged attention alone, at the shapes of TensorRT-LLM's throughput table (issue 32): one layer of
Llama-3.1-8B's heads (32 query heads, 8 KV heads, 128 dims), FP8 or bf16 pool.

    PYTHONPATH=$PWD python benchmarks/kernels/attention_kernel_bench.py [--pool fp8,bf16] [--cases ...]
        [--sweep_prefill 64:64:4:2,128:64:8:3,...] [--sweep_decode 32:1:3,64:4:3,...] [--markdown FILE]

Cases (``CASES``): prompt chunks alone (4 x 2,048, 8 x 1,000, an 8,192-token chunk over a 12k prefix),
the mixed step of 2048/128 (four 2,048-token prompts beside 480 decode rows over 2.1k contexts), and
decode-only steps (532 rows over 1.5k, 194 over 5.25k, 1,024 over 192), over pages shuffled through
the pool (``--page_order in_order``: each sequence's pages adjacent). Steps with prompt tokens pass
a tile map, as the executor's CUDA graphs of such steps do (engine/executor/prefill_graphs.py; an eager
step's grid also spans every sequence's would-be prompt tiles). Each case is timed as a CUDA
graph of 10 calls (no launch overhead), mean of 3 replays after a warm-up one; the pool's blocks are handed out
shuffled and it is far larger than L2, so the keys come from HBM as in a served step.

Reported per case: microseconds per call (one layer), the dot-product work rate (4 * head_dim flops
per visible query-key pair and query head: QK^T and PV) and the rate at which the pool's K/V bytes of
the batch's contexts are read once (what bounds decode).

``--pool_layout head_major``: the pool stored as (blocks, KV heads, PAGE, HEAD_DIM), each head's page one
contiguous run, and handed to the kernels as a permuted view (they read the pool through its strides);
the default is the engine's (blocks, PAGE, KV heads, HEAD_DIM).

``--rotary_append``: decode cases once more in the form a served decode step runs them (kernels/
rope_attention.py: q and the new k arrive unrotated; the kernel rotates them and writes the new K/V).

``--layers 32 --pool_gib 123.5`` (issue 51: a served decode step's address translation): the pool holds 32 layers in
the engine's memory order (engine/executor/runner.py allocate_kv_cache) and is at least that large, the batch's pages
spread over all of it; each timed call attends over every layer in turn (a different part of the pool each time, as a
served step does, where the default replays one layer's few GiB) and figures are per layer. Against the default
(one layer, just the batch's pages), and with ``--page_order in_order``, it tells whether pages scattered over a
pool far larger than the TLBs cover slow the reads.

``--splits 1,2,4``: decode cases again with the key splits forced to each count (what the default
tiling does with them: wave quantization of long-context batches).

``--grid`` (issue 51's table, decode alone): contexts 20k / 8k / 2k x batches 8 / 64 / 256, 48 x 21,000 and
1,024 x 2k, FP8 and bf16 pools; an FP8 pool once in each way its E4M3 K/V can widen (``--grid_widenings``, default
every one of kernels/triton_attention.py FP8_WIDENINGS: the $TRITONLLM_ATTN_FP8_BITS switch), in the served form
(``+rotary append``) with Triton's widening, the default one and "v" where run, and at 8-64 sequences over 16k
keys or more with the key splits forced to 1 / 2 / 4 / 8; ``--grid_more`` adds FP8 variants by words
(parsed_variant: widening, TMA, tiling, splits, split policy, served form, the keys-major kernel ``km`` / ``km=0``),
for bf16 pools too (``--pool bf16 --grid_more "default;km=0"``: the served choice, keys-major for split launches,
against the default kernel), ``--grid_no_standard`` runs only those,
``--grid_cases`` other cases. Each case's pool is built once for all its variants. Reported besides us a layer:
the K/V bytes read per second, their share of benchmarks/common.py copy_bandwidth (an eager 2 GiB copy, read +
written bytes, measured first in the same process), and the decode config each variant launched.

``--grid_more`` words for issue 51's split counts: ``splits=N`` any count (the merge pads a count that is not a power
of two), ``policy=h200-any`` (kernels/triton_attention.py ANY_COUNT_POLICIES: the cost over every count 1..8), and
``replay``: the case as a decode graph's replay runs it (meta.decode_splits set: the capture's grid of
captured_splits() splits, the replay asking for decode_active_splits' count of them). Each --grid row also says how
many of the launched tiling's programs an SM holds (recorded after its first launch), the programs with work and the
waves they take (programs / (that x SMs)); --json FILE writes the rows.

``--dry_run_cpu`` (under TRITON_INTERPRET=1, no GPU): the same runs on CPU tensors, each "timed" by one eager call's
wall time (meaningless figures; no copy bandwidth, residency or CUDA graph): shakes out a lane's command line and its
variants' plumbing with a tiny case before it goes to the GPU.

``--cases prompt20k`` (issue 51's prompt side of 20000/2000, PROMPT_CHUNKS_20K: chunks of 8,192 ending at contexts
8,192 / 16,384 / 20,000 and the last 3,616 of a 20k prompt; not in the default list; any other as "chunk N over C"),
``--sdpa_anchor`` (torch's flash / cuDNN attention at each one-chunk case, bf16 dense K/V: sdpa_anchor), ``--check``
(each case's output against the torch reference where small enough), ``--pivot`` (one line per tiling, one column per
case, the speed-up over the default), ``--device cpu`` (a dry run under TRITON_INTERPRET=1, tiny cases). Each row
names the prompt-chunk tiling it ran (BMxBNxWxS).

``--sweep_prefill BM:BN:WARPS:STAGES,...`` and ``--sweep_decode BN:WARPS:STAGES[:tma],...`` time the cases
again with the prompt-chunk or decode-row tiling forced to each entry (kernels/triton_attention.py's
``_prefill_config`` / ``_decode_config`` replaced for the run), to choose those tables. To compare
against another commit, run this file with PYTHONPATH at that commit's tree (its kernels are timed).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

from kernels.linear import graph_time_ms

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 32

# name -> [(cached tokens, new tokens), ...]
CASES: dict[str, list[tuple[int, int]]] = {
    "prefill 4x2048": [(0, 2048)] * 4,
    "prefill 8x1000": [(0, 1000)] * 8,
    "chunk 8192 over 12k": [(11808, 8192)],
    "mixed 2048/128 (4x2048 + 480x2.1k decode)": [(0, 2048)] * 4 + [(2100, 1)] * 480,
    "decode 532x1500": [(1499, 1)] * 532,
    "decode 194x5250": [(5249, 1)] * 194,
    "decode 264x2500": [(2499, 1)] * 264,  # 2048/2048's plateau
    "decode 1024x192": [(191, 1)] * 1024,
    "decode 48x21000": [(20999, 1)] * 48,  # 20000/2000's plateau
    # 20000/2000's prompt side (issue 51): --max-num-tokens 8192 cuts a 20k prompt into chunks of 8,192, 8,192 and
    # 3,616, each over every earlier key (full) and causal within itself; "over C": the chunk ends at context C.
    "chunk 8192 over 8192": [(0, 8192)],
    "chunk 8192 over 16384": [(8192, 8192)],
    "chunk 8192 over 20000": [(11808, 8192)],  # = "chunk 8192 over 12k", named for 20000/2000
    "chunk 3616 over 20000": [(16384, 3616)],  # the last chunk of a 20k prompt
}
PROMPT_CHUNKS_20K = ("chunk 8192 over 8192", "chunk 8192 over 16384", "chunk 8192 over 20000", "chunk 3616 over 20000")


PAGE_ORDER = "shuffled"  # or "in_order": --page_order
POOL_LAYOUT = "token_major"  # or "head_major": --pool_layout
POOL_LAYERS = 1  # --layers: the pool holds this many layers, and each timed call attends over every one in turn
POOL_GIB = 0.0  # --pool_gib: the pool (all its layers, K and V) at least this large, the batch's pages spread over it
DEVICE = "cuda"  # --device cpu: a dry run under TRITON_INTERPRET=1 (tiny cases; wall-clock "times", checks that count)


def half_dtype() -> torch.dtype:
    """The queries' dtype and a "bf16" pool's: bfloat16, but float16 on the CPU (Triton's interpreter gets bf16
    dots wrong, tests/kernels/kernel_testing.py; float16 takes the same path through the kernel)."""
    return torch.float16 if DEVICE == "cpu" else torch.bfloat16


def pool_num_blocks(needed: int, layers: int, pool_gib: float, itemsize: int) -> int:
    """Blocks of the pool: the ``needed`` pages of the batch and block 0 (the tables' padding), or as many as
    ``pool_gib`` GiB of ``layers`` layers' K and V hold, whichever is more."""
    block_bytes = 2 * layers * PAGE * NUM_KV_HEADS * HEAD_DIM * itemsize
    return max(needed + 1, int(pool_gib * 2**30) // block_bytes)


def page_ids(needed: int, num_blocks: int, order: str, gen: torch.Generator | None = None) -> torch.Tensor:
    """The ``needed`` block ids the batch's pages take, in table order, from blocks 1 .. num_blocks - 1 (block 0:
    table padding): "shuffled", drawn at random from the whole pool (a large pool's pages land all over it, as the
    engine's do after its free list has churned); "in_order", 1, 2, ... (each sequence's pages adjacent)."""
    assert needed < num_blocks, f"{needed} pages do not fit {num_blocks} blocks with block 0 kept for padding"
    if order == "in_order":
        return torch.arange(1, needed + 1, device=getattr(gen, "device", "cpu"))
    return torch.randperm(num_blocks - 1, generator=gen, device=getattr(gen, "device", "cpu"))[:needed] + 1


def layered_pool(num_blocks: int, layers: int, pool_dtype: torch.dtype, layout: str, device,
                 gen: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(k_cache, v_cache), each (layers, num_blocks, PAGE, KV heads, HEAD_DIM) views of one pool in the engine's
    memory order (engine/executor/runner.py allocate_kv_cache: layers, then K / V, then blocks), random values.
    head_major: each block stores its heads one after another, each head's page one contiguous run, and the
    views permute it back (the kernels read the pool through its strides). Filled a layer's K or V at a time
    (random bf16 rounded to the pool's type: one plane's temporary, not the whole pool's)."""
    inner = (NUM_KV_HEADS, PAGE) if layout == "head_major" else (PAGE, NUM_KV_HEADS)
    pool = torch.empty((layers, 2, num_blocks, *inner, HEAD_DIM), dtype=pool_dtype, device=device)
    for layer in range(layers):
        for plane in range(2):
            pool[layer, plane] = torch.randn(pool.shape[2:], device=device, dtype=torch.bfloat16, generator=gen)
    if layout == "head_major":
        pool = pool.transpose(3, 4)
    return pool[:, 0], pool[:, 1]


def build_case(batch: list[tuple[int, int]], pool_dtype: torch.dtype, seed: int = 0):
    """(q, k_cache, v_cache, meta) on CUDA: contexts in pages of one pool, random values; k_cache and v_cache are
    (POOL_LAYERS, blocks, PAGE, KV heads, HEAD_DIM) (attention_call attends over each layer). Pages are shuffled
    over the pool (POOL_GIB: a pool that large), or handed out in order (each sequence's pages adjacent, as a
    served pool's first-in-first-out free list mostly leaves a prompt's pages)."""
    from kernels.attention_metadata import AttentionMetadata

    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    pages = [-(-(c + n) // PAGE) for c, n in batch]
    itemsize = torch.empty((), dtype=pool_dtype).element_size()
    num_blocks = pool_num_blocks(sum(pages), POOL_LAYERS, POOL_GIB, itemsize)
    order = page_ids(sum(pages), num_blocks, PAGE_ORDER, gen)
    width = max(pages)
    tables = torch.zeros(len(batch), width, dtype=torch.int32, device=DEVICE)
    start = 0
    for i, count in enumerate(pages):
        tables[i, :count] = order[start:start + count].int()
        start += count
    k_cache, v_cache = layered_pool(num_blocks, POOL_LAYERS, pool_dtype, POOL_LAYOUT, DEVICE, gen)
    q_lens = [n for _, n in batch]
    contexts = [c + n for c, n in batch]
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    q = torch.randn(cu[-1], NUM_HEADS, HEAD_DIM, device=DEVICE, dtype=half_dtype(), generator=gen)
    meta = AttentionMetadata(
        slot_mapping=torch.full((cu[-1],), -1, dtype=torch.int64, device=DEVICE),
        block_tables=tables,
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=DEVICE),
        context_lens=torch.tensor(contexts, dtype=torch.int32, device=DEVICE),
        max_seqlen_q=max(q_lens), max_context_len=max(contexts), is_decode_only=all(n == 1 for n in q_lens),
        cu_seqlens_q_host=cu, context_lens_host=contexts,
    )
    if not meta.is_decode_only:  # as a served mixed step runs: from a CUDA graph, with a tile map
        from engine.executor.prefill_graphs import tile_map
        from kernels.triton_attention import prefill_tokens_per_tile

        # in the rows of the launches' device (sm_90's bf16 tiles have their own: _prefill_config)
        per_tile = prefill_tokens_per_tile(NUM_HEADS // NUM_KV_HEADS, HEAD_DIM, k_cache.element_size(), k_cache.device)
        tile_seq, tile_m = tile_map(q_lens, per_tile, -(-cu[-1] // per_tile) + len(batch))
        meta.tile_seq, meta.tile_m = torch.from_numpy(tile_seq).to(DEVICE), torch.from_numpy(tile_m).to(DEVICE)
        meta.tile_tokens = per_tile  # (the launch checks its tiles hold as many)
    return q, k_cache, v_cache, meta


def work(batch: list[tuple[int, int]], kv_itemsize: int) -> tuple[float, float]:
    """(dot flops, K/V bytes of the contexts) of one call."""
    pairs = sum(n * c + n * (n + 1) // 2 for c, n in batch)  # visible (query token, key) pairs
    flops = 4.0 * HEAD_DIM * NUM_HEADS * pairs
    kv_bytes = 2.0 * sum(c + n for c, n in batch) * NUM_KV_HEADS * HEAD_DIM * kv_itemsize
    return flops, kv_bytes


def time_us(fn, calls: int = 10, layers: int = 1) -> float:
    """Device microseconds of one fn() call (kernels/linear.py graph_time_ms: a CUDA graph of ``calls``
    calls, replayed 3 times after a warm-up replay), per layer where a call attends over ``layers`` layers
    (attention_call; one call a graph then: 32 layers of a long-context batch are tens of ms). On the CPU
    (--device cpu, a dry run under the interpreter): the wall-clock time of one call, which means nothing."""
    if DEVICE == "cpu":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6 / layers
    calls = calls if layers == 1 else 1
    return graph_time_ms(fn, repeat=calls) * 1000.0 / layers


def attention_call(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta, new_kv=None, attend=None):
    """A call of the batch's attention over each layer of the pool in turn (k_cache, v_cache: (layers, blocks,
    PAGE, KV heads, HEAD_DIM), build_case), as a served step walks its layers: each layer's K/V another part of
    the pool (with --layers 32 and a pool as large as the engine's, the GPU's address translation sees what a
    served decode step shows it). ``attend``: kernels/triton_attention.py paged_attention_triton (or a function
    of its signature: the tests' torch reference); returns the last layer's output."""
    if attend is None:
        from kernels.triton_attention import paged_attention_triton as attend
    extra = {} if new_kv is None else {"new_kv": new_kv}

    def call():
        out = None
        for layer in range(k_cache.shape[0]):
            out = attend(q, k_cache[layer], v_cache[layer], meta, HEAD_DIM**-0.5, **extra)
        return out

    return call


def rotary_append_inputs(q: torch.Tensor, meta) -> tuple:
    """new_kv for a decode-only case (the form a served decode step runs, kernels/rope_attention.py):
    unrotated k and v of each sequence's new token, its position, and Llama-3's cos/sin table; the
    token's slot in meta.slot_mapping becomes its real one (the kernel writes it there)."""
    from kernels.rotary import build_cos_sin_cache

    positions = (meta.context_lens - 1).long()
    pages = meta.block_tables.gather(1, (positions // PAGE).unsqueeze(1)).squeeze(1).long()
    meta.slot_mapping = pages * PAGE + positions % PAGE
    k = torch.randn(q.shape[0], NUM_KV_HEADS, HEAD_DIM, device=DEVICE, dtype=q.dtype)
    v = torch.randn_like(k)
    cos_sin = build_cos_sin_cache(meta.max_context_len + 1, HEAD_DIM, 500000.0, device=DEVICE)
    return k, v, positions, cos_sin


def case_batch(name: str) -> list[tuple[int, int]]:
    """CASES[name], or for a name "decode BxC" not in it, B decode rows over C tokens of context each, or for
    "chunk N over C" one prompt chunk of N new tokens ending at context C (C - N earlier keys)."""
    if name in CASES:
        return CASES[name]
    words = name.split()
    if len(words) == 4 and words[0] == "chunk" and words[2] == "over":
        new, context = int(words[1]), int(words[3])
        assert 1 < new <= context, f"{name!r}: a chunk of at least 2 tokens within its context"
        return [(context - new, new)]
    kind, shape = words
    count, context = (int(n) for n in shape.split("x"))
    assert kind == "decode", f"unknown case {name!r}: a CASES key or 'decode BxC'"
    return [(context - 1, 1)] * count


# --check: a case's output is compared with the torch reference where its scores are at most this many (the reference
# holds them in fp32: heads x new tokens x keys), else not checked ("-").
CHECK_MAX_SCORES = 1 << 27


def checked(q, k_cache, v_cache, meta, out, strict: bool = True) -> str:
    """The last layer's output of a case against kernels/attention.py paged_attention_ref: "ok" (within the kernel
    tests' tolerance for bf16 outputs), "FAIL (max err ...)", or "-" where the case is too large to check; not
    ``strict`` (a variant that changes the math, --variant_env): "err E/M", its largest error over the reference's
    largest value."""
    from kernels.attention import paged_attention_ref

    scores = sum((e - s) * c for _, s, e, c in meta.host_sequences()) * NUM_HEADS
    if scores > CHECK_MAX_SCORES:
        return "-"
    ref = paged_attention_ref(q, k_cache[-1], v_cache[-1], meta, HEAD_DIM**-0.5)
    err = (out.float() - ref.float()).abs().max().item()
    if not strict:
        return f"err {err:.2g}/{ref.float().abs().max().item():.2g}"
    return "ok" if err <= 2e-2 + 2e-2 * ref.float().abs().max().item() else f"FAIL (max err {err:.3g})"


def prefill_config_text(config: tuple | None) -> str:
    """A prefill config (BLOCK_M, BLOCK_N, warps, stages, ...) as BMxBNxWxS, or "-" where none launched."""
    return "-" if config is None else "x".join(str(v) for v in config[:4])


class launched_prefill_configs:
    """Context manager: appends to ``seen`` (launch's, config) for each config kernels.triton_attention._prefill_config
    (or what a sweep forced in its place) returns; launch's: the call passed a device (a prompt-chunk launch's, or a
    tile map's count on the same device, whose BLOCK_M is the same). launched_config() picks the launch's."""

    def __init__(self, seen: list):
        self.seen = seen

    def __enter__(self):
        from kernels import triton_attention

        self.chosen = chosen = triton_attention._prefill_config

        def recording(*args, **kwargs):
            config = chosen(*args, **kwargs)
            self.seen.append((len(args) > 3 or kwargs.get("device") is not None, config))
            return config

        triton_attention._prefill_config = recording

    def __exit__(self, *exc):
        from kernels import triton_attention

        triton_attention._prefill_config = self.chosen


def launched_config(seen: list) -> tuple | None:
    """The config of the last launch launched_prefill_configs saw: the last call that passed a device, else (kernels
    whose _prefill_config takes none) the last call; None where there was none."""
    for by_launch in (True, False):
        configs = [config for launch, config in seen if launch or not by_launch]
        if configs:
            return configs[-1]
    return None


def run_case(name: str, pool: str, tiling: str = "default", rotary_append: bool = False, check: bool = False,
             strict: bool = True) -> dict:
    """One timed case; "config": the prompt-chunk tiling (BMxBNxWxS) its launches took, "-" for decode-only cases;
    with ``check``, "check": checked()'s verdict."""
    batch = case_batch(name)
    pool_dtype = torch.float8_e4m3fn if pool == "fp8" else half_dtype()
    seen = []
    with launched_prefill_configs(seen):
        q, k_cache, v_cache, meta = build_case(batch, pool_dtype)
        new_kv = rotary_append_inputs(q, meta) if rotary_append and meta.is_decode_only else None
        if new_kv is not None:
            tiling += " +rotary append"
        call = attention_call(q, k_cache, v_cache, meta, new_kv)
        us = time_us(call, layers=k_cache.shape[0])
        verdict = checked(q, k_cache, v_cache, meta, call(), strict) if check and new_kv is None else None
    flops, kv_bytes = work(batch, k_cache.element_size())
    del q, k_cache, v_cache, meta
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    row = {"case": name, "pool": pool, "tiling": tiling, "us": round(us, 1),
           "tflops": round(flops / us / 1e6, 1), "kv_tb_s": round(kv_bytes / us / 1e6, 2),
           "config": prefill_config_text(launched_config(seen) if any(n > 1 for _, n in batch) else None)}
    if verdict is not None:
        row["check"] = verdict
    return row


def sdpa_anchor(name: str) -> list[dict]:
    """torch's own attention at a prompt-chunk case's shape, as this GPU's in-process anchor: bf16 q, k, v
    contiguous (1, NUM_HEADS, len, HEAD_DIM) (K/V expanded to every query head; no pool, no pages), causal aligned
    at the chunk's end. "sdpa flash lower-right": F.scaled_dot_product_attention with torch.nn.attention.bias
    causal_lower_right under the flash backend alone (FlashAttention-2's kernel; it refuses rather than falls
    back). "sdpa cudnn (causal + prefix)": the cuDNN backend's is_causal over the chunk's own keys plus a full
    (unmasked) call over the earlier keys, the two times summed (the same pairs; no merge of the two). Rows as
    run_case's, pool "bf16 dense"; a backend that fails gives a row with its error instead of a time."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    batch = case_batch(name)
    assert len(batch) == 1 and batch[0][1] > 1, f"{name!r}: the anchor takes one prompt chunk"
    prefix, new = batch[0]
    keys = prefix + new
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    q = torch.randn(1, NUM_HEADS, new, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(1, NUM_HEADS, keys, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    v = torch.randn_like(k)
    k_own, v_own = k[:, :, prefix:].contiguous(), v[:, :, prefix:].contiguous()
    k_old, v_old = k[:, :, :prefix].contiguous(), v[:, :, :prefix].contiguous()
    flops, _ = work(batch, 2)
    mask = causal_lower_right(new, keys)

    def flash():
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def cudnn_causal():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q, k_own, v_own, is_causal=True)

    def cudnn_prefix():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q, k_old, v_old)

    rows = []
    for label, parts in (("sdpa flash lower-right", [flash]),
                         ("sdpa cudnn (causal + prefix)", [cudnn_causal] + ([cudnn_prefix] if prefix else []))):
        row = {"case": name, "pool": "bf16 dense", "tiling": label, "config": "-"}
        try:
            us = sum(time_us(part) for part in parts)
            row.update(us=round(us, 1), tflops=round(flops / us / 1e6, 1), kv_tb_s=0.0)
        except Exception as exc:  # a backend this torch / GPU lacks: say so, keep the other rows
            row.update(us=float("nan"), tflops=float("nan"), kv_tb_s=0.0,
                       error=error_text(exc))
        rows.append(row)
    del q, k, v, k_own, v_own, k_old, v_old
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return rows


def error_text(exc: Exception) -> str:
    """A failed row's "error": the exception's type and the first line of its message (at most 160 characters)."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"


def sweep_prefill(pool: str, cases: list[str], entries: str, check: bool, suffix: str = "") -> list[dict]:
    """The prompt-chunk cases with the prompt tiling forced to each BM:BN:WARPS:STAGES of ``entries`` (comma list),
    labelled "prefill BM:BN:WARPS:STAGES" + suffix; a tiling that fails (shared memory, registers) is one error row."""
    rows = []
    for entry in filter(None, entries.split(",")):
        bm, bn, warps, stages = map(int, entry.split(":"))
        label = f"prefill {entry}{suffix}"
        with forced("_prefill_config", lambda default: (bm, bn, warps, stages, 1)):
            for name in cases:
                if any(n > 1 for _, n in case_batch(name)):
                    try:
                        rows.append(run_case(name, pool, label, check=check, strict=not suffix))
                    except Exception as exc:  # a tiling this GPU cannot run (shared memory, registers)
                        rows.append({"case": name, "pool": pool, "tiling": label, "us": float("nan"),
                                     "tflops": float("nan"), "kv_tb_s": 0.0, "config": entry.replace(":", "x"),
                                     "error": error_text(exc)})
                        print(rows[-1], flush=True)
                        break  # its other cases would fail alike
                    print(rows[-1], flush=True)
    return rows


def pivot_table(rows: list[dict]) -> list[str]:
    """Markdown: one line per (pool, tiling), one column per case: us / TFLOPS and, for a swept tiling, its
    speed-up over the same pool's default row at that case (default us / its us; > 1 is faster). The default
    rows name the tiling they took (BMxBNxWxS)."""
    cases = list(dict.fromkeys(r["case"] for r in rows))
    keys = list(dict.fromkeys((r["pool"], r["tiling"]) for r in rows))
    cell = {(r["pool"], r["tiling"], r["case"]): r for r in rows}
    lines = ["| pool | tiling | " + " | ".join(cases) + " |", "|---|---|" + "---:|" * len(cases)]
    for pool, tiling in keys:
        label = tiling
        cells = []
        for case in cases:
            r = cell.get((pool, tiling, case))
            if r is None:
                cells.append("")
                continue
            if tiling == "default" and r.get("config", "-") != "-":
                label = f"default {r['config']}"
            if r.get("error"):
                cells.append("error")
                continue
            text = f"{r['us']:,.0f} us {r['tflops']:.0f} TF"
            base = cell.get((pool, "default", case))
            if tiling != "default" and base is not None and not base.get("error") and r["us"] > 0:
                text += f" ({base['us'] / r['us']:.2f}x)"
            if r.get("check", "ok") not in ("ok", "-"):
                text += " " + r["check"]
            cells.append(text)
        lines.append(f"| {pool} | {label} | " + " | ".join(cells) + " |")
    return lines


GRID_CONTEXTS = (20480, 8192, 2048)  # longest first: a run cut by its time limit keeps the cases that matter most
GRID_BATCHES = (8, 64, 256)
GRID_EXTRA = ("decode 48x21000", "decode 1024x2048")  # 20000/2000's plateau; the largest batch
GRID_SPLITS = (1, 2, 4, 8)  # forced from GRID_SPLIT_CONTEXT keys on, up to GRID_SPLIT_BATCH sequences (the default
GRID_SPLIT_CONTEXT, GRID_SPLIT_BATCH = 16384, 64  # widening): few programs a wave, where the split count matters


def grid_cases() -> list[str]:
    return [f"decode {b}x{c}" for c in GRID_CONTEXTS for b in GRID_BATCHES] + list(GRID_EXTRA)


def copy_tb_s() -> float:
    """TB/s of benchmarks/common.py copy_bandwidth (an eager 2 GiB device-to-device copy, read + written bytes):
    every bench's "% of copy" denominator. (The same copy timed inside a CUDA graph, a memcpy node, read 2.78 TB/s
    on an H200 where the eager one read 4.22.)"""
    from benchmarks.common import copy_bandwidth

    return copy_bandwidth(DEVICE) / 1e12  # 0.0 on the CPU


def grid_variants(pool: str, name: str,
                  widenings: list[str]) -> list[tuple[str, dict, int | None, bool, tuple | None, bool]]:
    """(label, environment, forced splits, rotary_append, forced decode tiling, graph replay) of one grid case: an FP8
    pool in each of ``widenings`` (FP8_WIDENINGS' keys), the served form with Triton's widening, the default one and
    "v" where among ``widenings``, and at long contexts and few sequences forced key splits."""
    if pool != "fp8":
        return [("default", {}, None, False, None, False)]
    from kernels import triton_attention

    env = triton_attention.FP8_WIDEN_ENV
    default = triton_attention.FP8_WIDEN_DEFAULT
    variants = [(f"widen {w}", {env: w}, None, False, None, False) for w in widenings]
    variants += [(f"widen {w} +rotary append", {env: w}, None, True, None, False)
                 for w in dict.fromkeys(("0", default, *(w for w in widenings if w == "v")))]
    batch = case_batch(name)
    if batch[0][0] + 1 >= GRID_SPLIT_CONTEXT and len(batch) <= GRID_SPLIT_BATCH:
        variants += [(f"widen {default}, {n} splits", {env: default}, n, False, None, False) for n in GRID_SPLITS]
    return variants


def parsed_variant(spec: str) -> tuple[str, dict, int | None, bool, tuple | None, bool]:
    """A --grid_more variant: space-separated words, ``bits=W`` ($TRITONLLM_ATTN_FP8_BITS), ``tma=all|0``
    ($TRITONLLM_DECODE_TMA), ``tile=BN:WARPS:STAGES[:tma]`` (the decode tiling forced), ``splits=N`` (forced, any
    count >= 1), ``policy=h200|h100|h200-any`` ($TRITONLLM_DECODE_SPLIT_POLICY: a key of SPLIT_POLICIES), ``replay``
    (as a decode graph's replay: run_grid), ``rotary`` (the served form), ``km`` or ``km=1`` (decode
    by the keys-major kernel, kernels/keys_major_decode.py, wherever it runs: $TRITONLLM_DECODE_KEYS_MAJOR=1, with
    the same config and splits), ``km=0`` (the default kernel always), ``km=auto``, ``default`` (nothing forced).
    A variant without a km word takes the served choice ("auto": keys-major on FP8 pools in the 64-key 2-warp
    tiling and for 16-bit pools' split launches) whatever the environment says."""
    from kernels import keys_major_decode, triton_attention

    env, splits, rotary, tiling, replay = {keys_major_decode.DECODE_KEYS_MAJOR_ENV: "auto"}, None, False, None, False
    for word in spec.split():
        key, _, value = word.partition("=")
        if key == "bits":
            env[triton_attention.FP8_WIDEN_ENV] = value
        elif key == "tma":
            env[triton_attention.DECODE_TMA_ENV] = value
        elif key == "tile":
            bn, warps, stages, *tma = value.split(":")
            tiling = (int(bn), int(warps), int(stages), tma == ["tma"])
        elif key == "splits":
            splits = int(value)
            if splits < 1:
                raise ValueError(f"--grid_more word {word!r}: a split count >= 1")
        elif key == "rotary":
            rotary = True
        elif key == "replay":
            replay = True
        elif key == "policy":
            if value not in triton_attention.SPLIT_POLICIES:
                raise ValueError(f"--grid_more word {word!r}: one of {', '.join(triton_attention.SPLIT_POLICIES)}")
            env[triton_attention.DECODE_SPLIT_POLICY_ENV] = value
        elif key == "km" and value in ("", *keys_major_decode.DECODE_KEYS_MAJOR_MODES):
            env[keys_major_decode.DECODE_KEYS_MAJOR_ENV] = value or "1"
        elif word != "default":
            raise ValueError(f"--grid_more word {word!r}: bits=, tma=, tile=, splits=, policy=, replay, rotary, "
                             f"km[=0|1|auto] or default")
    return spec, env, splits, rotary, tiling, replay


def run_grid(pools: list[str], copy: float, widenings: list[str], cases: list[str], more: list[str],
             standard: bool = True) -> list[dict]:
    """One row per (case, pool, variant) of --grid (``standard``: grid_variants'; then ``more``'s); each case's pool
    built once for its variants. The config column ends in "km" where the keys-major kernel ran; a replay's names
    the grid's splits and the replay's ("8 splits, replay 5"). Each row also holds the launched tiling's programs an
    SM (``resident``), the programs with work and their waves (wave_columns)."""
    from benchmarks.common import environment_set
    from kernels.keys_major_decode import keys_major_decode_chosen

    rows = []
    for pool in pools:
        pool_dtype = torch.float8_e4m3fn if pool == "fp8" else torch.bfloat16
        for name in cases:
            batch = case_batch(name)
            variants = grid_variants(pool, name, widenings) if standard else []
            variants += [parsed_variant(spec) for spec in more]
            if not variants:
                continue
            q, k_cache, v_cache, meta = build_case(batch, pool_dtype)
            _, kv_bytes = work(batch, k_cache.element_size())
            for label, env, splits, rotary, tiling, replay in variants:
                new_kv = rotary_append_inputs(q, meta) if rotary else None
                call = attention_call(q, k_cache, v_cache, meta, new_kv)
                chosen = []  # the decode config each launch took (the last: the timed graph's)

                def config_of(default, splits=splits, tiling=tiling):
                    config = default if tiling is None else (default[0], *tiling[:3], default[4], tiling[3])
                    chosen.append(config if splits is None else config[:4] + (splits,) + config[5:])
                    return chosen[-1]

                try:
                    with environment_set(env), forced("_decode_config", config_of):
                        active = graph_replay_splits(call, meta, len(batch)) if replay else None
                        us = time_us(call, layers=k_cache.shape[0])
                        tiling_run = (*chosen[-1][1:4], chosen[-1][5:6] == (True,))
                        ran_km = meta.is_decode_only and keys_major_decode_chosen(
                            NUM_HEADS // NUM_KV_HEADS, plain_layer=True, kv_itemsize=k_cache.element_size(),
                            fp32_queries=q.dtype == torch.float32, tiling=tiling_run, splits=chosen[-1][4])
                        resident = launched_residency(chosen[-1], q, k_cache.element_size(), ran_km)
                finally:  # the next variant's calls are eager ones again
                    meta.decode_splits = meta.decode_split_plan = None
                tb_s = kv_bytes / us / 1e6
                rows.append({"case": name, "pool": pool, "tiling": label, "us": round(us, 1),
                             "kv_tb_s": round(tb_s, 2), "pct_copy": round(100 * tb_s / copy, 1) if copy else 0.0})
                block_m, block_n, warps, stages, used_splits = chosen[-1][:5]
                working = used_splits if active is None else min(active, used_splits)
                replayed = "" if active is None else f", replay {active}"
                rows[-1]["config"] = f"{block_n}x{warps}x{stages}{' tma' if chosen[-1][5:6] == (True,) else ''} " \
                                     f"{used_splits} splits{replayed}{' km' if ran_km else ''}"
                rows[-1].update(splits=working, **wave_columns(len(batch), working, resident, q.device))
                waves = "?" if resident is None else f"{rows[-1]['waves']} waves, {percent(rows[-1]['slot_use'])} " \
                                                     "of their slots"
                print(f"{name} | {pool} | {label} | {us:.1f} us | {tb_s:.2f} TB/s | {rows[-1]['pct_copy']}% | "
                      f"{rows[-1]['config']} | {resident or '?'}/SM, {rows[-1]['programs']} programs, {waves}",
                      flush=True)
            del q, k_cache, v_cache, meta
            torch.cuda.empty_cache()
    return rows


def graph_replay_splits(call, meta, num_seqs: int) -> int | None:
    """Sets the case up as a decode graph's replay runs it (engine/executor/cuda_graphs.py): meta.decode_splits holds
    MAX_DECODE_SPLITS (what the warm-ups and the capture see), two eager calls record the tiling's residency and then,
    for a mid-size batch, the capture's split plan and grid (kernels/triton_attention.py _decode_config:
    captured_splits() splits), and the replay's count (decode_active_splits for this batch and its longest context)
    is written over it. Returns that count, or None where no plan was recorded (a batch outside the mid-size buckets,
    or no residency: Triton's interpreter), whose graph holds one count: then the launch is the eager one's."""
    from kernels.triton_attention import MAX_DECODE_SPLITS, decode_active_splits

    meta.decode_splits = torch.full((1,), MAX_DECODE_SPLITS, dtype=torch.int32, device=meta.context_lens.device)
    meta.decode_split_plan = None
    call()
    call()
    if meta.decode_split_plan is None:
        meta.decode_splits = None
        return None
    active = decode_active_splits(meta.decode_split_plan, num_seqs, meta.max_context_len)
    meta.decode_splits.fill_(active)
    return active


def launched_residency(config: tuple, q: torch.Tensor, kv_itemsize: int, keys_major: bool) -> int | None:
    """Programs an SM of the decode tiling ``config`` launched (kernels/triton_attention.py _DECODE_RESIDENT, recorded
    by its first launch under the key the kernel that ran it uses); None where not recorded (the interpreter)."""
    from kernels import triton_attention as ta

    block_m, block_n, warps, stages = config[:4]
    tiling = (block_n, warps, stages, len(config) > 5 and bool(config[5]))
    fp16_math = kv_itemsize == 1 and q.dtype != torch.float32
    widening = ta.fp8_widening(block_n) if fp16_math else (False, ta.V_BY_TRITON)
    key = ta._decode_tiling_key(q.device, block_m, tiling, ta.attention_dim_pad(HEAD_DIM), kv_itemsize, widening,
                                keys_major)
    return ta._DECODE_RESIDENT.get(key)


def wave_columns(num_seqs: int, splits: int, resident: int | None, device) -> dict:
    """``programs`` with work (sequences x KV heads x splits); with ``resident`` programs an SM (None: unknown) on the
    device's SMs: ``waves`` (programs / the programs the GPU holds at once) and ``slot_use`` (programs / the slots of
    the whole waves they take: the share of the GPU's time a program holds each slot, if all run equally long)."""
    from kernels._triton import num_sms

    programs = num_seqs * NUM_KV_HEADS * splits
    if not resident:
        return {"programs": programs, "resident": None, "waves": None, "slot_use": None}
    capacity = resident * num_sms(device)
    waves = programs / capacity
    return {"programs": programs, "resident": resident, "waves": round(waves, 2),
            "slot_use": round(programs / (-(-programs // capacity) * capacity), 3)}


def percent(share: float | None) -> str:
    """A share as "98.5%", or "?" where unknown."""
    return "?" if share is None else f"{100 * share:.1f}%"


def forced(attr: str, config_of):
    """Context manager: kernels.triton_attention.<attr> returns config_of(default config) for the run."""
    from kernels import triton_attention

    class _Forced:
        def __enter__(self):
            self.chosen = getattr(triton_attention, attr)
            setattr(triton_attention, attr, lambda *a, **k: config_of(self.chosen(*a, **k)))

        def __exit__(self, *exc):
            setattr(triton_attention, attr, self.chosen)

    return _Forced()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pool", default="fp8,bf16")
    parser.add_argument("--cases", default=",".join(c for c in CASES if c not in PROMPT_CHUNKS_20K),
                        help="comma list of case names (see CASES; 'decode BxC' for any other decode batch, 'chunk N "
                             "over C' for any one prompt chunk; 'prompt20k': PROMPT_CHUNKS_20K)")
    parser.add_argument("--sweep_prefill", default="", help="BM:BN:WARPS:STAGES,... for prompt chunks")
    parser.add_argument("--sweep_decode", default="",
                        help="BN:WARPS:STAGES[:tma],... for decode rows (:tma: whole tiles through TMA where they fit a page)")
    parser.add_argument("--splits", default="",
                        help="N,...: decode cases again with the key splits forced to each count (the tiling kept)")
    parser.add_argument("--rotary_append", action="store_true",
                        help="decode cases also in the served form: q and k rotated and the new K/V written in-kernel")
    parser.add_argument("--pool_layout", choices=["token_major", "head_major"], default="token_major",
                        help="head_major: each KV head's page contiguous (the kernels read it through strides)")
    parser.add_argument("--page_order", choices=["shuffled", "in_order"], default="shuffled",
                        help="pages of the contexts: shuffled over the pool, or each sequence's adjacent")
    parser.add_argument("--layers", type=int, default=1,
                        help="the pool holds this many layers (the engine's memory order) and each timed call attends "
                             "over every one in turn; figures per layer")
    parser.add_argument("--pool_gib", type=float, default=0.0,
                        help="the pool (all layers, K and V) at least this many GiB, the batch's pages spread over it "
                             "(shuffled; default: just the batch's pages)")
    parser.add_argument("--grid", action="store_true",
                        help="issue 51's decode table instead of --cases: 2k/8k/20k x 8/64/256 and 1024 x 2k, each FP8 "
                             "widening, the served form, forced splits at 20k; with the K/V rate's share of a copy")
    parser.add_argument("--grid_widenings", default="",
                        help="comma list of FP8 widenings for --grid (kernels/triton_attention.py FP8_WIDENINGS; all)")
    parser.add_argument("--grid_cases", default="", help="comma list of 'decode BxC' cases for --grid (its own: all)")
    parser.add_argument("--grid_more", default="",
                        help="';'-separated extra --grid variants, each words of bits=W tma=all|0 "
                             "tile=BN:WARPS:STAGES[:tma] splits=N policy=h200|h100|h200-any replay rotary "
                             "km[=0|1|auto] default (parsed_variant)")
    parser.add_argument("--grid_no_standard", action="store_true", help="--grid: only the --grid_more variants")
    parser.add_argument("--sdpa_anchor", action="store_true",
                        help="also time torch's SDPA (flash lower-right causal; cuDNN causal + prefix) at each "
                             "one-chunk case, bf16 dense K/V: what this GPU reaches (sdpa_anchor)")
    parser.add_argument("--check", action="store_true",
                        help="compare each case's output with the torch reference where it is small enough "
                             "(CHECK_MAX_SCORES): every swept tiling computes the right thing")
    parser.add_argument("--pivot", action="store_true",
                        help="print the table as one line per (pool, tiling) and one column per case, with each swept "
                             "tiling's speed-up over the default")
    parser.add_argument("--json", default=None, help="write the rows to this file (--grid: with the copy bandwidth)")
    parser.add_argument("--variant_env", default="",
                        help="';'-separated NAME=VALUE[,NAME=VALUE] environments: the prompt-chunk cases again under "
                             "each (default tiling and --sweep_prefill), labelled [NAME=VALUE], e.g. "
                             "TRITONLLM_PREFILL_FP8_QK=1; --check reports their error instead of a verdict")
    parser.add_argument("--variant_sweep", default="",
                        help="BM:BN:WARPS:STAGES,... swept under each --variant_env (default: --sweep_prefill's)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: a dry run under TRITON_INTERPRET=1 (tiny cases: 'chunk N over C'; times mean nothing)")
    parser.add_argument("--markdown", default=None, help="append the table to this file")
    parser.add_argument("--dry_run_cpu", action="store_true", help="--device cpu's other name (the split51 lane's)")
    args = parser.parse_args()
    global PAGE_ORDER, POOL_LAYOUT, POOL_LAYERS, POOL_GIB, DEVICE
    PAGE_ORDER, POOL_LAYOUT, POOL_LAYERS, POOL_GIB = args.page_order, args.pool_layout, args.layers, args.pool_gib
    if args.dry_run_cpu:
        args.device = "cpu"
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("--device cpu (--dry_run_cpu) runs the kernels under Triton's interpreter: set TRITON_INTERPRET=1")
    DEVICE = args.device
    print(f"pool: {POOL_LAYOUT}, {POOL_LAYERS} layer(s), at least {POOL_GIB:g} GiB, pages {PAGE_ORDER}", flush=True)
    if args.grid:
        copy = copy_tb_s()
        device_name = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (dry run)"
        print(f"{device_name}: device-to-device copy of 2 GiB {copy:.2f} TB/s (read + written, "
              "benchmarks/common.py copy_bandwidth)", flush=True)
        from kernels import triton_attention

        widenings = args.grid_widenings.split(",") if args.grid_widenings else list(triton_attention.FP8_WIDENINGS)
        cases = args.grid_cases.split(",") if args.grid_cases else grid_cases()
        more = [spec for spec in args.grid_more.split(";") if spec.strip()]
        rows = run_grid(args.pool.split(","), copy, widenings, cases, more, standard=not args.grid_no_standard)
        table = [f"| case | pool | variant | us / layer | K/V TB/s | % of copy ({copy:.2f} TB/s) | keys x warps x "
                 "stages, splits | programs an SM | programs | waves | slot use |",
                 "|---|---|---|---:|---:|---:|---|---:|---:|---:|---:|"]
        table += [f"| {r['case']} | {r['pool']} | {r['tiling']} | {r['us']:,} | {r['kv_tb_s']} | {r['pct_copy']} | "
                  f"{r['config']} | {r['resident'] or '?'} | {r['programs']:,} | {r['waves'] or '?'} | "
                  f"{percent(r['slot_use'])} |" for r in rows]
        print("decode programs an SM holds, by tiling:", getattr(triton_attention, "_DECODE_RESIDENT", "?"))
        if args.markdown:
            with open(args.markdown, "a") as f:
                f.write("\n".join(table) + "\n")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"copy_tb_s": copy, "rows": rows}, f, indent=1)
        return
    cases = [c for c in args.cases.split(",") if c]
    cases = [name for c in cases for name in (PROMPT_CHUNKS_20K if c == "prompt20k" else (c,))]
    rows = []
    if args.sdpa_anchor:
        for name in cases:
            batch = case_batch(name)
            if len(batch) == 1 and batch[0][1] > 1:
                for row in sdpa_anchor(name):
                    rows.append(row)
                    print(row, flush=True)
    for pool in args.pool.split(","):
        for name in cases:
            rows.append(run_case(name, pool, check=args.check))
            print(rows[-1], flush=True)
            if args.rotary_append and all(n == 1 for _, n in case_batch(name)):
                rows.append(run_case(name, pool, rotary_append=True))
                print(rows[-1], flush=True)
        rows += sweep_prefill(pool, cases, args.sweep_prefill, args.check)
        for spec in filter(None, args.variant_env.split(";")):
            # the prompt-chunk cases again under the variant's environment: the default tiling, then the sweep's
            from benchmarks.common import environment_set

            env = dict(word.split("=", 1) for word in spec.split(","))
            with environment_set(env):
                for name in cases:
                    if any(n > 1 for _, n in case_batch(name)):
                        rows.append(run_case(name, pool, f"default [{spec}]", check=args.check, strict=False))
                        print(rows[-1], flush=True)
                rows += sweep_prefill(pool, cases, args.variant_sweep or args.sweep_prefill, args.check, f" [{spec}]")
        for entry in filter(None, args.sweep_decode.split(",")):
            bn, warps, stages, *tma = entry.split(":")
            bn, warps, stages, tma = int(bn), int(warps), int(stages), tma == ["tma"]
            with forced("_decode_config", lambda default: (default[0], bn, warps, stages, default[4], tma)):
                for name in cases:
                    if any(n == 1 for _, n in case_batch(name)):
                        rows.append(run_case(name, pool, f"decode {entry}"))
                        print(rows[-1], flush=True)
        for count in filter(None, args.splits.split(",")):
            count = int(count)
            with forced("_decode_config", lambda default: default[:4] + (count,) + default[5:]):
                for name in cases:
                    if any(n == 1 for _, n in case_batch(name)):
                        rows.append(run_case(name, pool, f"{count} splits"))
                        print(rows[-1], flush=True)
    table = ["| case | pool | tiling | BMxBNxWxS | us / layer | TFLOPS | K/V TB/s | check |",
             "|---|---|---|---|---:|---:|---:|---|"]
    table += [f"| {r['case']} | {r['pool']} | {r['tiling']} | {r.get('config', '-')} | {r['us']:,} | {r['tflops']} | "
              f"{r['kv_tb_s']} | {r.get('error') or r.get('check', '')} |" for r in rows]
    if args.pivot:
        table = pivot_table(rows)
    print("\n".join(table))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    from kernels import triton_attention

    print("decode programs an SM holds, by tiling:", getattr(triton_attention, "_DECODE_RESIDENT", "?"))
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write("\n".join(table) + "\n")


if __name__ == "__main__":
    main()
