"""Triton `preprocessing` model: text -> token ids, word lists and ids for `tensorrt_llm`; with
`multimodal_model_path` (a vision-language engine's vision_encoder/), images -> image slots in the
prompt and PIXEL_VALUES.

Glue only; the rules live in serving/text.py, serving/tokenization.py and serving/multimodal.py.
"""
import json
import os
import sys

import numpy as np
import triton_python_backend_utils as pb_utils

if os.environ.get("TRITONLLM_ROOT"):  # a source checkout not installed into the environment
    sys.path.insert(0, os.environ["TRITONLLM_ROOT"])
from serving.params import get_parameter, model_parameters  # noqa: E402
from serving.text import (embedding_bias_tensor, encode_queries, per_item_ids,  # noqa: E402
                          string_rows, word_list_tensor)
from serving.stub_watchdog import start_server_watchdog, stop_crash_dumps  # noqa: E402
from serving.tokenization import first_token_id, load_text_tokenizer, load_tokenizer  # noqa: E402
from serving.multimodal import (ImagePrompts, engine_max_seq_len, engine_vocab_size, image_limits,  # noqa: E402
                                prepare_batch, refuse_images_on_text_model)
from serving.videos import video_limits  # noqa: E402
from serving.torchless_preprocessing import transformers_without_torch  # noqa: E402

TEXT_OUTPUTS = ("INPUT_ID", "REQUEST_INPUT_LEN", "DECODER_INPUT_ID", "REQUEST_DECODER_INPUT_LEN",
                "BAD_WORDS_IDS", "STOP_WORDS_IDS", "EMBEDDING_BIAS", "REQUEST_OUTPUT_LEN",
                "OUT_END_ID", "OUT_PAD_ID", "OUT_PROMPT_TABLE_EXTRA_IDS", "PIXEL_VALUES", "IMAGE_SIZES",
                "IMAGE_GRID_THW", "VISION_INPUT_ID", "ASPECT_RATIO_IDS", "ASPECT_RATIO_MASK", "CROSS_ATTENTION_MASK",
                "IS_VIDEO_INPUT", "VIDEO_SECOND_PER_GRID")
IMAGE_INPUTS = ("IMAGE", "IMAGE_BYTES", "IMAGE_URL", "VIDEO_BYTES", "VIDEO_FPS", "VIDEO_NUM_FRAMES", "IMAGE_SIZES")


def _input(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


class TritonPythonModel:
    images = None  # ImagePrompts of a vision-language model (initialize sets it)

    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = model_parameters(config)
        tokenizer_dir = get_parameter(params, "tokenizer_dir", str)
        if tokenizer_dir is None:
            raise ValueError("preprocessing: the tokenizer_dir parameter must be set")
        self.add_special_tokens = get_parameter(params, "add_special_tokens", bool)
        if self.add_special_tokens is None:
            pb_utils.Logger.log_warn("preprocessing: add_special_tokens is not set; using True")
            self.add_special_tokens = True
        encoder_dir = get_parameter(params, "multimodal_model_path", str)
        with transformers_without_torch(encoder_dir):  # serving/torchless_preprocessing.py says why
            self._load(params, tokenizer_dir, encoder_dir)
        # (Qwen's video imports torch at its first video: its stubs start without torch for images)
        if self.images is not None and self.images.video is not None:
            import torch  # noqa: F401  (serving/videos.py resizes frames with it: at start, not at the first video)
        self.output_dtypes = {
            name: pb_utils.triton_string_to_numpy(pb_utils.get_output_config_by_name(config, name)["data_type"])
            for name in TEXT_OUTPUTS}
        start_server_watchdog()  # a stub busy in the backend's IPC when the server dies is not told

    def _load(self, params, tokenizer_dir, encoder_dir):
        """The tokenizer, and a vision-language model's ImagePrompts."""
        # A text model only encodes (load_text_tokenizer: no transformers import where that gives the
        # same ids); a vision-language model's image prompts use the whole tokenizer.
        self.tokenizer = (load_tokenizer if encoder_dir else load_text_tokenizer)(tokenizer_dir)
        self.end_id = first_token_id(self.tokenizer, self.tokenizer.eos_token)
        self.pad_id = first_token_id(self.tokenizer, self.tokenizer.pad_token)
        self.vocab_size = self.tokenizer.vocab_size
        if encoder_dir:
            engine_dir = get_parameter(params, "gpt_model_path", str) or os.path.dirname(encoder_dir.rstrip("/"))
            self.vocab_size = engine_vocab_size(engine_dir)  # fake ids start at the engine's vocab_size
            limits = image_limits(get_parameter(params, "max_image_pixels", int),
                                  get_parameter(params, "allowed_image_url_hosts", str))
            self.images = ImagePrompts(encoder_dir, self.tokenizer, self.vocab_size, limits=limits,
                                       max_num_images=get_parameter(params, "max_num_images", int),
                                       video_limits=video_limits(get_parameter(params, "max_num_frames", int),
                                                                 get_parameter(params, "max_decoded_frames", int)),
                                       max_seq_len=engine_max_seq_len(engine_dir))

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                outputs = self._preprocess(request)
                tensors = [pb_utils.Tensor(name, value.astype(self.output_dtypes[name]))
                           for name, value in outputs.items()]
                responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
            except Exception as error:  # every failure is this request's error, never the model's
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(error))))
        return responses

    def _preprocess(self, request):
        query = _input(request, "QUERY")
        batch_size = query.shape[0]
        images = {name: _input(request, name) for name in IMAGE_INPUTS}
        if self.images is None:
            refuse_images_on_text_model(images)
            input_ids, lengths = encode_queries(self.tokenizer, query, self.add_special_tokens, self.pad_id)
            multimodal = {}
        else:
            multimodal = prepare_batch(self.images, images, [row[0] for row in string_rows(query)],
                                       self.add_special_tokens, self.pad_id)
            input_ids, lengths = multimodal.pop("INPUT_ID"), multimodal.pop("REQUEST_INPUT_LEN")
        decoder_query = _input(request, "DECODER_QUERY")
        if decoder_query is not None:
            decoder_ids, decoder_lengths = encode_queries(self.tokenizer, decoder_query,
                                                          self.add_special_tokens, self.pad_id)
        else:
            decoder_ids = np.full((batch_size, 1), self.pad_id, dtype=np.int32)
            decoder_lengths = np.ones((batch_size, 1), dtype=np.int32)
        outputs = {
            "INPUT_ID": input_ids, "REQUEST_INPUT_LEN": lengths,
            "DECODER_INPUT_ID": decoder_ids, "REQUEST_DECODER_INPUT_LEN": decoder_lengths,
            "BAD_WORDS_IDS": word_list_tensor(self.tokenizer, _input(request, "BAD_WORDS_DICT"), batch_size),
            "STOP_WORDS_IDS": word_list_tensor(self.tokenizer, _input(request, "STOP_WORDS_DICT"), batch_size),
            "EMBEDDING_BIAS": embedding_bias_tensor(self.tokenizer, _input(request, "EMBEDDING_BIAS_WORDS"),
                                                    _input(request, "EMBEDDING_BIAS_WEIGHTS"), batch_size),
            "REQUEST_OUTPUT_LEN": _input(request, "REQUEST_OUTPUT_LEN"),
            "OUT_END_ID": per_item_ids(_input(request, "END_ID"), self.end_id, batch_size),
            "OUT_PAD_ID": per_item_ids(_input(request, "PAD_ID"), self.pad_id, batch_size),
            **multimodal,
        }
        extra_id = _input(request, "PROMPT_TABLE_EXTRA_ID")
        if extra_id is not None:
            extra_id = np.asarray(extra_id).reshape(batch_size, 1)
            outputs["OUT_PROMPT_TABLE_EXTRA_IDS"] = np.where(input_ids >= self.vocab_size, extra_id, 0)
        return outputs

    def finalize(self):
        stop_crash_dumps()
