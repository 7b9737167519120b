"""Whisper token timestamps from the cross-attention of the alignment heads, as transformers'
``generate(return_token_timestamps=True)`` computes them (WhisperGenerationMixin._extract_token_timestamps,
after openai-whisper's find_alignment): the softmax cross-attention weights of the checkpoint's
alignment heads over the audio, per decoder token, normalized per audio position across tokens,
median-filtered along the audio, averaged over the heads; dynamic time warping then maps each token
to the encoder position where the path first reaches it (0.02 s each).

The weights come from a re-run of the decoder in plain torch (``cross_attention_weights``) over the
request's final tokens, reading its cross K/V from the engine's pool: exact (no weights are kept
during decoding), and paid only by a request that asks, once, as one prompt-sized pass. transformers
takes the weights from its generate loop, which never feeds back the last generated token: its row
is missing and the last token takes the previous one's time; the re-run feeds the prompt and every
generated token but the last, so the rows are the same.

Alignment heads: the generation config's ``alignment_heads`` ([[layer, head], ...]); a checkpoint
without them gets openai-whisper's default, every head of the last half of the decoder layers.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from engine.executor.request import FinishReason
from kernels.attention import gather_blocks

TIME_PRECISION = 0.02  # seconds per encoder position
MEDIAN_FILTER_WIDTH = 7  # WhisperConfig.median_filter_width (every released checkpoint keeps it)


def default_alignment_heads(num_layers: int, num_heads: int) -> list[tuple[int, int]]:
    """openai-whisper's default: every head of the last half of the decoder layers."""
    return [(layer, head) for layer in range(num_layers // 2, num_layers) for head in range(num_heads)]


@torch.inference_mode()
def cross_attention_weights(decoder, cross_pool: torch.Tensor, blocks: list[int], encoder_length: int,
                            ids: list[int], heads: list[tuple[int, int]]) -> torch.Tensor:
    """(len(heads), len(ids), encoder_length) float32: the cross-attention probabilities of ``heads``
    ((layer, head) pairs) for each of ``ids`` fed to ``decoder`` (engine/encoder_decoder/model.py's
    Decoder; learned or sinusoidal positions, no relative bias: Whisper) from position 0, over the
    request's cross K/V in ``cross_pool`` (num_layers, 2, blocks, tokens_per_block, heads, head_dim)
    at ``blocks``."""
    device = cross_pool.device
    n = len(ids)
    block_index = torch.tensor(blocks, device=device)
    x = decoder.embed(torch.tensor(ids, device=device), torch.arange(n, device=device))
    causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    wanted: dict[int, torch.Tensor] = {}
    for index, layer in enumerate(decoder.layers):
        def attend_self(h, attn=layer.self_attn):
            q, k, v = (attn.heads_of(p, h).transpose(0, 1) for p in (attn.q, attn.k, attn.v))  # (H, n, D)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal, scale=attn.scale)
            return attn.o(out.transpose(0, 1).flatten(1))

        def attend_encoder(h, attn=layer.cross_attn, index=index):
            # (2, blocks, T, H, D): only this request's blocks, widened from an FP8 pool to the model dtype
            pool = gather_blocks(cross_pool[index].transpose(0, 1), block_index).transpose(0, 1).to(h.dtype)
            k, v = (pool[i].reshape(-1, *pool.shape[-2:])[:encoder_length].transpose(0, 1) for i in (0, 1))
            q = attn.heads_of(attn.q, h).transpose(0, 1)  # (H, n, D)
            probs = torch.softmax((q.float() @ k.float().transpose(1, 2)) * attn.scale, dim=-1)  # (H, n, L)
            wanted[index] = probs
            return attn.o((probs.to(v.dtype) @ v).transpose(0, 1).flatten(1))

        x = _sublayer(layer.self_norm, layer.pre_norm, x, attend_self)
        x = _sublayer(layer.cross_norm, layer.pre_norm, x, attend_encoder)
        x = _sublayer(layer.mlp_norm, layer.pre_norm, x, layer.mlp)
        if all(l < index + 1 for l, _ in heads):  # the later layers do not matter
            break
    return torch.stack([wanted[layer][head] for layer, head in heads])


def _sublayer(norm, pre_norm: bool, x: torch.Tensor, fn) -> torch.Tensor:
    return x + fn(norm(x)) if pre_norm else norm(x + fn(x))


def median_filter(x: torch.Tensor, width: int) -> torch.Tensor:
    """Median of ``width`` (odd) neighbours along the last dimension, edges reflected."""
    pad = width // 2
    if x.shape[-1] <= pad:
        return x
    x = F.pad(x, (pad, pad, 0, 0), mode="reflect")
    return x.unfold(-1, width, 1).sort()[0][..., pad]


def dynamic_time_warping(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(text indices, time indices) of the cheapest monotonic path through ``matrix`` (tokens x
    positions), ties broken as openai-whisper and transformers break them."""
    rows, cols = matrix.shape
    cost = np.full((rows + 1, cols + 1), np.inf, np.float32)
    trace = -np.ones((rows + 1, cols + 1), np.float32)
    cost[0, 0] = 0
    for j in range(1, cols + 1):
        for i in range(1, rows + 1):
            c0, c1, c2 = cost[i - 1, j - 1], cost[i - 1, j], cost[i, j - 1]
            if c0 < c1 and c0 < c2:
                c, t = c0, 0
            elif c1 < c0 and c1 < c2:
                c, t = c1, 1
            else:
                c, t = c2, 2
            cost[i, j] = matrix[i - 1, j - 1] + c
            trace[i, j] = t
    i, j = rows, cols
    trace[0, :] = 2
    trace[:, 0] = 1
    text, time = [], []
    while i > 0 or j > 0:
        text.append(i - 1)
        time.append(j - 1)
        if trace[i, j] == 0:
            i, j = i - 1, j - 1
        elif trace[i, j] == 1:
            i -= 1
        else:
            j -= 1
    return np.array(text)[::-1], np.array(time)[::-1]


def token_timestamps(weights: torch.Tensor, num_prompt: int, num_frames: int | None = None,
                     filter_width: int = MEDIAN_FILTER_WIDTH) -> list[float]:
    """Seconds (from the window's start) of each token of prompt + generated ids, from the
    alignment heads' ``weights`` (heads, num_prompt + generated - 1, positions) of
    ``cross_attention_weights`` over the prompt and the generated ids but the last: 0 for the
    prompt's, the DTW time of each generated one, the last one's copied from the one before it.
    ``num_frames``: the window's mel frames of audio (the weights are cut to its positions)."""
    if num_frames is not None:
        weights = weights[..., : num_frames // 2]
    weights = weights[:, num_prompt:].float()
    if weights.shape[1] == 0:  # one generated token: no row (transformers answers zeros)
        return [0.0] * (num_prompt + 1)
    std, mean = torch.std_mean(weights, dim=-2, keepdim=True, unbiased=False)
    matrix = median_filter((weights - mean) / std, filter_width).mean(dim=0)
    text, time = dynamic_time_warping(-matrix.double().cpu().numpy())
    jumps = np.pad(np.diff(text), (1, 0), constant_values=1).astype(bool)
    times = (time[jumps] * TIME_PRECISION).tolist()
    return [0.0] * num_prompt + times + times[-1:]


def alignment_heads(spec) -> list[tuple[int, int]]:
    """The spec's alignment heads (from the generation config at build), or the default."""
    return [tuple(pair) for pair in spec.alignment_heads] or default_alignment_heads(spec.decoder_layers,
                                                                                     spec.decoder_heads)


def attach_token_timestamps(runner, spec, held: tuple, state, responses) -> None:
    """Sets ``token_timestamps`` on the final results among ``responses`` of ``state`` (a request
    whose cross K/V ``held`` = (blocks, encoder length, ...) is still in ``runner.cross_pool``): one
    time per token of its output_token_ids (0 for prompt tokens). Beam search is not covered (one
    stream per result)."""
    blocks, length = held[0], held[1]
    for response in responses:
        result = response.result
        if result is None or not result.is_final or state.is_beam_search:
            continue
        seq = next(s for s in state.sequences if s.sequence_index == result.sequence_index)
        tokens = seq.token_ids
        # every generated token was fed back except the last, unless the end id followed it
        fed = tokens if seq.finish_reason == FinishReason.END_ID else tokens[:-1]
        weights = cross_attention_weights(runner.model, runner.cross_pool, blocks, length, fed, alignment_heads(spec))
        times = token_timestamps(weights, seq.num_prompt_tokens)[:len(tokens)]
        result.token_timestamps = [times[len(tokens) - len(result.output_token_ids[0]):]]
