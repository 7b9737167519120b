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


def every_frame(clip: bytes) -> np.ndarray:
    """All of a file's frames, decoded by PyAV directly: (F, H, W, 3) uint8."""
    import io

    import av

    with av.open(io.BytesIO(clip)) as container:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])


@pytest.mark.parametrize("codec, container", [("libvpx", "webm"), ("mpeg4", "matroska"), ("mpeg4", "mpegts"),
                                              ("mpeg4", "mpeg")])
def test_a_file_without_a_frame_count_is_counted_by_packets_and_decoded_once(codec, container):
    """WebM, MKV, MPEG-TS and MPEG-PS headers do not count frames: the count is the stream's packets
    (demuxed, nothing decoded), and the frames taken are those at the indices of the decoded count, as
    when the file was decoded whole to count. (MPEG-PS's duration x rate would say 8 frames, not 11.)"""
    pytest.importorskip("av")
    import io

    import av
    from tiny_llava_next import make_clip

    clip = make_clip(5, 11, codec=codec, container=container)
    with av.open(io.BytesIO(clip)) as opened:
        assert opened.streams.video[0].frames == 0  # the header does not count them
    every = every_frame(clip)
    assert len(every) == 11
    meta = {}
    frames = decode_video(clip, "clip", LIMITS, ImageLimits(), meta, uniform_sampler(LIMITS))
    assert meta["indices"] == [0, 1, 3, 5, 7, 9] == uniform_sampler(LIMITS)(11, 8.0)
    np.testing.assert_array_equal(frames, every[meta["indices"]])
    # the limit holds the count exactly: 11 frames pass at 11
    tight = VideoLimits(max_frames=6, max_decoded_frames=11)
    np.testing.assert_array_equal(decode_video(clip, "clip", tight, ImageLimits()), frames)


@pytest.mark.parametrize("container, words", [
    ("mp4", "video_bytes_input holds 11 frames; allowed: at most 10 frames in a video file (max_decoded_frames"),
    ("webm", "video_bytes_input holds more than 10 frames; allowed: at most 10 frames in a video file "
             "(max_decoded_frames"),
])
def test_a_file_of_more_frames_than_max_decoded_frames_is_refused_before_decoding(container, words):
    """From the MP4 header's count, or the WebM stream's packets; the error names the input, the count and
    the limit, and says what to send instead."""
    pytest.importorskip("av")
    from serving.videos import frames_from_bytes
    from tiny_llava_next import make_clip

    clip = make_clip(6, 11, codec="libvpx" if container == "webm" else "mpeg4", container=container)
    item = np.frombuffer(clip, np.uint8).reshape(1, 1, 1, -1)
    with pytest.raises(VideoError) as caught:
        frames_from_bytes(item, VideoLimits(max_frames=6, max_decoded_frames=10), ImageLimits())
    assert words in str(caught.value) and "send a shorter video" in str(caught.value)
