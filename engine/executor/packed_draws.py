"""A step's draw settings as int32 values, for sampling on a pipeline's last stage.

Rank 0 decides which steps the last stage samples (engine/pipeline/runner.py). A step whose rows
are all plain greedy needs nothing more than the flag; a step with sampled rows also needs what
``build_sampling_metadata`` would give rank 0's sampler for them: each row's greedy flag,
temperature, top-k, top-p, seed and offset (its step). ``pack_draws`` puts them in the plan
(int32, like every plan field: floats as their float32 bits, the seed, < 2**62, as two 31-bit
halves) and ``draw_metadata`` rebuilds the SamplingMetadata on the last stage, field for field the
one rank 0 builds (tests/executor/test_sampler.py), so ``sample`` draws the same tokens there: the
Gumbel-max noise of a row depends only on its seed, its offset and the token
(kernels/sampling.py), not on the rows beside it.

Only for rows with nothing else to do (``sampler.draws_alone``: no penalties, bans, bias, grammar,
log-probs or returned logits); the others keep their logits going to rank 0.
"""
from __future__ import annotations

import struct

import torch

from engine.executor.request import Sequence
from engine.executor.sampler import SamplingMetadata, _on_device, draw_settings

# The packing: [whether the step's draws apply top-k / top-p, then per row DRAW_INTS values: greedy,
# temperature bits, top-k, top-p bits, seed low 31 bits, seed high bits, offset]
DRAW_INTS = 7
_SEED_LOW = (1 << 31) - 1


def _float_bits(value: float) -> int:
    return struct.unpack("<i", struct.pack("<f", value))[0]


def _bits_float(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<i", bits))[0]


def pack_draws(seqs: list[Sequence], vocab_size: int) -> list[int]:
    """The step's draws (module docstring): what build_sampling_metadata reads of each sequence, in
    row order, after the step's top-k / top-p flag (decided on the settings as it decides it: a
    micro-batch on the last stage takes its step's pass, as rank 0's sampler would)."""
    packed, needs_top_k_top_p = [0], False
    for seq in seqs:
        config = seq.state.request.sampling
        greedy = config.is_greedy or config.beam_width > 1
        temperature, top_k, top_p = (1.0, vocab_size, 1.0) if greedy else draw_settings(config, vocab_size)
        needs_top_k_top_p = needs_top_k_top_p or top_k < vocab_size or top_p < 1.0
        packed += (int(greedy), _float_bits(temperature), top_k, _float_bits(top_p), seq.seed & _SEED_LOW,
                   seq.seed >> 31, seq.num_generated_tokens)
    packed[0] = int(needs_top_k_top_p)
    return packed


def draw_metadata(packed: list[int], rows: list[int], vocab_size: int, device) -> SamplingMetadata:
    """The SamplingMetadata of ``rows`` of a step packed by ``pack_draws`` (a micro-batch's rows). As
    rank 0's for the step, not all greedy (a step of greedy rows alone packs no draws)."""
    fields = [packed[1 + row * DRAW_INTS:1 + (row + 1) * DRAW_INTS] for row in rows]
    greedy = [bool(f[0]) for f in fields]
    temperature = [_bits_float(f[1]) for f in fields]
    top_k = [f[2] for f in fields]
    top_p = [_bits_float(f[3]) for f in fields]
    return SamplingMetadata(
        all_greedy=False, is_greedy=_on_device(greedy, torch.bool, device),
        temperature=_on_device(temperature, torch.float32, device), top_k=_on_device(top_k, torch.int64, device),
        top_p=_on_device(top_p, torch.float32, device),
        draw_temperature=_on_device([0.0 if g else 1.0 for g in greedy], torch.float32, device),
        needs_top_k_top_p=bool(packed[0]),
        seeds=_on_device([f[4] | (f[5] << 31) for f in fields], torch.int64, device),
        offsets=_on_device([f[6] for f in fields], torch.int64, device),
        repetition_penalty=None, presence_penalty=None, frequency_penalty=None, prompt_token_ids=None,
        output_token_ids=None, banned=None, embedding_bias=None, return_log_probs=False)

