"""engine/encoder_decoder/whisper_timestamps.py against transformers' WhisperTimeStampLogitsProcessor:
the masked logits of random rows after random histories (text, single and paired timestamps, the
first step with its max_initial limit) are equal."""
import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import WhisperTimeStampLogitsProcessor

from engine.encoder_decoder.whisper_timestamps import (TimestampRules, apply_timestamp_rules, rules_for_prompt,
                                                       timestamp_batch)

VOCAB, NO_TIMESTAMPS, EOS, PROMPT = 40, 20, 1, [17, 18, 19]


def test_rules_equal_transformers_processor():
    torch.manual_seed(0)
    config = GenerationConfig(no_timestamps_token_id=NO_TIMESTAMPS, eos_token_id=EOS, max_initial_timestamp_index=3)
    reference = WhisperTimeStampLogitsProcessor(config, begin_index=len(PROMPT))
    rules = TimestampRules(NO_TIMESTAMPS, EOS, 3)
    histories = [[], [21], [21, 22], [21, 5, 6], [21, 5, 30], [21, 5, 30, 30], [21, 5, 30, 31, 7], [25, 3]]
    for history in histories:
        logits = torch.randn(2, VOCAB) * 3
        logits[1, 21:] += 4  # a row whose timestamps outweigh the text
        expected = reference(torch.tensor([PROMPT + history] * 2), logits.clone())
        got = apply_timestamp_rules(logits, timestamp_batch([(0, rules, history), (1, rules, history)], VOCAB, "cpu"))
        torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=str(history))


def test_only_prompts_without_notimestamps_get_rules():
    assert rules_for_prompt([17, 18, 19], 17, NO_TIMESTAMPS, EOS, None) == TimestampRules(NO_TIMESTAMPS, EOS, None)
    assert rules_for_prompt([17, 18, 19, 20], 17, NO_TIMESTAMPS, EOS, None) is None
    assert rules_for_prompt([17, 18, 19], 17, -1, EOS, None) is None  # an engine without <|notimestamps|>
    assert rules_for_prompt([0], 17, NO_TIMESTAMPS, EOS, None) is None  # not a Whisper prompt
    assert rules_for_prompt([17], 17, NO_TIMESTAMPS, EOS, None) is None  # language detection's one step
    assert rules_for_prompt([12, 8, 17], 17, NO_TIMESTAMPS, EOS, None) is None


def test_suppressed_tokens_always_and_at_the_first_step():
    """The generation config's suppress_tokens are banned at every step, begin_suppress_tokens at
    the first only (transformers' SuppressTokens / SuppressTokensAtBegin processors)."""
    from types import SimpleNamespace

    from engine.executor.request import Request
    from engine.executor.sampler import banned_tokens

    request = Request(PROMPT, 8, whisper_suppress=((3, 5), (1, 9)))
    seq = lambda generated: SimpleNamespace(state=SimpleNamespace(request=request), grammar=None,  # noqa: E731
                                            token_ids=PROMPT + generated, num_generated_tokens=len(generated))
    assert sorted(banned_tokens(seq([]))) == [1, 3, 5, 9]
    assert sorted(banned_tokens(seq([-1]))) == [3, 5]  # a placeholder (overlapped step) counts as generated
