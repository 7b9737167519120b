"""LLaVA-OneVision video through engine.build: an 8-frame clip written with PyAV, decoded and processed
as the preprocessing model does (serving/videos.py), through the encoder's video path (frames through
SigLIP, 2x2 bilinear pooling, one newline; engine/vision/onevision_video.py), gives transformers'
get_video_features rows; greedy ids through the executor for a video request, an image request and a
text-only request in one batch equal transformers' generate on the same processor outputs; a re-sent
video hits the prefix cache, another does not."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("PIL")
pytest.importorskip("av")

from engine.build import main  # noqa: E402
from engine.executor import Executor, ExecutorConfig, OutputConfig, Request  # noqa: E402
from engine.executor.prompt_table import PromptTable  # noqa: E402
from engine.vision.encoder_dir import load_vision_encoder, read_encoder_config, vision_encoder_dir  # noqa: E402
from engine.vision.onevision_video import VIDEO_PROCESSOR_FILE, video_token_count  # noqa: E402
from serving.images import ImageLimits  # noqa: E402
from serving.videos import VideoFrames, VideoLimits, frames_from_bytes  # noqa: E402
from tests.executor.executor_testing import collect, final_tokens  # noqa: E402
from tiny_llava import IMAGE_TOKEN_INDEX, VOCAB, make_image  # noqa: E402
from tiny_llava_next import VIDEO_TOKEN_INDEX, hf_model, image_processor, make_clip, write_checkpoint  # noqa: E402

KIND = "llava_onevision"
FRAMES = 8


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(engine dir, transformers model, encoder)."""
    root = tmp_path_factory.mktemp("onevision_video")
    checkpoint = write_checkpoint(KIND, root / "checkpoint")
    assert main(["--checkpoint", str(checkpoint), "--output", str(root / "engine"), "--dtype", "float32",
                 "--max_seq_len", "256", "--tokens_per_block", "4"]) == 0
    engine = str(root / "engine")
    return engine, hf_model(KIND), load_vision_encoder(vision_encoder_dir(engine))


def clip_pixels(engine: str, seed: int) -> np.ndarray:
    """The preprocessing model's pixel values of an encoded clip: decoded, (F, 3, 28, 28) float32."""
    import json

    frames = frames_from_bytes(np.frombuffer(make_clip(seed, FRAMES), np.uint8).reshape(1, 1, 1, -1),
                               VideoLimits(), ImageLimits())
    assert frames.shape == (FRAMES, 40, 52, 3)
    with open(f"{vision_encoder_dir(engine)}/{VIDEO_PROCESSOR_FILE}") as f:
        return VideoFrames(json.load(f))(frames)


def test_video_rows_equal_transformers_video_features(built):
    engine, hf, encoder = built
    config = read_encoder_config(vision_encoder_dir(engine))
    pixels = [clip_pixels(engine, seed) for seed in (1, 2)]
    # two videos (8 and 3 frames) in one tower batch
    rows = encoder.video_features(torch.from_numpy(np.concatenate([pixels[0], pixels[1][:3]])), [FRAMES, 3])
    assert [len(r) for r in rows] == [video_token_count(config["video"]["side"], n) for n in (FRAMES, 3)] == [33, 13]
    with torch.no_grad():
        for video, got in zip((pixels[0], pixels[1][:3]), rows):
            expected = hf.get_video_features(torch.from_numpy(video)[None]).pooler_output[0]
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_greedy_ids_for_video_image_and_text_in_one_batch_equal_transformers(built):
    engine, hf, encoder = built
    video = torch.from_numpy(clip_pixels(engine, 3))
    (video_rows,) = encoder.video_features(video, [FRAMES])
    image = image_processor(KIND)([make_image(4, (40, 52))], return_tensors="pt")
    (image_rows,) = encoder.image_features(image["pixel_values"][0], image["image_sizes"].tolist())
    text = [7, 8, 9, 10, 11, 6]  # What is in the image? ASSISTANT:
    prompts = [[1, 5, *range(VOCAB, VOCAB + len(video_rows)), *text],
               [1, 5, *range(VOCAB, VOCAB + len(image_rows)), *text], [1, 5, *text]]
    tables = [PromptTable(video_rows), PromptTable(image_rows), None]
    requests = [Request(prompt, 6, output=OutputConfig(exclude_input_from_output=True), prompt_table=table)
                for prompt, table in zip(prompts, tables)]
    (other_rows,) = encoder.video_features(torch.from_numpy(clip_pixels(engine, 1)), [FRAMES])
    with Executor(engine, ExecutorConfig()) as executor:
        ids = executor.enqueue_requests(requests)
        responses = collect(executor, ids)
        # the prefix cache keys a video's blocks by its rows, as an image's: the same video re-sent
        # reuses its blocks (all 10 full ones of the 41 prompt tokens), another video none
        reused = []
        for rows in (video_rows, other_rows):
            [again] = executor.enqueue_requests([Request(prompts[0], 2, output=OutputConfig(return_perf_metrics=True),
                                                         prompt_table=PromptTable(rows))])
            reused.append(collect(executor, [again])[again][-1].result.perf.kv_cache_reused_blocks)
    assert reused == [10, 0]
    got = [final_tokens(responses[request_id]) for request_id in ids]

    def generate(prompt, placeholder, **pixels):
        hf_prompt = torch.tensor([[t if t < VOCAB else placeholder for t in prompt]])
        return hf.generate(input_ids=hf_prompt, max_new_tokens=6, do_sample=False,
                           **pixels)[0, hf_prompt.shape[1]:].tolist()

    expected = [generate(prompts[0], VIDEO_TOKEN_INDEX, pixel_values_videos=video[None]),
                generate(prompts[1], IMAGE_TOKEN_INDEX, pixel_values=image["pixel_values"],
                         image_sizes=image["image_sizes"]),
                generate(prompts[2], None)]
    assert got == expected
    assert len({tuple(g) for g in got}) == 3  # the video and the image matter


def test_video_processing_equals_transformers_video_processor(built):
    """Where torchvision is installed (transformers' video processors need it): our frames -> pixel
    values equal LlavaOnevisionVideoProcessor's from the same settings file."""
    pytest.importorskip("torchvision")
    from transformers import AutoVideoProcessor

    engine = built[0]
    frames = frames_from_bytes(np.frombuffer(make_clip(5, FRAMES), np.uint8).reshape(1, 1, 1, -1), VideoLimits(),
                               ImageLimits())
    expected = AutoVideoProcessor.from_pretrained(vision_encoder_dir(engine))(videos=[frames], return_tensors="np")
    np.testing.assert_allclose(clip_pixels(engine, 5), expected["pixel_values_videos"][0], atol=1e-6)


QUERY = "What is in the image?"


def clip_item(seed: int, frames: int = FRAMES) -> np.ndarray:
    """An encoded clip as one video_bytes_input item holds it: (1, 1, 1, num_bytes)."""
    return np.frombuffer(make_clip(seed, frames), np.uint8).reshape(1, 1, 1, -1)


def test_triton_pipeline_video_image_and_text_give_transformers_ids(built):
    """The Triton models' serving side without a server: preprocessing (prepare_batch: a video as an
    encoded file and as the anchor client's decoded frames, an image, a text-only request) ->
    multimodal_encoders (one VisionEncoderRunner.tables call for the three requests, is_video_input
    per row) -> tensorrt_llm (convert_request) in one executor batch: greedy ids equal transformers'
    generate on the same FP16 pixel values."""
    from serving.multimodal import ImagePrompts, VisionEncoderRunner, prepare_batch
    from serving.requests import convert_request, to_executor_request
    from serving.video_prompts import rows_video
    from tiny_llava import encoded
    from tiny_llava_next import kind_tokenizer

    engine, hf, _ = built
    encoder_dir = vision_encoder_dir(engine)
    prompts = ImagePrompts(encoder_dir, kind_tokenizer(KIND), VOCAB)
    video = prepare_batch(prompts, {"VIDEO_BYTES": clip_item(6)[None]}, [QUERY], True, 4)
    frames = frames_from_bytes(clip_item(6), VideoLimits(), ImageLimits())
    as_frames = prepare_batch(prompts, {"VIDEO_BYTES": frames[None]}, [QUERY], True, 4)  # the anchor client's
    image = prepare_batch(prompts, {"IMAGE_BYTES": np.frombuffer(encoded(make_image(7)), np.uint8)
                                    .reshape(1, 1, 1, 1, -1)}, [QUERY], True, 4)
    text = prepare_batch(prompts, {}, [QUERY], True, 4)
    assert np.array_equal(video["INPUT_ID"], as_frames["INPUT_ID"])
    assert np.array_equal(video["PIXEL_VALUES"], as_frames["PIXEL_VALUES"])
    assert video["PIXEL_VALUES"].shape == (1, FRAMES, 3, 28, 28) and video["PIXEL_VALUES"].dtype == np.float16
    assert video["IS_VIDEO_INPUT"].tolist() == [[True]] and "IS_VIDEO_INPUT" not in image
    ids = video["INPUT_ID"][0].tolist()
    assert sum(t >= VOCAB for t in ids) == 33  # 8 frames x 2 x 2 pooled rows + the newline
    flags = rows_video(video["IS_VIDEO_INPUT"], 1) + rows_video(None, 1) + rows_video(None, 1)
    tables = VisionEncoderRunner(encoder_dir, "cpu").tables(
        [video["PIXEL_VALUES"][0], image["PIXEL_VALUES"][0], None], [None, image["IMAGE_SIZES"][0], None], flags)
    assert tables[2] is None and len(tables[0]) == 33

    specs = []
    for pre, table in zip((video, image, text), tables):
        tensors = {"input_ids": pre["INPUT_ID"], "input_lengths": pre["REQUEST_INPUT_LEN"],
                   "request_output_len": np.array([[6]], np.int32)}
        if table is not None:
            tensors["prompt_embedding_table"] = table[None]
        specs += convert_request(tensors, decoupled=False, exclude_input_default=True)
    with Executor(engine, ExecutorConfig()) as executor:
        request_ids = executor.enqueue_requests([to_executor_request(spec) for spec in specs])
        responses = collect(executor, request_ids)
    got = [final_tokens(responses[request_id]) for request_id in request_ids]

    def generate(pre, placeholder, **pixels):
        prompt = torch.tensor([[t if t < VOCAB else placeholder for t in pre["INPUT_ID"][0].tolist()]])
        return hf.generate(input_ids=prompt, max_new_tokens=6, do_sample=False, **pixels)[0, prompt.shape[1]:].tolist()

    as_float = lambda array: torch.from_numpy(array.astype(np.float32))  # noqa: E731
    assert got == [generate(video, VIDEO_TOKEN_INDEX, pixel_values_videos=as_float(video["PIXEL_VALUES"])),
                   generate(image, IMAGE_TOKEN_INDEX, pixel_values=as_float(image["PIXEL_VALUES"]),
                            image_sizes=torch.from_numpy(image["IMAGE_SIZES"][0])),
                   generate(text, None)]


def test_bad_videos_get_named_errors(built, tmp_path):
    """Too many frames, an undecodable file, a file of more frames than max_decoded_frames, video beside
    images, video to a model without video; an encoded file with more frames than allowed is sampled down
    instead."""
    import json
    import shutil

    from serving.multimodal import ImagePrompts, VisionEncoderRunner, prepare_batch
    from serving.videos import VideoError, video_limits
    from tiny_llava_next import kind_tokenizer

    engine = built[0]
    encoder_dir = vision_encoder_dir(engine)
    prompts = ImagePrompts(encoder_dir, kind_tokenizer(KIND), VOCAB, video_limits=VideoLimits(max_frames=4))
    frames = frames_from_bytes(clip_item(8), VideoLimits(), ImageLimits())
    with pytest.raises(VideoError, match=r"video_bytes_input holds 8 frames; allowed: at most 4 .*max_num_frames"):
        prepare_batch(prompts, {"VIDEO_BYTES": frames[None]}, [QUERY], True, 4)
    sampled = prepare_batch(prompts, {"VIDEO_BYTES": clip_item(8)[None]}, [QUERY], True, 4)
    assert np.array_equal(sampled["PIXEL_VALUES"][0].astype(np.float32),
                          prompts.video.processor(frames[[0, 2, 4, 6]]).astype(np.float16).astype(np.float32))
    garbage = np.frombuffer(b"not a video" * 50, np.uint8).reshape(1, 1, 1, 1, -1)
    with pytest.raises(VideoError, match="video_bytes_input cannot be decoded as a video"):
        prepare_batch(prompts, {"VIDEO_BYTES": garbage}, [QUERY], True, 4)
    bounded = ImagePrompts(encoder_dir, kind_tokenizer(KIND), VOCAB, video_limits=video_limits(4, 7))
    with pytest.raises(VideoError, match=r"^video_bytes_input holds 8 frames; allowed: at most 7 frames in a video "
                                         r"file \(max_decoded_frames"):
        prepare_batch(bounded, {"VIDEO_BYTES": clip_item(8)[None]}, [QUERY], True, 4)
    with pytest.raises(ValueError, match="a request takes one video or images, not both"):
        prepare_batch(prompts, {"VIDEO_BYTES": clip_item(8)[None], "IMAGE_URL": np.array([[b"data:,x"]], object)},
                      [QUERY], True, 4)
    # a LLaVA-NeXT directory (the same weights, without OneVision's video entry)
    other = tmp_path / "vision_encoder"
    shutil.copytree(encoder_dir, other)
    config = json.loads((other / "config.json").read_text())
    config["builder_config"]["model_type"] = "llava_next"
    del config["video"]
    (other / "config.json").write_text(json.dumps(config))
    no_video = ImagePrompts(str(other), kind_tokenizer(KIND), VOCAB)
    with pytest.raises(ValueError, match="video_bytes_input: video is not supported for llava_next models"):
        prepare_batch(no_video, {"VIDEO_BYTES": clip_item(8)[None]}, [QUERY], True, 4)
    with pytest.raises(ValueError, match="video is not supported for llava_next models"):
        VisionEncoderRunner(str(other), "cpu").tables([np.ones((2, 3, 28, 28), np.float32)], None, [True])


def test_openai_video_url_part_gives_the_triton_paths_prompt_and_table(built, tmp_path):
    """The OpenAI frontend's direct path: a chat message with a video_url part (a data: URL of the
    encoded clip, as vLLM takes video) -> the chat template's <video> -> the video's fake ids, and the
    table the Triton path's processing and encoder make of the same file (before its FP16 pixels);
    bad video parts (and a file of more frames than max_decoded_frames) are 400s naming the part."""
    import base64

    from openai_frontend.chat_template import PromptBuilder
    from openai_frontend.errors import APIError
    from openai_frontend.protocol import image_parts, parse_chat_request
    from openai_frontend.vision import ChatImages, VisionSettings
    from serving.multimodal import ImagePrompts, VisionEncoderRunner
    from tiny_llava_next import kind_tokenizer

    engine = built[0]
    url = "data:video/mp4;base64," + base64.b64encode(make_clip(9)).decode()

    def chat(*parts):
        body = {"model": "m", "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": QUERY}]}]}
        return parse_chat_request(body)

    parsed = chat({"type": "video_url", "video_url": {"url": url}})
    parts = image_parts(parsed.messages)
    assert [(p["type"], p["field"]) for p in parts] == [("video", "messages[0].content[0].video_url.url")]
    images = ChatImages(VisionSettings(vision_encoder_dir(engine)), kind_tokenizer(KIND), "cpu")
    builder = PromptBuilder(engine)
    text = builder.render_chat(parsed.messages, image_placeholder=images.placeholder,
                               video_placeholder=images.video_placeholder)
    assert text == "USER: <video>\n" + QUERY + " ASSISTANT:"
    images.check_count(parts)
    table, counts, _ = images._encode(parts)
    ids = images.expand(builder.encode(text), counts, ["video"])
    pixels = ImagePrompts(vision_encoder_dir(engine), kind_tokenizer(KIND), VOCAB).video.from_bytes(clip_item(9))
    expected = VisionEncoderRunner(vision_encoder_dir(engine), "cpu").tables([pixels], None, [True])[0]
    assert counts == [33] and np.array_equal(table, expected)
    assert ids == builder.encode("USER:") + [*range(VOCAB, VOCAB + 33)] + builder.encode(QUERY + " ASSISTANT:")

    def refused(parsed_request, field: str, message: str):
        with pytest.raises(APIError) as error:
            media = image_parts(parsed_request.messages)
            images.check_count(media)
            images._encode(media)
        assert error.value.param == field and message in error.value.message

    video_part = {"type": "video_url", "video_url": {"url": url}}
    refused(chat(video_part, video_part), "messages[0].content[1].video_url.url", "one video per request")
    refused(chat(video_part, {"type": "image_url", "image_url": {"url": "data:,x"}}),
            "messages[0].content[1].image_url.url", "one video or images, not both")
    refused(chat({"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(
        b"not a video" * 50).decode()}}), "messages[0].content[0].video_url.url", "cannot be decoded as a video")
    refused(chat({"type": "video_url", "video_url": {"url": "data:image/png;base64,AAAA"}}),
            "messages[0].content[0].video_url.url", "data URL media type 'image/png' is not supported")
    images.close()
    images = ChatImages(VisionSettings(vision_encoder_dir(engine), max_decoded_frames=7), kind_tokenizer(KIND), "cpu")
    refused(chat(video_part), "messages[0].content[0].video_url.url",
            "holds 8 frames; allowed: at most 7 frames in a video file (max_decoded_frames")
    images.close()


def test_the_anchor_clients_video_tensors(tmp_path):
    """tools/multimodal/client.py --video: --video_num_frames frames decoded and sampled as the anchor's
    client does (video_bytes_input (1, F, H, W, 3)), or the encoded file itself (1, 1, 1, 1, bytes)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "multimodal_client", Path(__file__).resolve().parents[2] / "tools" / "multimodal" / "client.py")
    client = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(client)
    path = tmp_path / "clip.mp4"
    path.write_bytes(make_clip(12))
    sampled = client.video_tensors(str(path), 4)["video_bytes_input"]
    frames = frames_from_bytes(clip_item(12), VideoLimits(), ImageLimits())
    assert sampled.shape == (1, 4, 40, 52, 3) and np.array_equal(sampled[0], frames[[0, 2, 4, 6]])
    assert client.video_tensors(str(path), None)["video_bytes_input"].shape == (1, 1, 1, 1, len(make_clip(12)))
    args = client.parse_args(["--model_type", "llava_onevision", "--video", str(path), "--video_num_frames", "8"])
    assert client.request_tensors(args)["video_bytes_input"].shape == (1, 8, 40, 52, 3)
    args = client.parse_args(["--model_type", "qwen2_vl", "--text", "x", "--video", str(path), "--video_fps", "2"])
    tensors = client.request_tensors(args)  # the file, and the server samples 2 frames per second of video
    assert tensors["video_bytes_input"].shape == (1, 1, 1, 1, len(make_clip(12))) and tensors["video_fps"] == 2.0
    for refused in (["--model_type", "llava", "--video", str(path)],  # no video for llava
                    ["--model_type", "qwen2_vl", "--video", str(path), "--video_fps", "2", "--video_num_frames", "4"]):
        assert client.main(["--text", "x", *refused]) == 2
