"""The video limits `tritonllm serve` takes (--max_num_frames, --max_decoded_frames) reach both readers:
checkpoint_repository fills them into the multimodal repository's preprocessing parameters, which the
preprocessing model reads (all_models/preprocessing/1/model.py: get_parameter -> video_limits) and the OpenAI
frontend reads (openai_frontend/repository.py vision_settings -> openai_frontend/vision.py video_limits).
A stub engine directory: only config.json and vision_encoder/config.json are looked at."""
import json
from pathlib import Path

from openai_frontend.repository import model_parameters, vision_settings
from serving.params import get_parameter
from serving.videos import DEFAULT_MAX_DECODED_FRAMES, DEFAULT_MAX_NUM_FRAMES, VideoLimits, video_limits
from tritonllm.serve import checkpoint_repository


def _vision_engine(root: Path) -> Path:
    (root / "vision_encoder").mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({"build": {"max_seq_len": 256}}))
    (root / "vision_encoder" / "config.json").write_text("{}")
    return root


def _both_readers(repo: str, engine: Path) -> tuple[VideoLimits, VideoLimits]:
    params = model_parameters(repo, "preprocessing")
    triton = video_limits(get_parameter(params, "max_num_frames", int),
                          get_parameter(params, "max_decoded_frames", int))
    settings = vision_settings(repo, str(engine))
    return triton, video_limits(settings.max_num_frames, settings.max_decoded_frames)


def test_serve_fills_the_video_limits_both_paths_read(tmp_path):
    engine = _vision_engine(tmp_path / "engine")
    repo, _ = checkpoint_repository(str(engine), str(tmp_path / "repo"), bls_instances=1,
                                    images={"max_num_frames": 8, "max_decoded_frames": 900})
    expected = VideoLimits(max_frames=8, max_decoded_frames=900)
    assert _both_readers(repo, engine) == (expected, expected)


def test_unset_video_limits_are_the_defaults_on_both_paths(tmp_path):
    engine = _vision_engine(tmp_path / "engine")
    repo, _ = checkpoint_repository(str(engine), str(tmp_path / "repo"), bls_instances=1,
                                    images={"max_num_frames": None, "max_decoded_frames": None})
    assert model_parameters(repo, "preprocessing")["max_decoded_frames"] == "${max_decoded_frames}"  # left unfilled
    expected = VideoLimits(max_frames=DEFAULT_MAX_NUM_FRAMES, max_decoded_frames=DEFAULT_MAX_DECODED_FRAMES)
    assert _both_readers(repo, engine) == (expected, expected)
