"""The pure parts of issue 51's FlashInfer anchor (benchmarks/kernels/decode_attention_anchor_bench.py and
flashinfer_anchor_trim.py): both sides' page tables of one batch, the pool both read without a copy, the K/V
bytes and L2-safe copy count, and which of the wheel's files the trimmed tarball keeps. No FlashInfer, no GPU."""
from __future__ import annotations

import torch

from benchmarks.kernels import decode_attention_anchor_bench as bench
from benchmarks.kernels.flashinfer_anchor_trim import is_kept, missing_includes


def test_page_tables_csr_and_padded_table_hold_the_same_pages():
    contexts = [1, 32, 33, 70]  # a partial page, one full page, a page and a token, three pages
    block_ids = torch.tensor([9, 4, 7, 2, 8, 5, 3, 6, 1])
    tables = bench.page_tables(contexts, block_ids, page=32)
    assert tables.indptr.tolist() == [0, 1, 2, 4, 7]
    assert tables.indices.tolist() == [9, 4, 7, 2, 8, 5, 3]  # the first 7 ids, in order
    assert tables.last_page_len.tolist() == [1, 32, 1, 6]
    assert tables.block_tables.tolist() == [[9, 0, 0], [4, 0, 0], [7, 2, 0], [8, 5, 3]]
    for i in range(len(contexts)):  # CSR row i == padded row i's first pages
        start, end = tables.indptr[i], tables.indptr[i + 1]
        assert tables.indices[start:end].tolist() == tables.block_tables[i, :end - start].tolist()


def test_page_tables_refuse_too_few_blocks():
    try:
        bench.page_tables([100], torch.arange(3), page=32)
    except AssertionError as error:
        assert "3 blocks for 4 pages" in str(error)
    else:
        raise AssertionError("4 pages from 3 blocks accepted")


def test_engine_pool_is_head_major_memory_read_through_views():
    k, v, k_anchor, v_anchor, layout = bench.make_pool(3, torch.bfloat16, "engine", "cpu")
    assert layout == "HND" and k_anchor.is_contiguous() and not k.is_contiguous()
    assert k.shape == (3, bench.PAGE, bench.NUM_KV_HEADS, bench.HEAD_DIM)
    assert k_anchor.shape == (3, bench.NUM_KV_HEADS, bench.PAGE, bench.HEAD_DIM)
    assert k.data_ptr() == k_anchor.data_ptr() and v.data_ptr() == v_anchor.data_ptr()
    assert torch.equal(k[2, 5, 3], k_anchor[2, 3, 5]) and torch.equal(v[1, 31, 7], v_anchor[1, 7, 31])
    assert not torch.equal(k, v)
    # runner.allocate_kv_cache's order: a block holds its heads one after another, a head's page one run
    assert k.stride() == (bench.NUM_KV_HEADS * bench.PAGE * bench.HEAD_DIM, bench.HEAD_DIM,
                          bench.PAGE * bench.HEAD_DIM, 1)


def test_token_major_pool_is_one_tensor_for_both():
    k, v, k_anchor, v_anchor, layout = bench.make_pool(2, torch.float8_e4m3fn, "token_major", "cpu")
    assert layout == "NHD" and k.is_contiguous() and k.shape == k_anchor.shape and k.stride() == k_anchor.stride()
    assert k.data_ptr() == k_anchor.data_ptr() and v.data_ptr() == v_anchor.data_ptr() != k.data_ptr()
    assert k.dtype == torch.float8_e4m3fn and k.float().abs().max() > 0
    try:
        bench.make_pool(2, torch.bfloat16, "head_major", "cpu")
    except ValueError as error:
        assert "engine or token_major" in str(error)
    else:
        raise AssertionError("an unknown layout accepted")


def test_kv_bytes_and_copies_keep_a_graph_out_of_l2():
    # 8 sequences of 2,000 tokens, 8 KV heads of 128, FP8: 2 (K, V) x 16,000 x 1,024 bytes
    assert bench.kv_bytes_read([2000] * 8, 1) == 2 * 16000 * 1024
    assert bench.copies_for_l2(32_768_000) == 9  # 9 copies: over 256 MiB in all
    assert bench.copies_for_l2(1000) == bench.CALLS  # never more copies than calls
    assert bench.copies_for_l2(21 << 30) == 1


def test_decode_metadata_is_one_token_a_sequence():
    tables = bench.page_tables([40, 3], torch.tensor([5, 6, 7]), page=32)
    meta = bench.decode_metadata([40, 3], tables)
    assert meta.is_decode_only and meta.max_seqlen_q == 1 and meta.max_context_len == 40
    assert meta.cu_seqlens_q.tolist() == [0, 1, 2] and meta.context_lens.tolist() == [40, 3]


def test_trim_keeps_decode_sources_and_drops_other_kernels():
    loaded = {"flashinfer/cake_gdp_backend/__init__.py", "flashinfer/experimental/__init__.py"}
    kept = ["flashinfer/decode.py", "flashinfer/jit/core.py", "flashinfer/data/include/flashinfer/page.cuh",
            "flashinfer/data/cccl/cub/cub/cub.cuh", "flashinfer/data/csrc/batch_decode.cu",
            "flashinfer/data/csrc/batch_prefill_paged_kernel_inst.jinja", "flashinfer/data/csrc/tvm_ffi_utils.h",
            "flashinfer/cake_gdp_backend/cake_jit.py",  # a backend package `import flashinfer` loads: all its .py
            "flashinfer/experimental/__init__.py", "flashinfer_python-0.7.4.dist-info/METADATA"]
    dropped = ["flashinfer/data/cutlass/include/cutlass/cutlass.h", "flashinfer/data/csrc/fused_moe/x.cu",
               "flashinfer/data/csrc/gemm_groupwise_sm90.cu", "flashinfer/experimental/b12x/moe.py",
               "flashinfer/cake_vsa_sm90_backend/cake_jit.py", "flashinfer/cake_gdp_backend/kernel.cu",
               "flashinfer_python-0.7.4.dist-info/RECORD", "b12x/__init__.py"]
    assert [p for p in kept if not is_kept(p, loaded)] == []
    assert [p for p in dropped if is_kept(p, loaded)] == []


def test_missing_includes_follows_the_build_files_search_order(tmp_path):
    package = tmp_path / "flashinfer"
    (package / "data/include/flashinfer").mkdir(parents=True)
    (package / "data/cccl/libcudacxx/include/cuda").mkdir(parents=True)
    (package / "data/include/flashinfer/page.cuh").write_text('#include <cuda/std/cstdint>\n#include "vec.cuh"\n')
    (package / "data/include/flashinfer/vec.cuh").write_text("#include <cuda_fp8.h>\n")
    (package / "data/cccl/libcudacxx/include/cuda/std").mkdir()
    (package / "data/cccl/libcudacxx/include/cuda/std/cstdint").write_text("")
    generated = tmp_path / "gen"
    generated.mkdir()
    (generated / "batch_decode.cu").write_text('#include <flashinfer/page.cuh>\n#include "batch_decode_config.inc"\n')
    (generated / "batch_decode_config.inc").write_text("#include <tvm/ffi/function.h>\n")
    inside, unresolved = missing_includes(package, generated)
    assert inside == ["data/cccl/libcudacxx/include/cuda/std/cstdint", "data/include/flashinfer/page.cuh",
                      "data/include/flashinfer/vec.cuh"]
    assert unresolved == ["cuda_fp8.h", "tvm/ffi/function.h"]  # the toolkit's and tvm_ffi's


def test_summary_puts_each_kernel_of_a_case_on_one_line():
    def row(kernel, us, tb_s):
        return {"pool": "bf16", "batch": 8, "context": 20000, "kernel": kernel, "us": us, "kv_tb_s": tb_s,
                "pct_copy": 100 * tb_s / 4.25}

    rows = [row("ours", 225.2, 2.911), row("fi", 232.8, 2.817), row("fi tc", 155.5, 4.216)]
    lines = bench.summary_table(rows).splitlines()
    assert lines[0] == ("| pool | batch x context | ours TB/s (% copy) | fi TB/s (% copy) | fi tc TB/s (% copy) "
                        "| best FlashInfer / ours |")
    assert lines[2] == "| bf16 | 8x20000 | 2.91 (68%) | 2.82 (66%) | 4.22 (99%) | 1.45 |"  # 225.2 / 155.5
    assert bench.summary_table(rows[:1]).splitlines()[2].endswith("| 2.91 (68%) | - |")  # no FlashInfer: no ratio
    # a variant of ours (--ours_fp8_widenings) gets its column after ours; the ratio stays ours-as-default's
    lines = bench.summary_table(rows[:1] + [row("ours v", 150.0, 4.37)] + rows[1:]).splitlines()
    assert lines[0].startswith("| pool | batch x context | ours TB/s (% copy) | ours v TB/s (% copy) | fi TB/s")
    assert lines[2] == "| bf16 | 8x20000 | 2.91 (68%) | 4.37 (103%) | 2.82 (66%) | 4.22 (99%) | 1.45 |"


def test_forced_decode_replaces_the_tile_or_the_splits_for_its_block(monkeypatch):
    from kernels import triton_attention

    chosen = (16, 64, 4, 3, 8, False)  # (BLOCK_M, BLOCK_N, warps, stages, splits, TMA)
    monkeypatch.setattr(triton_attention, "_decode_config", lambda *a, **k: chosen)
    with bench.forced_decode("128:8:2"):
        assert triton_attention._decode_config() == (16, 128, 8, 2, 8, False)
    with bench.forced_decode("32splits"):
        assert triton_attention._decode_config() == (16, 64, 4, 3, 32, False)
    assert triton_attention._decode_config() == chosen
    for bad in ("1x", "64:4", "splits"):
        try:
            bench.forced_decode(bad)
        except SystemExit as error:
            assert "BN:WARPS:STAGES nor Nsplits" in str(error)
        else:
            raise AssertionError(f"{bad!r} accepted")
