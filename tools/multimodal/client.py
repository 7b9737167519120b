#!/usr/bin/env python3
"""Send one image (or video) + text request to the multimodal repository's `ensemble` (or
`tensorrt_llm_bls`) over gRPC and print the generated text, with the flags of tensorrtllm_backend's
tools/multimodal/client.py:

    python3 tools/multimodal/client.py --model_type llava --text "What is in the image?" \
        --image cat.png [--hf_model_dir CHECKPOINT] [--streaming] [--use_bls] [--request-output-len 16]
    python3 tools/multimodal/client.py --model_type llava_onevision --text "Why is this video funny?" \
        --video clip.mp4 --video_num_frames 8 --end-id 151645
    python3 tools/multimodal/client.py --model_type qwen2_vl --text "What happens?" --video clip.mp4 --video_fps 1

--image is a file, an http(s) or data: URL, or a comma-separated list of them. With --hf_model_dir
the image is processed here by that checkpoint's image processor and sent as image_input (FP16
[1, n, 3, H, W]), as the reference's client does for llava; without it, files go as
image_bytes_input (the encoded file) and URLs as image_url_input, and the server's preprocessing
model processes them (llava_onevision: always so, as the reference's client). --video (llava_onevision,
and qwen2_vl for a Qwen2-VL / Qwen2.5-VL / Qwen3-VL repository): the file is decoded here with PyAV and
--video_num_frames frames sampled uniformly, as the reference's client does, and sent as
video_bytes_input (UINT8 [1, frames, H, W, 3]); without --video_num_frames the encoded file itself goes
([1, 1, 1, num_bytes]) and the server chooses its frames (the model's default, or --video_fps frames per
second of video: the video_fps input, beyond the reference).
Served families: blip2, llava, llava_onevision, mllama, qwen2_vl (tools/assemble_repository.py --kind multimodal).
"""
from __future__ import annotations

import argparse
import os
import queue
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # serving/

MODEL_TYPES = ("blip2", "llava", "vila", "mllama", "llava_onevision", "qwen2_vl")
# qwen2_vl: a Qwen2-VL, Qwen2.5-VL or Qwen3-VL repository (the anchor's one type for them)
SERVED_MODEL_TYPES = ("blip2", "llava", "llava_onevision", "mllama", "qwen2_vl")
# images always go as files: the server's processor tiles them (OneVision) or makes patches and grids (Qwen)
BYTES_ONLY = ("llava_onevision", "qwen2_vl")
VIDEO_MODEL_TYPES = ("llava_onevision", "qwen2_vl")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument("-u", "--url", default="localhost:8001", help="the server's gRPC address")
    p.add_argument("--text", default="Question: which city is this? Answer:")
    p.add_argument("--image", default=None, help="a file, an http(s)/data: URL, or a comma-separated list")
    p.add_argument("--video", default=None, help="a video file (llava_onevision)")
    p.add_argument("--video_num_frames", type=int, default=None,
                   help="frames sampled from --video here (unset: the server samples the file)")
    p.add_argument("--video_fps", type=float, default=None,
                   help="the file's frames per second of video the server samples (video_fps; not with "
                        "--video_num_frames)")
    p.add_argument("--end-id", type=int, default=-1)
    p.add_argument("--pad-id", type=int, default=1)
    p.add_argument("-b", "--beam-width", type=int, default=1)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=None)
    p.add_argument("--request-output-len", type=int, default=16)
    p.add_argument("--top-k", type=int, default=1)
    p.add_argument("--top-p", type=float, default=0.0)
    p.add_argument("--streaming", action="store_true")
    p.add_argument("--use_bls", action="store_true", help="send to tensorrt_llm_bls instead of ensemble")
    p.add_argument("--prompt_table_extra_id", type=int, default=None, help="KV reuse across requests of one image")
    p.add_argument("--hf_model_dir", default=None, help="process the image here with this checkpoint's processor")
    p.add_argument("--model_type", required=True, choices=MODEL_TYPES)
    return p.parse_args(argv)


def image_tensors(images: list[str], hf_model_dir: str | None) -> dict[str, np.ndarray]:
    """The request's image input: image_input (processed here), or image_bytes_input / image_url_input."""
    if hf_model_dir:
        from PIL import Image
        from transformers import AutoImageProcessor

        from serving.images import ImageLimits, decode_file, url_bytes

        def load(source: str):
            if "://" in source or source.startswith("data:"):
                return decode_file(url_bytes(source, "--image", ImageLimits(allowed_url_hosts=())), "--image",
                                   ImageLimits())
            return Image.open(source).convert("RGB")

        pixels = AutoImageProcessor.from_pretrained(hf_model_dir)([load(s) for s in images],
                                                                 return_tensors="np")["pixel_values"]
        return {"image_input": pixels.astype(np.float16)[None]}
    urls = [s for s in images if "://" in s or s.startswith("data:")]
    files = [s for s in images if s not in urls]
    if urls and files:
        raise SystemExit("--image: send files or URLs, not both (or pass --hf_model_dir)")
    if urls:
        return {"image_url_input": np.array([[u.encode() for u in urls]], dtype=object)}
    blobs = [open(path, "rb").read() for path in files]
    width = max(len(b) for b in blobs)  # one run of bytes per image, zero-padded to the longest
    data = np.zeros((1, len(blobs), 1, 1, width), np.uint8)
    for i, blob in enumerate(blobs):
        data[0, i, 0, 0, :len(blob)] = np.frombuffer(blob, np.uint8)
    return {"image_bytes_input": data}


def video_tensors(path: str, num_frames: int | None, fps: float | None = None) -> dict[str, np.ndarray]:
    """video_bytes_input: ``num_frames`` frames decoded and sampled here, (1, F, H, W, 3), or the file (with
    ``fps``: video_fps, the server samples that many frames per second of video)."""
    data = open(path, "rb").read()
    if num_frames is None:
        tensors = {"video_bytes_input": np.frombuffer(data, np.uint8).reshape(1, 1, 1, 1, -1)}
        return tensors if fps is None else {**tensors, "video_fps": np.array([[fps]], np.float32)}
    from serving.images import ImageLimits
    from serving.videos import VideoLimits, decode_video

    # decoded here, on the client's own machine: the server's bound on decoding work (max_decoded_frames) is not its
    limits = VideoLimits(max_frames=num_frames, max_bytes=len(data), max_decoded_frames=sys.maxsize)
    frames = decode_video(data, "--video", limits, ImageLimits())
    return {"video_bytes_input": frames[None]}


def split_images(value: str) -> list[str]:
    """--image's comma-separated sources; a data: URL keeps the one comma before its payload
    ("data:image/png;base64,iVBO..."), so it is not cut there."""
    images: list[str] = []
    for piece in value.split(","):
        if images and images[-1].startswith("data:") and "," not in images[-1]:
            images[-1] += "," + piece.strip()
        elif piece.strip():
            images.append(piece.strip())
    return images


def request_tensors(args: argparse.Namespace) -> dict[str, np.ndarray]:
    scalar = lambda value, dtype: np.array([[value]], dtype)  # noqa: E731
    tensors = {"text_input": np.array([[args.text.encode()]], dtype=object),
               "max_tokens": scalar(args.request_output_len, np.int32), "beam_width": scalar(args.beam_width, np.int32),
               "temperature": scalar(args.temperature, np.float32), "end_id": scalar(args.end_id, np.int32),
               "pad_id": scalar(args.pad_id, np.int32), "top_k": scalar(args.top_k, np.int32),
               "top_p": scalar(args.top_p, np.float32), "stream": scalar(args.streaming, np.bool_),
               "repetition_penalty": scalar(args.repetition_penalty, np.float32)}
    if args.presence_penalty is not None:
        tensors["presence_penalty"] = scalar(args.presence_penalty, np.float32)
    if args.prompt_table_extra_id is not None:
        tensors["prompt_table_extra_id"] = scalar(args.prompt_table_extra_id, np.uint64)
    images = split_images(args.image) if args.image else []
    if args.model_type == "mllama":  # the anchor's: decoded pixels as image_bytes_input, <|image|> before the text
        tensors["text_input"] = np.array([[("<|image|>" * len(images) + args.text).encode()]], dtype=object)
        if images:
            tensors["image_bytes_input"] = mllama_pixels(images)
    elif args.video:
        tensors.update(video_tensors(args.video, args.video_num_frames, args.video_fps))
    elif images:
        tensors.update(image_tensors(images, None if args.model_type in BYTES_ONLY else args.hf_model_dir))
    return tensors


def mllama_pixels(images: list[str]) -> np.ndarray:
    """--model_type mllama: each image file decoded, (1, n, H, W, 3) uint8 (images of one size)."""
    from PIL import Image

    if any("://" in s or s.startswith("data:") for s in images):
        raise SystemExit("--image: --model_type mllama sends image files (decoded pixels), as the anchor's client")
    arrays = [np.asarray(Image.open(path).convert("RGB")) for path in images]
    if len({a.shape for a in arrays}) > 1:
        raise SystemExit("--image: --model_type mllama sends the images as one array; give images of one size")
    return np.stack(arrays)[None]


def generate(url: str, model: str, tensors: dict[str, np.ndarray], verbose: bool = False) -> str:
    """The text of one request over a gRPC stream (decoupled models answer only there)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url, verbose=verbose)
    inputs = []
    for name, array in tensors.items():
        tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        client.async_stream_infer(model, inputs, outputs=[grpcclient.InferRequestedOutput("text_output")],
                                  enable_empty_final_response=True)
        text = []
        while True:
            result, error = responses.get(timeout=600)
            if error is not None:
                raise SystemExit(f"error: {error}")
            output = result.as_numpy("text_output")
            if output is not None and output.size:
                text.append(output.reshape(-1)[0].decode())
            final = result.get_response().parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                return "".join(text)
    finally:
        client.stop_stream()
        client.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.model_type not in SERVED_MODEL_TYPES:
        print(f"error: --model_type {args.model_type} is not served yet; served: {', '.join(SERVED_MODEL_TYPES)}",
              file=sys.stderr)
        return 2
    if args.video and args.model_type not in VIDEO_MODEL_TYPES:
        print(f"error: --video: {args.model_type} models take no video; video is served for "
              f"{', '.join(VIDEO_MODEL_TYPES)}", file=sys.stderr)
        return 2
    if args.video_fps is not None and args.video_num_frames is not None:
        print("error: --video_fps and --video_num_frames: give one (--video_num_frames samples here, --video_fps "
              "has the server sample the file)", file=sys.stderr)
        return 2
    text = generate(args.url, "tensorrt_llm_bls" if args.use_bls else "ensemble", request_tensors(args), args.verbose)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
