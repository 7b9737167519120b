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
        # 8 frames: decoded from the start up to the last one taken (too few to seek)
        assert meta == {"fps": fps, "source_fps": 8.0, "indices": indices, "decoded_frames": indices[-1] + 1}
        np.testing.assert_array_equal(frames, every[indices])


def every_frame(clip: bytes) -> np.ndarray:
    """All of a file's frames, decoded by PyAV directly: (F, H, W, 3) uint8."""
    import io

    import av

    with av.open(io.BytesIO(clip)) as container:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])


def frame_pts(clip: bytes) -> list[int]:
    """A file's frames' pts, in the order PyAV decodes them."""
    import io

    import av

    with av.open(io.BytesIO(clip)) as container:
        return [frame.pts for frame in container.decode(video=0)]


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


@pytest.mark.parametrize("codec, container", [("mpeg4", "mp4"), ("libvpx", "webm"), ("libvpx-vp9", "webm"),
                                              ("mpeg4", "matroska"), ("mpeg4", "mpegts"), ("mpeg4", "mpeg"),
                                              ("mpeg4", "avi"), ("libx264", "mp4")])
def test_sparse_frames_are_reached_by_seeking_and_are_the_same_frames(codec, container):
    """300 frames, a keyframe every 30: 6 frames chosen uniformly (every 50th) are reached by seeking to the
    keyframe before each and decoding forward (6 runs of at most 30 frames, not 251 frames), and they are the
    frames of a decode from the start (H.264 with B-frames too: decoded out of order, found by pts). MPEG-PS
    seeks land before the keyframe, mid-GOP: it decodes from the start (after one seek tried). Two frames in
    one GOP decode on from the first, not seeking again."""
    av = pytest.importorskip("av")
    from tiny_llava_next import make_clip

    if codec not in av.codecs_available:
        pytest.skip(f"this FFmpeg has no {codec} encoder")

    clip = make_clip(7, 300, codec=codec, container=container, gop=30)
    every = every_frame(clip)
    assert len(every) == 300
    meta = {}
    frames = decode_video(clip, "clip", LIMITS, ImageLimits(), meta, uniform_sampler(LIMITS))
    assert meta["indices"] == [0, 50, 100, 150, 200, 250]
    np.testing.assert_array_equal(frames, every[meta["indices"]])
    # per frame: from its keyframe (0, 30, 90, 150, 180, 240) to it
    seeking = 1 + 21 + 11 + 1 + 21 + 11
    assert meta["decoded_frames"] == (251 if container == "mpeg" else seeking)
    # 33 and 40 share the keyframe 30: one seek, then on; 280 and 299 seek to 270 (one run)
    near = [33, 40, 280, 299]
    frames = decode_video(clip, "clip", LIMITS, ImageLimits(), meta, lambda total, fps: near)
    np.testing.assert_array_equal(frames, every[near])
    assert meta["decoded_frames"] == (300 if container == "mpeg" else 4 + 7 + 11 + 19)


def remuxed(clip: bytes, container: str, change) -> bytes:
    """``clip``'s video packets, each passed through ``change`` (packet, its index), written to ``container``
    (nothing decoded or encoded)."""
    import io

    import av

    out = io.BytesIO()
    with av.open(io.BytesIO(clip)) as source, av.open(out, "w", format=container) as target:
        stream = target.add_stream_from_template(source.streams.video[0])
        for index, packet in enumerate(packet for packet in source.demux(video=0) if packet.size):
            change(packet, index)
            packet.stream = stream
            target.mux(packet)
    return out.getvalue()


def test_a_variable_frame_rate_file_is_seeked_by_its_frames_pts():
    """Frames 1/8 s apart +/- up to 80 ms (MKV, ms pts): frame i is the i-th smallest pts, not pts x rate,
    so seeking still finds the same frames."""
    pytest.importorskip("av")
    from tiny_llava_next import make_clip

    def jitter(packet, index):
        packet.pts = packet.dts = index * 125 + (index % 3) * 40  # steps of 45 to 165 ms

    clip = remuxed(make_clip(8, 300, container="matroska", gop=30), "matroska", jitter)
    every = every_frame(clip)
    steps = set(np.diff(frame_pts(clip)).tolist())
    assert steps == {45, 165}
    meta = {}
    frames = decode_video(clip, "clip", LIMITS, ImageLimits(), meta, uniform_sampler(LIMITS))
    np.testing.assert_array_equal(frames, every[[0, 50, 100, 150, 200, 250]])
    assert meta["decoded_frames"] == 66


def test_a_container_that_flags_every_frame_a_keyframe_is_decoded_from_the_start():
    """An MP4 whose every packet says keyframe (a sync-sample table that lies; the GOP is really 30): the
    seek lands on the packet asked for, the decoder takes its frame for no keyframe, and the file is decoded
    from the start, giving the same frames (seeking there would give broken ones)."""
    pytest.importorskip("av")
    from tiny_llava_next import make_clip

    def flag_key(packet, index):
        packet.is_keyframe = True

    clip = remuxed(make_clip(9, 300, gop=30), "mp4", flag_key)
    every = every_frame(clip)
    meta = {}
    frames = decode_video(clip, "clip", LIMITS, ImageLimits(), meta, lambda total, fps: [10, 100, 200])
    np.testing.assert_array_equal(frames, every[[10, 100, 200]])
    assert meta["decoded_frames"] == 1 + 201  # the first frame after one seek, then from the start
