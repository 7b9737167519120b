"""A request's choice of an encoded video's frames (serving/videos.py): ``fps`` frames per second of video or
``num_frames`` frames, as vLLM's mm_processor_kwargs and transformers' video processors take them; bad values
are errors naming the field, what was wrong and what is allowed. Qwen3-VL's own rule is
tests/engine/test_qwen3_vl.py's."""
from __future__ import annotations

import numpy as np
import pytest

from serving.images import ImageLimits
from serving.videos import FrameRequest, VideoError, VideoLimits, decode_video, frame_request, uniform_sampler

LIMITS = VideoLimits(max_frames=6)


FIELDS = ("m.fps", "m.num_frames")


@pytest.mark.parametrize("fps, num_frames, field, words", [
    (2, 4, "m.fps", "m.fps and m.num_frames were both given; give one of them"),
    (0, None, "m.fps", "m.fps is 0; allowed: a number of frames per second above 0 and at most 240"),
    (-1.5, None, "m.fps", "above 0"), ("2", None, "m.fps", "'2'"), (float("nan"), None, "m.fps", "nan"),
    (1000, None, "m.fps", "at most 240"), (True, None, "m.fps", "True"),
    (None, 0, "m.num_frames", "m.num_frames is 0; allowed: an integer from 1 to 6 (max_num_frames"),
    (None, 7, "m.num_frames", "from 1 to 6"), (None, 2.5, "m.num_frames", "2.5"),
])
def test_bad_frame_choices_name_the_field(fps, num_frames, field, words):
    with pytest.raises(VideoError) as caught:
        frame_request(fps, num_frames, FIELDS, LIMITS)
    assert caught.value.field == field and words in str(caught.value)


def test_a_files_frames_follow_the_requests_fps_or_count():
    """An 8-frame MP4 at 8 fps (1 s): by default every frame up to max_num_frames (6: the anchor client's
    uniform indices); 4 fps -> 4 frames, their rate 4 (Qwen2.5-VL's second_per_grid_t reads it); num_frames 3
    -> 3; 30 fps asks 30 and gets max_num_frames. Frames taken are the decoded ones at those indices."""
    pytest.importorskip("av")
    from tiny_llava_next import make_clip

    clip = make_clip(4, 8)
    every = decode_video(clip, "clip", VideoLimits(), ImageLimits())
    for request, indices, fps in ((FrameRequest(), [0, 1, 2, 4, 5, 6], 6.0),
                                  (frame_request(4, None, FIELDS, LIMITS), [0, 2, 4, 6], 4.0),
                                  (frame_request(None, 3, FIELDS, LIMITS), [0, 2, 5], 3.0),
                                  (frame_request(30, None, FIELDS, LIMITS), [0, 1, 2, 4, 5, 6], 6.0)):
        meta = {}
        frames = decode_video(clip, "clip", LIMITS, ImageLimits(), meta, uniform_sampler(LIMITS, request))
        assert meta == {"fps": fps, "source_fps": 8.0, "indices": indices}
        np.testing.assert_array_equal(frames, every[indices])
