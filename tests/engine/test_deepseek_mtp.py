"""DeepSeek-V3's multi-token prediction module as a draft source (decoding_mode mtp;
engine/executor/speculative/mtp.py) on a tiny random V3 made by transformers, its MTP layer added
to the checkpoint by the test (transformers drops it when it saves): the module's draft logits equal
transformers' MtpModel's over the same target hidden states; greedy ids through the executor with
k = 3 chained drafts equal transformers' generate, drafts are both accepted and rejected, and the
module's slots go back to its pool when requests finish or are cancelled. The target's attention
and MLP outputs are scaled down and the module's eh_proj reads mostly the embedding, so that the
module guesses well (a random one would be rejected at every step, leaving acceptance untested).
"""
from __future__ import annotations

import pytest
import torch
import transformers

from engine.convert import getter_from_state_dict
from engine.build import build_from_hf
from engine.config import BuildConfig, EngineConfig
from engine.executor.executor import Executor, ExecutorConfig, ExecutorConfigError, SpeculativeConfig
from engine.executor.request import OutputConfig, Request
from engine.executor.runner import ModelRunner
from engine.executor.speculative.mtp import MtpProposer, _MtpSeq
from engine_testing import EXECUTOR_POOL, random_tokens
from test_deepseek import tiny_deepseek

MAX_TOKENS = 12


def _checkpoint():
    """(target, transformers MtpModel, state dict with the MTP layer as model.layers.2.*)."""
    hf = tiny_deepseek("v3", seed=3)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                p.mul_(0.3)
        hf.model.embed_tokens.weight.mul_(10.0)
    hf.config.num_nextn_predict_layers = 1
    mtp = transformers.modeling_layers.MtpModel(hf, 1).eval()
    torch.manual_seed(4)
    with torch.no_grad():
        for name, p in mtp.named_parameters():
            if name.startswith("layers."):
                p.copy_((1.0 if "norm" in name else 0.0) + 0.1 * torch.randn_like(p))
            if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                p.mul_(0.1)
        eh = mtp.layers[0].eh_proj.weight
        eh.mul_(0.1)[:, :64] += torch.eye(64)  # [embedding | hidden] -> mostly the embedding
        for name, b in mtp.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    state = dict(hf.state_dict())
    for name, t in list(mtp.state_dict().items()):
        if not name.startswith("layers.0."):
            continue
        rest = name[len("layers.0."):].replace("mtp_block.", "").replace("post_norm.", "shared_head.norm.")
        state[f"model.layers.2.{rest}"] = t
    return hf, mtp, state


def _build(hf, state, out_dir) -> str:
    build = BuildConfig(dtype="float32", max_batch_size=4, max_input_len=64, max_seq_len=64, max_num_tokens=64,
                        tokens_per_block=4)
    build_from_hf(hf.config, getter_from_state_dict(state, "tiny"), None, str(out_dir), build, progress=False)
    return str(out_dir)


@pytest.fixture(scope="module")
def mtp_engine(tmp_path_factory):
    hf, mtp, state = _checkpoint()
    return hf, mtp, _build(hf, state, tmp_path_factory.mktemp("deepseek_mtp") / "engine")


def test_module_draft_logits_equal_transformers_mtp_model(mtp_engine):
    """Slots 0..L-2 of a 13-token sequence, run in two catch-ups (9 slots, then the rest), give at
    slot L-2 the logits transformers' MtpModel gives from the target's last hidden states."""
    hf, mtp, engine_dir = mtp_engine
    assert EngineConfig.load(engine_dir).model.num_nextn_predict_layers == 1
    runner = ModelRunner(engine_dir)
    proposer = MtpProposer(runner)
    proposer.start(64, 4, 3)
    ids = random_tokens(13, 7)
    with torch.no_grad():
        hidden = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
        cache = transformers.cache_utils.MtpCache(config=hf.config.get_mtp_config())
        _, hf_logits, _ = mtp(input_ids=torch.tensor([ids[1:]]), last_hidden_states=hidden[None, :-1],
                              attention_mask=torch.ones(1, 12, dtype=torch.long), position_ids=torch.arange(1, 13)[None], mtp_cache=cache)
    state = _MtpSeq(64, torch.float32, runner.device)
    assert proposer._reserve_slots(state, 12)
    state.file_hidden(0, hidden[:6])
    state.file_hidden(6, hidden[6:12])
    proposer._catch_up([(state, ids, 10)])  # slots 0..8
    assert state.num_true == 9
    g = proposer._catch_up([(state, ids, 13)])[0]  # slots 9..11
    with torch.no_grad():
        logits = runner.model.compute_logits(g[None])[0]
    assert (logits - hf_logits[0, -1]).abs().max().item() < 1e-4
    proposer.close()


def _generate(engine_dir: str, prompts: list[list[int]], *, mtp: bool, device: str = "cpu"):
    """Greedy ids of ``prompts`` (in flight together, prefix reuse and chunked context on) plus one
    cancelled request; with mtp: 3 chained drafts a step, and the module's pool checked empty after.
    Returns (ids per prompt, perf metrics per prompt)."""
    config = ExecutorConfig(**EXECUTOR_POOL, enable_kv_cache_reuse=True, enable_chunked_context=True,
                            max_num_tokens=8, speculative=SpeculativeConfig(mode="mtp", max_draft_len=3) if mtp else None)
    perf = OutputConfig(exclude_input_from_output=True, return_perf_metrics=True)
    finals, metrics = {}, {}
    with Executor(engine_dir, config, device=device) as executor:
        if mtp:  # the module runs at most 4 rows a forward: prompts catch up in parts, and rows filed past
            executor.proposer.max_num_tokens = 4  # 4 not yet run are run as the target's chunks come
        ids, cancelled = [], None
        for batch in (prompts[:1], prompts[1:]):  # the first one's blocks are cached before the others come
            ids += executor.enqueue_requests([Request(p, MAX_TOKENS, output=perf) for p in batch])
            if cancelled is None:
                cancelled = executor.enqueue_requests([Request(random_tokens(6, 35), 40, output=perf)])[0]
                executor.cancel_request(cancelled)
            while len(finals) < len(ids) + 1:
                for response in executor.await_responses(timeout=1.0):
                    if response.result is not None and response.result.is_final:
                        finals[response.request_id] = response.result.output_token_ids[0]
                        metrics[response.request_id] = response.result.perf
                    elif response.error is not None:
                        assert response.request_id == cancelled, response.error
                        finals[response.request_id] = None
        if mtp:
            blocks = executor.proposer.blocks
            assert executor.proposer.num_sequences == 0 and blocks.num_free_blocks == blocks.num_blocks
            assert blocks.total_reused_blocks >= 1  # the third prompt's first block: slots 0-3 of the shared prefix
    return [finals[i] for i in ids], [metrics[i] for i in ids]


def _prompts() -> list[list[int]]:
    shared = random_tokens(8, 31)
    return [shared + random_tokens(7, 32), random_tokens(5, 33), shared + random_tokens(3, 34)]


def _mtp_ids_equal_generate(mtp_engine) -> tuple[int, int]:
    """_generate with mtp: each prompt's ids equal transformers' generate (no eos). Returns (drafted, accepted)."""
    hf, _, engine_dir = mtp_engine
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    prompts = _prompts()
    ids, metrics = _generate(engine_dir, prompts, mtp=True)
    for prompt, got in zip(prompts, ids):
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(prompt):]
        assert got == expected.tolist()
    return sum(m.total_draft_tokens for m in metrics), sum(m.total_accepted_draft_tokens for m in metrics)


def test_greedy_ids_equal_generate_with_chained_drafts(mtp_engine):
    """Three requests (two sharing a prefix that the prefix caches serve, the target's and the
    module's; chunked prompts): greedy ids with k = 3 chained drafts equal transformers' generate;
    some drafts kept, some not; a cancelled request and the finished ones leave the module's pool empty."""
    drafted, accepted = _mtp_ids_equal_generate(mtp_engine)
    assert drafted > 0 and 0 < accepted < drafted


def test_graph_paths_emulated_on_cpu_give_the_greedy_ids(mtp_engine, monkeypatch):
    """The CUDA-graph paths, emulated on the CPU (graph_emulation.py): the target's decode graphs and
    prefill graphs (verify steps padded to the 16-token bucket, its last layer tapped inside them)
    and the MTP module's own graphs (engine/executor/speculative/mtp_graphs.py) each replayed; ids
    equal transformers' generate, drafts kept, and the module's rows made from the tapped hidden
    states are shared by the prefix cache (_generate checks: rows from zeros never are)."""
    from graph_emulation import emulate_cuda_graphs

    replays = emulate_cuda_graphs(monkeypatch)
    assert _mtp_ids_equal_generate(mtp_engine)[1] > 0
    assert all(replays[name] > 0 for name in ("DeepseekForCausalLM-prefill", "MtpStep-decode", "MtpStep-prefill"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_mtp_on_cuda_gives_the_plain_greedy_ids(mtp_engine):
    """On CUDA (the module's attention and experts in the Triton kernels, the target's decode steps
    replayed from graphs where no sequence drafts): the same ids as plain decoding there, drafts kept."""
    _, _, engine_dir = mtp_engine
    plain, _ = _generate(engine_dir, _prompts(), mtp=False, device="cuda")
    ids, metrics = _generate(engine_dir, _prompts(), mtp=True, device="cuda")
    assert ids == plain
    assert sum(m.total_accepted_draft_tokens for m in metrics) > 0


def test_engine_without_mtp_module_is_refused_by_name(mtp_engine, tmp_path):
    """A checkpoint without the MTP layer (as transformers saves one) builds without the module;
    decoding_mode mtp on it is refused at start, naming what is missing."""
    hf, _, _ = mtp_engine
    engine_dir = _build(hf, dict(hf.state_dict()), tmp_path / "engine")
    assert EngineConfig.load(engine_dir).model.num_nextn_predict_layers == 0
    config = ExecutorConfig(**EXECUTOR_POOL, speculative=SpeculativeConfig(mode="mtp", max_draft_len=2))
    with pytest.raises(ExecutorConfigError, match="decoding_mode mtp needs an engine with a multi-token prediction"):
        Executor(engine_dir, config)
