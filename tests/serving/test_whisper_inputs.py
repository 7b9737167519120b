"""serving/whisper.py (the whisper_bls rules): audio cut to WAV_LENS with named errors, log-mels as
the checkpoint's feature extractor makes them (padded to its window unless zero_pad), long-form
windows cut as transformers' sequential long-form generation cuts them, the default prompt,
tensorrt_llm's tensors and the transcript without <|...|> tokens."""
import numpy as np
import pytest
import torch

from serving.whisper import (WhisperInputError, audio_samples, check_language_known, check_length, detection_inputs,
                             fit_max_tokens, language_code, language_position, log_mel, previous_text_ids, prompt_ids,
                             tensorrt_llm_inputs, timestamp_begin, transcript)
from serving.whisper_long_form import LongForm, Window
from tiny_encdec import GERMAN, START_OF_PREV, TIMESTAMP_BEGIN, WHISPER_PROMPT, feature_extractor, tokenizer


@pytest.mark.parametrize("wav, lens, message", [
    (np.zeros(10, np.float32), [20], "WAV_LENS is 20 but WAV holds 10 samples"),
    (np.zeros(0, np.float32), None, "WAV is empty"),
    (np.array([0.0, np.nan], np.float32), None, "NaN or infinite"),
    (np.zeros(48001, np.float32), None, "at most 3 s per request"),
])
def test_bad_audio_is_named(wav, lens, message):
    with pytest.raises(WhisperInputError, match=message):
        check_length(audio_samples(wav, lens), max_seconds=3)


def test_features_prompt_tensors_and_transcript():
    samples = audio_samples(np.linspace(-0.5, 0.5, 16000, dtype=np.float32), [8000])
    assert samples.size == 8000
    extractor = feature_extractor()
    full, short = log_mel(extractor, samples, zero_pad=False), log_mel(extractor, samples, zero_pad=True)
    assert full.shape == (100, 8) and short.shape == (50, 8)
    expected = extractor(samples, sampling_rate=16000, return_tensors="np", padding="max_length")["input_features"]
    np.testing.assert_array_equal(full, expected[0].T)
    assert prompt_ids(tokenizer(), "") == WHISPER_PROMPT
    inputs = tensorrt_llm_inputs(full, WHISPER_PROMPT, max_tokens=50, end_id=1, streaming=False)
    assert inputs["encoder_input_features"].shape == (1, 100, 8)
    assert inputs["encoder_output_lengths"].tolist() == [[50]] and inputs["decoder_input_ids"].tolist() == [WHISPER_PROMPT]
    assert transcript(tokenizer(), [17, 20, 30, 31]) == "w30 w31"
    assert timestamp_begin(tokenizer(), WHISPER_PROMPT) is None and timestamp_begin(tokenizer(), [17]) == TIMESTAMP_BEGIN


def test_english_only_prompts():
    assert prompt_ids(tokenizer(), "", english_only=True) == [17, 20]  # no <|en|><|transcribe|>
    with pytest.raises(WhisperInputError, match=r"TEXT_PREFIX asks for <\|de\|>, <\|translate\|>"):
        prompt_ids(tokenizer(), "<|startoftranscript|><|de|><|translate|><|notimestamps|>", english_only=True)


def _windows(clip: LongForm, ids_of=lambda window: []) -> list[Window]:
    result = []
    while (window := clip.next_window()) is not None:
        result.append(window)
        clip.finish(window, ids_of(window))
    return result


def test_long_form_windows_are_transformers_segments():
    """2.5 s against the tiny extractor's 1-s window: three windows, whose features are
    transformers' _get_input_segment slices of the whole clip's log-mels (last one zero-padded)."""
    from transformers import WhisperForConditionalGeneration

    extractor = feature_extractor()
    samples = np.random.default_rng(0).uniform(-0.5, 0.5, 40000).astype(np.float32)
    clip = LongForm.of(extractor, samples, zero_pad=False)
    cut = _windows(clip)
    assert [(s.start, s.end) for s in clip.segments] == [(0.0, 1.0), (1.0, 2.0), (2.0, 2.5)]
    whole = torch.tensor(extractor(samples, sampling_rate=16000, return_tensors="np", padding="longest",
                                   truncation=False)["input_features"])
    for w, seek in zip(cut, (0, 100, 200)):
        reference = WhisperForConditionalGeneration._get_input_segment(
            whole, torch.tensor([seek]), torch.tensor([min(100, 250 - seek)]), 100, 1, [0])
        np.testing.assert_array_equal(w.features, reference[0].T.numpy())
    assert [w.features.shape[0] for w in _windows(LongForm.of(extractor, samples, zero_pad=True))] == [100, 100, 50]


def test_timestamp_segments_and_seek():
    """transformers' _retrieve_segment: pairs close segments, the next window starts at the last
    closed timestamp; a single timestamp at the end moves past the window; times in seconds."""
    clip = LongForm.of(feature_extractor(), np.zeros(40000, np.float32), zero_pad=False, timestamp_begin=21)
    window = clip.next_window()  # text ids < 21; 21 = <|0.00|>, 26 = <|0.10|>, 40 = <|0.38|>
    assert [(s.start, s.end, s.ids) for s in clip.finish(window, [21, 5, 6, 26, 26, 7, 40, 40, 8])] == \
        [(0.0, 0.1, [5, 6]), (0.1, 0.38, [7])]  # the unfinished tail (8) is dropped
    assert clip.seek == 38  # <|0.38|>: 19 positions, 38 frames
    assert clip.finish(clip.next_window(), [21, 5, 25])[0].end == 0.46  # no pair: up to its last timestamp
    assert clip.seek == 138  # and past the whole window


def test_previous_text_prompt_is_transformers_prompt_ids():
    """OpenAI's prompt: <|startofprev|> + " " + the text's tokens, as transformers' get_prompt_ids
    makes them (the served test holds the output to generate(prompt_ids=...)); cut to the last
    max_positions // 2 - 1 text tokens; a special token in the text is refused naming PROMPT."""
    ids = previous_text_ids(tokenizer(), "  This is good ", 40)
    assert ids == [START_OF_PREV] + tokenizer()(" This is good", add_special_tokens=False)["input_ids"]
    assert previous_text_ids(tokenizer(), " ".join(["good"] * 30), 40) == [START_OF_PREV] + [10] * 19
    with pytest.raises(WhisperInputError, match="PROMPT holds the special token <\\|en\\|>"):
        previous_text_ids(tokenizer(), "good <|en|>", 40)
    assert fit_max_tokens(ids + WHISPER_PROMPT, 96, 40, 36) == 28
    with pytest.raises(WhisperInputError, match="PROMPT: the decoder prompt is 40 tokens"):
        fit_max_tokens([10] * 40, 8, 40, 48)


def test_language_detection_request():
    """A prefix without a language token gets the detected one right after <|startoftranscript|>;
    the detection request is one step after [<|startoftranscript|>] with every non-language id at -inf."""
    languages = {"<|en|>": 18, "<|de|>": GERMAN}
    assert language_position(tokenizer(), [17, 19, 20], languages) == 1
    assert language_position(tokenizer(), [START_OF_PREV, 8, 17], languages) == 3
    assert language_position(tokenizer(), WHISPER_PROMPT, languages) is None
    assert language_code(tokenizer(), [17, GERMAN, 19], languages) == "de"
    check_language_known(tokenizer(), [17, 19, 20], languages)  # detected
    check_language_known(tokenizer(), WHISPER_PROMPT, {})  # named
    with pytest.raises(WhisperInputError, match="TEXT_PREFIX names no language .* no lang_to_id"):
        check_language_known(tokenizer(), [17, 19, 20], {})
    inputs = detection_inputs(np.zeros((100, 8), np.float32), 17, 1, 64, languages)
    assert inputs["decoder_input_ids"].tolist() == [[17]] and inputs["request_output_len"].tolist() == [[1]]
    bias = inputs["embedding_bias"][0]
    assert bias.shape == (64,) and np.isinf(bias).sum() == 62 and bias[18] == bias[GERMAN] == 0


def test_words_group_pieces_and_punctuation():
    """Tokens into words (serving/whisper_words.py): a piece starting with a space starts a word,
    opening punctuation joins the next word and closing punctuation the previous one; timestamp
    tokens are no words; a word ends where the token after its last starts (the last one: at its
    own time, or at the next token's given)."""
    from serving.whisper_words import segment_words

    class Pieces:  # a tokenizer whose ids decode to these pieces
        table = {1: " Hello", 2: ",", 3: " (", 4: "wor", 5: "ld", 6: ")", 7: " bye", 8: ".", 50: "<|0.00|>",
                 51: "<|0.50|>"}

        def decode(self, ids, skip_special_tokens=False):
            return "".join(self.table[i] for i in ids)

    ids = [50, 1, 2, 3, 4, 5, 6, 7, 8, 51]
    times = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]
    words = [(w.word, w.start, w.end) for w in segment_words(Pieces(), ids, times, 50)]
    assert words == [("Hello,", 0.1, 0.3), ("(world)", 0.3, 0.7), ("bye.", 0.7, 0.9)]
    assert [(w.word, w.end) for w in segment_words(Pieces(), [1, 7], [0.1, 0.4], None)] == [("Hello", 0.4),
                                                                                            ("bye", 0.4)]
    assert segment_words(Pieces(), [1, 7], [0.1, 0.4], None, next_time=0.6)[-1].end == 0.6
    Pieces.table.update({60: "你", 61: "好", 62: "。"})  # written without spaces: a word per character
    assert [w.word for w in segment_words(Pieces(), [60, 61, 62], [0.0, 0.2, 0.4], None, language="zh")] == ["你",
                                                                                                          "好。"]
