#!/usr/bin/env python3
"""How often drafts are accepted on real weights: SmolLM2-135M-Instruct.

    python benchmarks/speculative/speculative_acceptance.py [--engine_dir engines/smollm2] [--max_tokens 96]
        [--max_draft_len 4] [--max_matching_ngram_size 3] [--out acceptance.json]
    python benchmarks/speculative/speculative_acceptance.py --draft_engine_dir DIR [--temperature 0.7 --top_k 40]
    python benchmarks/speculative/speculative_acceptance.py --lookahead 4,3,4   # window, n-gram, verification set

Two prompt sets (``PROMPT_SETS``): summarisation (an article, then "summarise it") and code edit
(a function, then "rewrite it with a change"), where the answer copies long spans of the prompt.
Each prompt runs as a chat turn through one executor with ``SpeculativeConfig("ngram")``, or with
``--draft_engine_dir`` ``SpeculativeConfig("draft_model")`` (e.g. an INT4 build of the same
checkpoint), or with ``--lookahead W,N,G`` lookahead decoding (no extra weights); greedy, or with ``--temperature``/``--top_k``/``--top_p`` sampled (seeded per prompt).
The engine is built from the embedded GGUF when ``--engine_dir`` has none (CPU is fine).

Reported per set, from the requests' perf metrics:
- acceptance rate: accepted drafts / drafts verified (``total_accepted_draft_tokens`` /
  ``total_draft_tokens``);
- mean acceptance length: tokens emitted per decode step of the target, accepted drafts plus its
  own token ((generated - 1) / (generated - 1 - accepted): the first token comes from the prompt's
  step, every later step emits its accepted drafts and one token of its own). Plain decoding is 1.0;
  it is the speed-up bound a verify step as cheap as a plain step would give.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: engine, kernels, benchmarks

from benchmarks.common import REPO_ROOT  # noqa: E402

ARTICLES = [
    "The city council met on Tuesday to discuss the new public library. The library will have three floors, "
    "a children's reading room and a small café. Construction starts in March and should finish within two years. "
    "The council said the project costs twelve million dollars, paid by the state and by local taxes.",
    "Researchers at the university found that bees can recognise human faces. In the experiment, bees learned to "
    "link a photo of a face with a sugar reward. Two days later, the bees still chose the right face. The team "
    "says the result helps explain how small brains solve hard visual tasks.",
    "The football club announced that its stadium will get a new roof before next season. The roof covers every "
    "seat and collects rain water for the pitch. Fans will pay the same ticket prices. The club expects the work "
    "to end in August, one week before the first home game.",
    "A storm hit the northern coast on Sunday night. Strong winds cut power to ten thousand homes and closed two "
    "roads near the harbour. Nobody was hurt. The power company said most homes would have electricity again by "
    "Monday evening, and the roads reopened on Monday morning.",
    "The bakery on Main Street won the national bread prize this year. The owner, Maria Lopez, bakes every loaf by "
    "hand with flour from a local mill. She opened the shop ten years ago with one oven. Today the bakery has six "
    "workers and sells four hundred loaves a day.",
]

FUNCTIONS = [
    "def total_price(items):\n    total = 0\n    for item in items:\n        total = total + item.price * item.count\n"
    "    return total\n",
    "def find_user(users, name):\n    for user in users:\n        if user.name == name:\n            return user\n"
    "    return None\n",
    "def average(values):\n    if len(values) == 0:\n        return 0\n    return sum(values) / len(values)\n",
    "def count_words(text):\n    counts = {}\n    for word in text.split():\n        counts[word] = counts.get(word, 0) + 1\n"
    "    return counts\n",
    "def read_lines(path):\n    with open(path) as f:\n        lines = f.readlines()\n    return [line.strip() for line in lines]\n",
]

PROMPT_SETS = {
    "summarisation": [f"Summarise this article in two sentences, reusing its words:\n\n{a}" for a in ARTICLES]
    + [f"Repeat the key facts of this article as a bullet list:\n\n{a}" for a in ARTICLES],
    "code_edit": [f"Rename the function to `compute` and keep everything else the same:\n\n```python\n{f}```" for f in FUNCTIONS]
    + [f"Add a docstring to this function and return the whole function:\n\n```python\n{f}```" for f in FUNCTIONS],
}


def chat_prompt(tokenizer, text: str) -> list[int]:
    return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              return_dict=False))


def measure(executor, tokenizer, prompts: list[str], max_tokens: int, sampling: dict | None = None) -> dict:
    """Run ``prompts`` through ``executor`` (greedy, or sampled with ``sampling``'s SamplingConfig
    fields and seed i for prompt i) -> acceptance figures of the set."""
    from engine.executor.request import OutputConfig, Request, SamplingConfig

    requests = [Request(chat_prompt(tokenizer, text), max_tokens, end_id=tokenizer.eos_token_id,
                        sampling=SamplingConfig(seed=i, **sampling) if sampling else SamplingConfig(),
                        output=OutputConfig(exclude_input_from_output=True, return_perf_metrics=True))
                for i, text in enumerate(prompts)]
    ids = executor.enqueue_requests(requests)
    finals, pending = {}, set(ids)
    while pending:
        for response in executor.await_responses(timeout=1.0):
            if response.request_id in pending and response.is_final:
                assert response.error is None, response.error
                finals[response.request_id] = response.result
                pending.discard(response.request_id)
    generated = sum(len(r.output_token_ids[0]) for r in finals.values())
    drafted = sum(r.perf.total_draft_tokens for r in finals.values())
    accepted = sum(r.perf.total_accepted_draft_tokens for r in finals.values())
    decode_steps = generated - len(finals) - accepted
    return {"prompts": len(prompts), "generated_tokens": generated, "draft_tokens": drafted,
            "accepted_draft_tokens": accepted, "acceptance_rate": accepted / max(1, drafted),
            "mean_acceptance_length": (generated - len(finals)) / max(1, decode_steps)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine_dir", default=str(REPO_ROOT / "engines" / "smollm2"))
    parser.add_argument("--max_tokens", type=int, default=96)
    parser.add_argument("--max_draft_len", type=int, default=4)
    parser.add_argument("--max_matching_ngram_size", type=int, default=3)
    parser.add_argument("--draft_engine_dir", default=None, help="draft with this engine instead of n-grams")
    parser.add_argument("--lookahead", default=None, metavar="W,N,G",
                        help="lookahead decoding: window, n-gram and verification set sizes")
    parser.add_argument("--temperature", type=float, default=None, help="sample (with --top_k/--top_p)")
    parser.add_argument("--top_k", type=int, default=None)
    parser.add_argument("--top_p", type=float, default=None)
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    sampling = {name: getattr(args, name) for name in ("temperature", "top_k", "top_p")
                if getattr(args, name) is not None}

    from transformers import AutoTokenizer

    from engine.executor.executor import Executor, ExecutorConfig, SpeculativeConfig
    from scripts.serve_default import ensure_engine

    ensure_engine(args.engine_dir)
    tokenizer = AutoTokenizer.from_pretrained(args.engine_dir)
    if args.lookahead:
        w, n, g = (int(x) for x in args.lookahead.split(","))
        speculative = SpeculativeConfig("lookahead", lookahead_window_size=w, lookahead_ngram_size=n,
                                        lookahead_verification_set_size=g)
        what = f"lookahead decoding (W {w}, N {n}, G {g}: trees of {speculative.validate().max_draft_len} drafts)"
    elif args.draft_engine_dir:
        speculative = SpeculativeConfig("draft_model", max_draft_len=args.max_draft_len,
                                        draft_engine_dir=args.draft_engine_dir)
        what = f"draft model {args.draft_engine_dir} (max_draft_len {args.max_draft_len})"
    else:
        speculative = SpeculativeConfig("ngram", max_draft_len=args.max_draft_len,
                                        max_matching_ngram_size=args.max_matching_ngram_size)
        what = f"n-gram drafts (max_draft_len {args.max_draft_len}, max_matching_ngram_size {args.max_matching_ngram_size})"
    config = ExecutorConfig(max_batch_size=8, max_tokens_in_paged_kv_cache=16384, speculative=speculative)
    results = {}
    with Executor(args.engine_dir, config) as executor:
        for name, prompts in PROMPT_SETS.items():
            started = time.perf_counter()
            results[name] = measure(executor, tokenizer, prompts, args.max_tokens, sampling)
            results[name]["wall_s"] = round(time.perf_counter() - started, 1)
    how = ", ".join(f"{k} {v}" for k, v in sampling.items()) if sampling else "greedy"
    print(f"{what}, SmolLM2-135M-Instruct {how}, max_tokens {args.max_tokens}")
    print(f"{'set':<14} {'prompts':>7} {'generated':>9} {'drafted':>8} {'accepted':>8} {'rate':>6} {'mean acc. len':>13}")
    for name, r in results.items():
        print(f"{name:<14} {r['prompts']:>7} {r['generated_tokens']:>9} {r['draft_tokens']:>8} "
              f"{r['accepted_draft_tokens']:>8} {r['acceptance_rate']:>6.1%} {r['mean_acceptance_length']:>13.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
