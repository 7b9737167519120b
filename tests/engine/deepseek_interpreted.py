"""The tiny DeepSeek V2 / V3 engines' CUDA code path run on the CPU: every kernel module's ``use_triton``
answers True, so the Triton kernels (routing, grouped experts with the shared ones appended, MLA with
the per-forward token map, strided rotary, unsummed expert rows into the norms) run in Triton's
interpreter (TRITON_INTERPRET=1); logits of packed chunks, 8-9-token steps and single-token decode
steps against transformers' (the one-token expert GEMMs in tiles marked as the load-time
choice marks them). Run by test_deepseek.py in a subprocess (the patch must precede every
kernel import); prints one "ok <version> <max error> <decode-path expert calls> <of them with the norm in
the router's launch> <MLA decode-kernel launches of this version>" line a version. A version "v2:32" runs on
pages of 32 tokens (4 otherwise): kernels/mla_decode.py's tiles fit there, so its decode steps take that kernel.
"""
import os
import pathlib
import sys
import tempfile

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
import kernels._triton as kt  # noqa: E402

kt.use_triton = lambda t: kt.HAVE_TRITON  # before any kernel module imports it by name
sys.path[:0] = [str(pathlib.Path(__file__).parent)]
import torch  # noqa: E402
from engine_testing import PagedSession, hf_logits, make_engine, random_tokens  # noqa: E402
from test_deepseek import tiny_deepseek  # noqa: E402

import engine.models.deepseek as deepseek  # noqa: E402
import kernels.mla_attention as mla_attention  # noqa: E402
from engine.executor.runner import ModelRunner  # noqa: E402
from kernels.moe_decode_tiles import DECODE_TILE_CANDIDATES, mark_decode_tiles  # noqa: E402

decode_calls = normed_calls = mla_decode_launches = 0
_mla_decode_launch = mla_attention.mla_decode_launch


def counted_mla_decode(*args, **kwargs):
    global mla_decode_launches
    mla_decode_launches += 1
    return _mla_decode_launch(*args, **kwargs)


mla_attention.mla_decode_launch = counted_mla_decode
_routed, _forward_normed = deepseek.DeepseekExperts._routed, deepseek.DeepseekExperts.forward_normed


def counted(self, x, weights, ids):
    global decode_calls
    decode_calls += self.with_shared is not None
    return _routed(self, x, weights, ids)


def counted_normed(self, *args, **kwargs):
    global normed_calls
    normed_calls += 1
    return _forward_normed(self, *args, **kwargs)


deepseek.DeepseekExperts._routed = counted
deepseek.DeepseekExperts.forward_normed = counted_normed
for spec in sys.argv[1:] or ["v2", "v3"]:
    version, _, page = spec.partition(":")
    mla_decode_launches = 0
    hf = tiny_deepseek(version)
    runner = ModelRunner(make_engine(hf, pathlib.Path(tempfile.mkdtemp()) / "engine", tokens_per_block=int(page or 4)))
    assert all(layer.attn.qkv_a_proj is not None for layer in runner.model.layers)
    # one-token expert GEMMs in tiles other than the table's, as a load-time choice marks them on CUDA
    experts = runner.model.decode_experts()
    assert experts and all(top_k == runner.model.config.num_experts_per_tok + runner.model.config.n_shared_experts
                           for _, _, top_k in experts)
    for gate_up, _, _ in experts:
        mark_decode_tiles(gate_up, DECODE_TILE_CANDIDATES[1], DECODE_TILE_CANDIDATES[2])
    seqs = {0: random_tokens(19, 3), 1: random_tokens(9, 4)}
    session = PagedSession(runner, num_blocks=32)
    a0, b0 = session.step([(0, seqs[0][:11]), (1, seqs[1][:7])])
    a1, b1 = session.step([(0, seqs[0][11:18]), (1, seqs[1][7:8])])
    a2, b2 = session.step([(0, seqs[0][18:]), (1, seqs[1][8:])])
    worst = max((torch.cat(parts) - hf_logits(hf, seqs[seq])).abs().max().item()
                for seq, parts in ((0, (a0, a1, a2)), (1, (b0, b1, b2))))
    extra = random_tokens(3, 9)
    for i, token in enumerate(extra):  # single-token steps: one block an expert, no alignment
        (row,) = session.step([(1, [token])])
        worst = max(worst, (row - hf_logits(hf, seqs[1] + extra[:i + 1])[-1:]).abs().max().item())
    print("ok", spec, worst, decode_calls, normed_calls, mla_decode_launches, flush=True)
