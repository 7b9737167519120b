"""Qwen3-VL as a built family: engine.build on a tiny random Qwen3VLForConditionalGeneration made by
transformers writes a Qwen3 language engine with DeepStack levels and vision_encoder/; the encoder's rows
are transformers' image features with its DeepStack features beside them; greedy ids of requests with
images of two sizes, a video (frame pairs after their timestamps) and a text-only request, batched and
chunked so that steps split the images, equal transformers' generate (interleaved M-RoPE, q/k norms,
DeepStack added after the first layers), for Qwen3-VL and Qwen3-VL-MoE. Video through the Triton pieces and
the OpenAI path (serving/qwen3_video.py) below."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("PIL")

from engine.build import main  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.executor import Executor, ExecutorConfig, OutputConfig, Request  # noqa: E402
from engine.executor.mrope_rotary import Mrope  # noqa: E402
from engine.executor.prompt_table import PromptTable  # noqa: E402
from engine.vision.encoder_dir import load_vision_encoder, read_encoder_config, vision_encoder_dir  # noqa: E402
from engine.vision.mrope import request_mrope  # noqa: E402
from tests.engine.table_graph_check import dense_table_steps_checked, table_twins_replayed  # noqa: E402
from tests.executor.executor_testing import collect, final_tokens  # noqa: E402
from tiny_llava import VOCAB, make_image  # noqa: E402
from tiny_qwen3_vl import IMAGE_TOKEN, VISION_END, VISION_START, hf_model, image_processor, write_checkpoint  # noqa: E402

NEW_TOKENS = 6
SIZES = [(52, 40), (28, 56)]  # grids (1, 6, 8) and (1, 8, 4): 12 and 8 rows


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(engine dir, transformers model)."""
    root = tmp_path_factory.mktemp("qwen3_vl")
    checkpoint = write_checkpoint(root / "checkpoint")
    assert main(["--checkpoint", str(checkpoint), "--output", str(root / "engine"), "--dtype", "float32",
                 "--max_seq_len", "128", "--tokens_per_block", "4"]) == 0
    return str(root / "engine"), hf_model()


def hf_prompt(rows: int, text: list[int]) -> list[int]:
    return [1, 5, VISION_START, *[IMAGE_TOKEN] * rows, VISION_END, *text]


def hf_greedy(hf, prompt: list[int], image=None) -> list[int]:
    ids = torch.tensor([prompt])
    extra = {} if image is None else dict(pixel_values=image["pixel_values"], image_grid_thw=image["image_grid_thw"],
                                           mm_token_type_ids=(ids == IMAGE_TOKEN).int())
    with torch.no_grad():
        return hf.generate(input_ids=ids, max_new_tokens=NEW_TOKENS, do_sample=False, **extra)[0, len(prompt):].tolist()


def test_greedy_ids_with_images_of_two_sizes_and_text_only_equal_transformers_generate(built):
    assert_greedy_ids_equal_transformers(*built)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_greedy_ids_equal_transformers(built):
    assert_greedy_ids_equal_transformers(*built, device="cuda")


def test_moe_greedy_ids_equal_transformers_generate(tmp_path):
    """Qwen3-VL-MoE: a Qwen3-MoE language engine (fused experts read in either file layout, always
    renormalised top-k, a dense layer) with DeepStack, same batch as above."""
    from engine.vision.qwen3_vl import moe_language_tensors

    checkpoint = write_checkpoint(tmp_path / "checkpoint", moe=True)
    assert main(["--checkpoint", str(checkpoint), "--output", str(tmp_path / "engine"), "--dtype", "float32",
                 "--max_seq_len", "128", "--tokens_per_block", "4"]) == 0
    assert_greedy_ids_equal_transformers(str(tmp_path / "engine"), hf_model(moe=True))
    gate_up, down = torch.randn(4, 48, 64), torch.randn(4, 64, 24)  # (E, 2I, hidden), (E, hidden, I)
    names = ("layers.0.mlp.experts.gate_up_proj", "layers.0.mlp.experts.down_proj")
    for layout in ({names[0]: gate_up, names[1]: down},  # transformers' modules
                   {names[0]: gate_up.transpose(1, 2), names[1]: down.transpose(1, 2)}):  # Qwen's released files
        get = moe_language_tensors(layout.__getitem__)
        assert torch.equal(get(names[0]), gate_up) and torch.equal(get(names[1]), down)


def one_image(level):
    """A DeepStack level's rows of the first image: transformers 5.24 lists them per image, 5.17 (the GPU
    machine's) gives one tensor of all images' rows (one image here)."""
    return level[0] if isinstance(level, (list, tuple)) else level


def assert_greedy_ids_equal_transformers(engine: str, hf, device: str | None = None) -> None:
    config = read_encoder_config(vision_encoder_dir(engine))
    assert config["builder_config"]["model_type"] == "qwen3_vl" and config["mrope"]["interleaved"]
    assert EngineConfig.load(engine).model.deepstack_layers == 2
    encoder = load_vision_encoder(vision_encoder_dir(engine))
    images = [image_processor()([make_image(seed, size)], return_tensors="pt") for seed, size in enumerate(SIZES)]
    requests, expected = [], []
    for i, image in enumerate(images):
        grids = image["image_grid_thw"].tolist()
        table = encoder.image_features(image["pixel_values"], grids)[0]
        with torch.no_grad():
            features = hf.model.get_image_features(pixel_values=image["pixel_values"],
                                                   image_grid_thw=image["image_grid_thw"])
        # the table row: [merger output | DeepStack level 0 | level 1]
        torch.testing.assert_close(table, torch.cat([features.pooler_output[0]]
                                                    + [one_image(level) for level in features.deepstack_features], -1),
                                   atol=1e-5, rtol=1e-5)
        prompt = hf_prompt(len(table), [7 + i, 8, 9, 10, 11, 6])
        rows = iter(range(len(table)))
        ids = [VOCAB + next(rows) if t == IMAGE_TOKEN else t for t in prompt]
        rotary, delta = request_mrope(ids, grids, config, vocab_size=VOCAB)
        requests.append(Request(ids, NEW_TOKENS, output=OutputConfig(exclude_input_from_output=True),
                                prompt_table=PromptTable(table), mrope=Mrope(rotary, delta)))
        expected.append(hf_greedy(hf, prompt, image))
    text = [1, 5, 7, 8, 9, 10, 11, 12, 6]
    requests.append(Request(text, NEW_TOKENS, output=OutputConfig(exclude_input_from_output=True)))
    expected.append(hf_greedy(hf, text))
    request, hf_inputs = video_request(engine, encoder, config)  # two frame pairs, each after its timestamp
    requests.append(request)
    expected.append(hf_video_greedy(hf, *hf_inputs))
    # chunks of 5 tokens: every image's rows (and so its DeepStack rows) are split across steps
    with Executor(engine, ExecutorConfig(max_num_tokens=5, enable_chunked_context=True), device=device or "cpu") as executor:
        with dense_table_steps_checked(executor) if device is None else table_twins_replayed(executor) as checked:
            request_ids = executor.enqueue_requests(requests)
            responses = collect(executor, request_ids)
    assert checked  # steps with image / M-RoPE rows: the twin's forward (CPU) or its graph (CUDA)
    assert [final_tokens(responses[i]) for i in request_ids] == expected


def video_request(engine: str, encoder, config: dict) -> tuple[Request, tuple]:
    """An executor request of four 52 x 40 frames (two pairs) laid out as Qwen3-VL's processor lays them out,
    its rows from the tower, and (prompt, patches, grid) for hf_video_greedy."""
    import numpy as np

    from serving.qwen3_video import Qwen3VideoFrames, pair_timestamps, timestamp_text
    from tiny_qwen3_vl import VIDEO_TOKEN, tokenizer

    frames = np.stack([np.asarray(make_image(seed, (52, 40))) for seed in range(4)])
    patches, grid = Qwen3VideoFrames(vision_encoder_dir(engine))(frames)
    table = encoder.image_features(torch.from_numpy(patches), [grid])[0]
    per_pair = grid[1] * grid[2] // 4
    video = "".join(f"{timestamp_text(s)}<|vision_start|>{'<|video_pad|>' * per_pair}<|vision_end|>"
                    for s in pair_timestamps(list(range(4)), 24.0, 2))
    prompt = tokenizer().encode(f"<|im_start|>user\n<|vision_start|>{video}<|vision_end|>What is it?")
    rows = iter(range(len(table)))
    ids = [VOCAB + next(rows) if t == VIDEO_TOKEN else t for t in prompt]
    rotary, delta = request_mrope(ids, [grid], config, vocab_size=VOCAB, second_per_grid=[2 / 24])
    return (Request(ids, NEW_TOKENS, output=OutputConfig(exclude_input_from_output=True),
                    prompt_table=PromptTable(table), mrope=Mrope(rotary, delta)), (prompt, patches, grid))


def test_tower_fused_blocks_equal_the_unfused(built, monkeypatch):
    """The blocks with each residual added in the next LayerNorm's pass (the sum made where DeepStack reads
    it) give the rows of the blocks as before (TRITONLLM_TOWER_UNFUSED=1), DeepStack levels included;
    the context-logits test below compares the fused rows with transformers."""
    from engine.vision.qwen2_vl import UNFUSED_ENV

    engine, _ = built
    images = image_processor()([make_image(i, size) for i, size in enumerate(SIZES)], return_tensors="pt")
    grids = images["image_grid_thw"].tolist()
    encoder = load_vision_encoder(vision_encoder_dir(engine))
    fused = torch.cat(encoder.image_features(images["pixel_values"], grids))
    monkeypatch.setenv(UNFUSED_ENV, "1")
    torch.testing.assert_close(torch.cat(encoder.image_features(images["pixel_values"], grids)), fused,
                               atol=1e-6, rtol=1e-6)


def test_context_logits_equal_transformers_and_deepstack_and_interleaving_matter(built):
    """The image request's context logits equal transformers' forward (atol 1e-4); with its DeepStack
    rows zeroed, or with Qwen2-VL's sectioned M-RoPE, they differ by > 1e-2: both are exercised. A table
    of the hidden size alone is refused by name (the levels are part of the row)."""
    engine, hf = built
    config = read_encoder_config(vision_encoder_dir(engine))
    image = image_processor()([make_image(0, SIZES[0])], return_tensors="pt")
    grids = image["image_grid_thw"].tolist()
    table = load_vision_encoder(vision_encoder_dir(engine)).image_features(image["pixel_values"], grids)[0]
    prompt = hf_prompt(len(table), [7, 8, 9, 10, 11, 6])
    ids = [VOCAB + i - 3 if t == IMAGE_TOKEN else t for i, t in enumerate(prompt)]
    hf_ids = torch.tensor([prompt])
    with torch.no_grad():
        expected = hf(input_ids=hf_ids, pixel_values=image["pixel_values"], image_grid_thw=image["image_grid_thw"],
                      mm_token_type_ids=(hf_ids == IMAGE_TOKEN).int()).logits[0]
    flat = table.clone()
    flat[:, 64:] = 0
    sectioned = {**config, "mrope": {**config["mrope"], "interleaved": False}}
    variants = [(table, config), (flat, config), (table, sectioned)]
    with Executor(engine, ExecutorConfig()) as executor:
        request_ids = executor.enqueue_requests([Request(
            ids, 1, output=OutputConfig(return_context_logits=True),
            prompt_table=PromptTable(rows), mrope=Mrope(*request_mrope(ids, grids, cfg, vocab_size=VOCAB)))
            for rows, cfg in variants] + [Request(ids, 1, prompt_table=PromptTable(table[:, :64]))])
        responses = collect(executor, request_ids)
    logits = [responses[i][-1].result.context_logits.cpu() for i in request_ids[:3]]
    torch.testing.assert_close(logits[0], expected, atol=1e-4, rtol=1e-4)
    assert all((other - expected).abs().max() > 1e-2 for other in logits[1:])
    assert "table width (192: its hidden size, times 1 + its DeepStack levels" in responses[request_ids[3]][-1].error


def test_triton_pieces_and_openai_path_give_transformers_ids(built):
    """Without a server: preprocessing (prepare_batch: Qwen3-VL's chat wrapper, no system turn) ->
    multimodal_encoders (VisionEncoderRunner.qwen_outputs: the wide table in prompt_embedding_table, the
    interleaved M-RoPE pair) -> tensorrt_llm's convert_request -> executor, and the OpenAI frontend's
    direct path (ChatImages -> direct_inputs): greedy ids equal transformers' generate."""
    import base64

    import numpy as np

    from serving.multimodal import ImagePrompts, VisionEncoderRunner, prepare_batch
    from serving.requests import convert_request, to_executor_request
    from tiny_llava import encoded
    from tiny_qwen3_vl import tokenizer

    engine, hf = built
    encoder_dir = vision_encoder_dir(engine)
    width = read_encoder_config(encoder_dir)["mrope"]["head_dim"]
    png = encoded(make_image(0, SIZES[0]))
    pre = prepare_batch(ImagePrompts(encoder_dir, tokenizer(), VOCAB),
                        {"IMAGE_BYTES": np.frombuffer(png, np.uint8).reshape(1, 1, 1, 1, -1)}, ["What is it?"], True, 4)
    ids, raw = pre["INPUT_ID"][0].tolist(), pre["VISION_INPUT_ID"][0].tolist()
    assert ids[:ids.index(VISION_START)] == tokenizer().encode("<|im_start|>user\n")  # no system turn
    outputs = VisionEncoderRunner(encoder_dir, "cpu").qwen_outputs(pre["PIXEL_VALUES"], pre["IMAGE_GRID_THW"],
                                                                    pre["VISION_INPUT_ID"])
    assert outputs["OUT_PROMPT_EMBEDDING_TABLE"].shape == (1, 12, 64 * 3)  # 3 x 4 merged rows, 2 levels beside
    tensors = {"input_ids": pre["INPUT_ID"], "input_lengths": pre["REQUEST_INPUT_LEN"],
               "request_output_len": np.array([[NEW_TOKENS]], np.int32),
               "prompt_embedding_table": outputs["OUT_PROMPT_EMBEDDING_TABLE"],
               "mrope_rotary_cos_sin": outputs["MROPE_ROTARY_COS_SIN"],
               "mrope_position_deltas": outputs["MROPE_POSITION_DELTAS"]}
    [triton] = convert_request(tensors, decoupled=False, exclude_input_default=True, rotary_width=width)

    pytest.importorskip("tritonclient", reason="the OpenAI frontend's direct path needs tritonclient")
    from openai_frontend.protocol import SamplingParams
    from openai_frontend.triton_client import direct_inputs
    from openai_frontend.vision import ChatImages, VisionSettings

    images = ChatImages(VisionSettings(encoder_dir), tokenizer(), "cpu")
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    table, counts, grids = images._encode([{"url": url, "field": "messages[0].content[0]"}])
    prompt = hf_prompt(counts[0], [7, 8, 6])
    chat_ids = images.expand([1, 5, VISION_START, IMAGE_TOKEN, VISION_END, 7, 8, 6], counts)
    [openai] = convert_request(direct_inputs(chat_ids, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0),
                                             NEW_TOKENS, None, 2, 4, None, table, images.mrope(chat_ids, grids)),
                               decoupled=True, rotary_width=width)
    images.close()
    openai.streaming = False
    with Executor(engine, ExecutorConfig()) as executor:
        request_ids = executor.enqueue_requests([to_executor_request(triton), to_executor_request(openai)])
        responses = collect(executor, request_ids)
    image = image_processor()([make_image(0, SIZES[0])], return_tensors="pt")
    fp16 = {**image, "pixel_values": image["pixel_values"].half().float()}  # as PIXEL_VALUES carries them
    assert [final_tokens(responses[i]) for i in request_ids] == [hf_greedy(hf, raw, fp16), hf_greedy(hf, prompt, image)]


# ----------------------------------------------------------------------------- video (serving/qwen3_video.py)

def processor_video_text(grid: list[int], indices: list[int], fps: float) -> str:
    """What transformers' Qwen3VLProcessor.replace_video_token writes for a video of this grid whose frames
    are ``indices`` of a ``fps`` video (run on a stand-in: the processor itself needs torchvision)."""
    from functools import partial
    from types import SimpleNamespace

    from transformers import Qwen3VLProcessor
    from transformers.video_utils import VideoMetadata

    stand_in = SimpleNamespace(video_processor=SimpleNamespace(merge_size=2, temporal_patch_size=2),
                               vision_start_token="<|vision_start|>", vision_end_token="<|vision_end|>",
                               video_token="<|video_pad|>",
                               _calculate_timestamps=partial(Qwen3VLProcessor._calculate_timestamps, None))
    metadata = VideoMetadata(total_num_frames=max(indices) + 1, fps=fps, frames_indices=list(indices))
    return Qwen3VLProcessor.replace_video_token(stand_in, {"video_grid_thw": torch.tensor([grid]),
                                                           "video_metadata": [metadata]}, 0)


def hf_video_greedy(hf, prompt: list[int], patches, grid: list[int]) -> list[int]:
    """transformers' greedy ids for ``prompt`` (video rows as <|video_pad|>) with these patches."""
    from tiny_qwen3_vl import VIDEO_TOKEN

    ids = torch.tensor([prompt])
    with torch.no_grad():
        return hf.generate(input_ids=ids, pixel_values_videos=torch.as_tensor(patches),
                           video_grid_thw=torch.tensor([grid]), mm_token_type_ids=(ids == VIDEO_TOKEN).int() * 2,
                           max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(prompt):].tolist()


def test_video_frames_through_the_triton_pieces_give_transformers_ids(built):
    """video_bytes_input (five 52 x 40 frames as pixels: three frame pairs, the last frame repeated) through
    preprocessing (prepare_batch: Qwen3-VL's resize, each pair after its timestamp at 24 fps as transformers
    assumes for frames without a rate, in the chat turn's <|vision_start|> ... <|vision_end|>) ->
    multimodal_encoders (the tower over the three pairs, each pair an image of grid (1, h, w) in M-RoPE) ->
    tensorrt_llm: the prompt is Qwen3VLProcessor's text tokenized whole, and greedy ids equal transformers'
    generate with the same pixel_values_videos and video_grid_thw."""
    import numpy as np

    from serving.bls import encoder_inputs
    from serving.multimodal import ImagePrompts, VisionEncoderRunner, prepare_batch
    from serving.requests import convert_request, to_executor_request
    from tiny_qwen3_vl import VIDEO_TOKEN, tokenizer

    engine, hf = built
    encoder_dir = vision_encoder_dir(engine)
    frames = np.stack([np.asarray(make_image(seed, (52, 40))) for seed in range(5)])
    pre = prepare_batch(ImagePrompts(encoder_dir, tokenizer(), VOCAB), {"VIDEO_BYTES": frames[None]},
                        ["What is it?"], True, 4)
    grid = pre["IMAGE_GRID_THW"].tolist()[0]
    assert grid == [3, 4, 4] and pre["IS_VIDEO_INPUT"].tolist() == [[True]]  # 5 x 52 x 40 over 32 rows: 28 x 28
    text = ("<|im_start|>user\n<|vision_start|>" + processor_video_text(grid, list(range(5)), 24)
            + "<|vision_end|>What is it?<|im_end|>\n<|im_start|>assistant\n")
    hf_prompt = tokenizer().encode(text)
    assert [VIDEO_TOKEN if t >= VOCAB else t for t in pre["INPUT_ID"][0].tolist()] == hf_prompt
    sent = encoder_inputs({}, pre)  # what the BLS sends multimodal_encoders (the ensemble maps the same names)
    outputs = VisionEncoderRunner(encoder_dir, "cpu").qwen_outputs(
        sent["pixel_values"], sent["image_grid_thw"], sent["vision_input_id"], sent["second_per_grid_ts"])
    assert outputs["OUT_PROMPT_EMBEDDING_TABLE"].shape == (1, 12, 64 * 3)
    tensors = {"input_ids": pre["INPUT_ID"], "input_lengths": pre["REQUEST_INPUT_LEN"],
               "request_output_len": np.array([[NEW_TOKENS]], np.int32),
               "prompt_embedding_table": outputs["OUT_PROMPT_EMBEDDING_TABLE"],
               "mrope_rotary_cos_sin": outputs["MROPE_ROTARY_COS_SIN"],
               "mrope_position_deltas": outputs["MROPE_POSITION_DELTAS"]}
    width = read_encoder_config(encoder_dir)["mrope"]["head_dim"]
    [spec] = convert_request(tensors, decoupled=False, exclude_input_default=True, rotary_width=width)
    with Executor(engine, ExecutorConfig(), device="cpu") as executor:
        [request_id] = executor.enqueue_requests([to_executor_request(spec)])
        served = final_tokens(collect(executor, [request_id])[request_id])
    patches = pre["PIXEL_VALUES"][0, 0, 0].astype(np.float32)  # as PIXEL_VALUES carries them (FP16)
    assert served == hf_video_greedy(hf, hf_prompt, patches, grid)


def test_openai_video_url_gives_transformers_ids_and_takes_the_requests_frame_choice(built):
    """An OpenAI video_url part (an 8-frame MP4 at 8 fps): by default the processor's 2 fps, raised to its
    min_frames 4 (frames 0, 2, 5, 7: pairs at 0.1 and 0.8 seconds); with mm_processor_kwargs' num_frames 6
    three pairs. The template's <|video_pad|> becomes the timestamped pairs, the M-RoPE pair rides beside:
    greedy ids equal transformers' generate with the same patches."""
    import base64

    import numpy as np

    pytest.importorskip("tritonclient", reason="the OpenAI frontend's direct path needs tritonclient")
    pytest.importorskip("av")
    from openai_frontend.protocol import SamplingParams
    from openai_frontend.triton_client import direct_inputs
    from openai_frontend.vision import ChatImages, VisionSettings
    from serving.requests import convert_request, to_executor_request
    from serving.videos import FrameRequest, decode_video, VideoLimits
    from serving.images import ImageLimits
    from tiny_llava_next import make_clip
    from tiny_qwen3_vl import VIDEO_TOKEN, tokenizer

    engine, hf = built
    clip = make_clip(3, 8)
    images = ChatImages(VisionSettings(vision_encoder_dir(engine)), tokenizer(), "cpu")
    part = {"type": "video", "url": "data:video/mp4;base64," + base64.b64encode(clip).decode(),
            "field": "messages[0].content[0]"}
    template = tokenizer().apply_chat_template([{"role": "user", "content": [{"type": "video"},
                                                                             {"type": "text", "text": "What is it?"}]}],
                                               tokenize=False, add_generation_prompt=True)
    specs, expected = [], []
    for request, indices in ((FrameRequest(), [0, 2, 5, 7]), (FrameRequest(num_frames=6), [0, 1, 3, 4, 6, 7])):
        images.check_count([part])
        table, counts, grids = images._encode([part], request)
        grid = grids.grids.tolist()[0]
        assert grid[0] == len(indices) // 2 and counts == [len(table)]
        ids = images.expand(tokenizer().encode(template), counts, ["video"], grids)
        hf_prompt = tokenizer().encode(template.replace("<|video_pad|>", processor_video_text(grid, indices, 8)))
        assert [VIDEO_TOKEN if t >= VOCAB else t for t in ids] == hf_prompt
        [spec] = convert_request(direct_inputs(ids, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0), NEW_TOKENS,
                                               None, 2, 4, None, table, images.mrope(ids, grids)),
                                 decoupled=True, rotary_width=images.prompts.config["mrope"]["head_dim"])
        spec.streaming = False
        specs.append(spec)
        frames = decode_video(clip, "clip", VideoLimits(), ImageLimits(), sampler=lambda total, fps: indices)
        patches, _ = images.prompts.qwen_video.processor(frames)
        expected.append(hf_video_greedy(hf, hf_prompt, patches, grid))
    images.close()
    assert "<0.1" in template.replace("<|video_pad|>", processor_video_text([2, 4, 4], [0, 2, 5, 7], 8))
    with Executor(engine, ExecutorConfig(), device="cpu") as executor:
        request_ids = executor.enqueue_requests([to_executor_request(spec) for spec in specs])
        responses = collect(executor, request_ids)
    assert [final_tokens(responses[i]) for i in request_ids] == expected


def test_video_resize_and_frame_choice_are_transformers(built):
    """Qwen3-VL's video smart_resize (frames counted) equals transformers' at several sizes; too few frames is
    an error naming them. Where torchvision is installed: the patches equal Qwen3VLVideoProcessor's (frames as
    they are), and the frames chosen from a file equal its sample_frames'."""
    import numpy as np

    from serving.qwen3_video import Qwen3VideoFrames, smart_resize
    from serving.videos import FrameRequest, VideoError, VideoLimits
    from tiny_qwen3_vl import VIDEO_PROCESSOR
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as hf_smart_resize

    engine, _ = built
    for frames, size in ((5, (52, 40)), (4, (300, 20)), (2, (7, 9)), (16, (100, 70)), (3, (14, 14))):
        assert smart_resize(frames, *size, 2, 14, 784, 6272) == hf_smart_resize(frames, *size, 2, 14, 784, 6272)
    with pytest.raises(VideoError, match="1 frame"):
        smart_resize(1, 52, 40, 2, 14, 784, 6272)
    processor = Qwen3VideoFrames(vision_encoder_dir(engine))
    choose = processor.sampler(VideoLimits(max_frames=32))
    assert choose(8, 8.0) == [0, 2, 5, 7] and choose(100, 10.0) == np.linspace(0, 99, 20).round().astype(int).tolist()
    assert processor.sampler(VideoLimits(max_frames=6))(100, 10.0) == np.linspace(0, 99, 6).round().astype(int).tolist()
    assert processor.sampler(VideoLimits(), FrameRequest(fps=4.0))(80, 8.0) == np.linspace(0, 79, 32).round().astype(
        int).tolist()  # 10 s at 4 fps = 40, capped at max_num_frames 32
    pytest.importorskip("torchvision")
    from transformers import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    hf_processor = Qwen3VLVideoProcessor(**{k: v for k, v in VIDEO_PROCESSOR.items() if k != "video_processor_type"})
    frames = np.stack([np.asarray(make_image(seed, (52, 40))) for seed in range(5)])
    expected = hf_processor(videos=[frames], do_sample_frames=False, return_tensors="np", cap_pixels_per_frame=False)
    patches, grid = processor(frames)
    assert grid == expected["video_grid_thw"][0].tolist()
    np.testing.assert_allclose(patches, expected["pixel_values_videos"], atol=1e-5)
    for total, fps in ((8, 8.0), (100, 10.0), (9, 30.0)):
        hf_indices = hf_processor.sample_frames(VideoMetadata(total_num_frames=total, fps=fps))
        assert processor.sampler(VideoLimits(max_frames=768))(total, fps) == hf_indices.tolist()


def test_triton_video_fps_and_num_frames_choose_a_files_frames(built):
    """video_fps / video_num_frames (the ensemble's and the BLS's inputs, preprocessing's VIDEO_FPS /
    VIDEO_NUM_FRAMES) with an 8-frame MP4 at 8 fps as video_bytes_input: num_frames 6 -> three frame pairs,
    fps 4 -> 4 frames (two pairs, at 0.1 and 0.8 seconds); both, a bad value, or either with frames sent as
    pixels are errors naming the inputs."""
    import numpy as np

    pytest.importorskip("av")
    from serving.multimodal import ImagePrompts, prepare_batch
    from serving.videos import VideoError
    from tiny_llava_next import make_clip
    from tiny_qwen3_vl import tokenizer

    engine, _ = built
    prompts = ImagePrompts(vision_encoder_dir(engine), tokenizer(), VOCAB)
    clip = np.frombuffer(make_clip(3, 8), np.uint8).reshape(1, 1, 1, 1, -1)
    fps = lambda value: np.array([[value]], np.float32)  # noqa: E731
    count = lambda value: np.array([[value]], np.int32)  # noqa: E731
    for choice, pairs in (({"VIDEO_NUM_FRAMES": count(6)}, 3), ({"VIDEO_FPS": fps(4.0)}, 2)):
        pre = prepare_batch(prompts, {"VIDEO_BYTES": clip, **choice}, ["What is it?"], True, 4)
        assert pre["IMAGE_GRID_THW"][0, 0] == pairs
    text = tokenizer().decode(pre["INPUT_ID"][0][pre["INPUT_ID"][0] < VOCAB])
    assert "<0.1 seconds>" in text and "<0.8 seconds>" in text
    frames = np.stack([np.asarray(make_image(seed, (52, 40))) for seed in range(4)])[None]
    for video, choice, words in (
            (clip, {"VIDEO_FPS": fps(2.0), "VIDEO_NUM_FRAMES": count(4)}, "video_fps and video_num_frames were both"),
            (clip, {"VIDEO_NUM_FRAMES": count(33)}, "video_num_frames is 33; allowed: an integer from 1 to 32"),
            (clip, {"VIDEO_FPS": fps(0.0)}, "video_fps is 0.0; allowed: a number of frames per second above 0"),
            (frames, {"VIDEO_NUM_FRAMES": count(2)}, "this video_bytes_input holds frames as pixels")):
        with pytest.raises(VideoError, match=words):
            prepare_batch(prompts, {"VIDEO_BYTES": video, **choice}, ["x"], True, 4)


def test_a_video_too_long_for_the_engine_is_named_before_the_tower(built):
    """A video whose frame pairs (with their timestamps) leave the prompt no room in the engine's max_seq_len
    (128 here) is preprocessing's error naming video_bytes_input and what to send instead."""
    import numpy as np

    from serving.multimodal import ImagePrompts, prepare_batch
    from serving.videos import VideoError, VideoLimits
    from tiny_qwen3_vl import tokenizer

    engine, _ = built
    prompts = ImagePrompts(vision_encoder_dir(engine), tokenizer(), VOCAB, video_limits=VideoLimits(max_frames=64),
                           max_seq_len=EngineConfig.load(engine).build.max_seq_len)
    frames = np.stack([np.asarray(make_image(seed % 4, (52, 40))) for seed in range(64)])[None]
    with pytest.raises(VideoError, match="video_bytes_input: the video's 64 frames make the prompt 1[0-9]{2} tokens; "
                                         "the engine's max_seq_len is 128"):
        prepare_batch(prompts, {"VIDEO_BYTES": frames}, ["What is it?"], True, 4)
    assert prepare_batch(prompts, {"VIDEO_BYTES": frames[:, :8]}, ["What is it?"], True, 4)["IMAGE_GRID_THW"][0, 0] == 4
