"""Peak host memory (RSS) of ``python -m engine.build --checkpoint DIR``: how much of the checkpoint the build holds.

Writes a random Llama checkpoint (bf16, one safetensors shard per decoder layer, written a layer at a time, so
making it holds one layer), then builds it once per scheme in a child process and reports the child's peak RSS
(``os.wait4``'s ru_maxrss), the checkpoint's and the engine's bytes and the wall time. ``--repo`` builds with another
checkout (e.g. an older commit's ``git worktree``), for before/after figures. CPU only; no GPU needed.

    python benchmarks/engine/build_peak_rss.py --layers 24 --schemes none,fp8,int4_wo --work /tmp/build_rss
    python benchmarks/engine/build_peak_rss.py --repo /path/to/old/checkout --work /tmp/build_rss --keep
    python benchmarks/engine/build_peak_rss.py --shape llama4_scout --layers 3 --schemes none,fp8_block --work /tmp/s
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: engine, kernels, benchmarks

from benchmarks.common import git_commit, name_list, utc_now  # noqa: E402

GIB = 1024 ** 3


def write_random_llama(path: Path, *, layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int,
                       vocab: int) -> None:
    """A Llama checkpoint of random bf16 weights at ``path``, a shard per layer."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                                      num_hidden_layers=layers, num_attention_heads=heads,
                                      num_key_value_heads=kv_heads, max_position_embeddings=4096,
                                      tie_word_embeddings=False, architectures=["LlamaForCausalLM"],
                                      torch_dtype="bfloat16")
    head_dim = hidden // heads

    def layer(randn, p: str) -> dict:
        return {p + "self_attn.q_proj.weight": randn(heads * head_dim, hidden),
                p + "self_attn.k_proj.weight": randn(kv_heads * head_dim, hidden),
                p + "self_attn.v_proj.weight": randn(kv_heads * head_dim, hidden),
                p + "self_attn.o_proj.weight": randn(hidden, heads * head_dim),
                p + "mlp.gate_proj.weight": randn(intermediate, hidden),
                p + "mlp.up_proj.weight": randn(intermediate, hidden),
                p + "mlp.down_proj.weight": randn(hidden, intermediate)}

    _write_layer_shards(path, config, layer)


def write_random_scout(path: Path, *, layers: int) -> None:
    """Llama-4-Scout's text model cut to ``layers`` layers (transformers' Llama4TextConfig defaults are Scout's:
    hidden 5120, 16 experts of width 8192 in every layer, a shared expert, vocab 202048), random bf16, a shard per
    layer, its experts stacked as the Hub's checkpoint holds them: gate_up_proj (E, hidden, 2I), down_proj (E, I,
    hidden). About 4.4 GB a layer plus 4.1 GB of embedding and lm_head."""
    import transformers

    config = transformers.Llama4TextConfig(num_hidden_layers=layers, architectures=["Llama4ForCausalLM"],
                                           torch_dtype="bfloat16")
    hidden, width, experts = config.hidden_size, config.intermediate_size, config.num_local_experts
    q_rows, kv_rows = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim

    def layer(randn, p: str) -> dict:
        ff = p + "feed_forward."
        return {p + "self_attn.q_proj.weight": randn(q_rows, hidden),
                p + "self_attn.k_proj.weight": randn(kv_rows, hidden),
                p + "self_attn.v_proj.weight": randn(kv_rows, hidden),
                p + "self_attn.o_proj.weight": randn(hidden, q_rows),
                ff + "router.weight": randn(experts, hidden),
                ff + "experts.gate_up_proj": randn(experts, hidden, 2 * width),
                ff + "experts.down_proj": randn(experts, width, hidden),
                ff + "shared_expert.gate_proj.weight": randn(width, hidden),
                ff + "shared_expert.up_proj.weight": randn(width, hidden),
                ff + "shared_expert.down_proj.weight": randn(hidden, width)}

    _write_layer_shards(path, config, layer)


def _write_layer_shards(path: Path, config, layer) -> None:
    """config.json, then the embedding, final norm and lm_head in one shard and ``layer(randn, prefix)``'s tensors
    (with the two norms every decoder layer has) in a shard per layer: writing it holds one layer."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    config.to_json_file(path / "config.json")
    generator = torch.Generator().manual_seed(0)
    hidden = config.hidden_size

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.bfloat16) * 0.02

    save_file({"model.embed_tokens.weight": randn(config.vocab_size, hidden), "model.norm.weight": randn(hidden) + 1,
               "lm_head.weight": randn(config.vocab_size, hidden)}, path / "model-outer.safetensors",
              metadata={"format": "pt"})
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        tensors = {p + "input_layernorm.weight": randn(hidden) + 1, p + "post_attention_layernorm.weight": randn(hidden) + 1}
        tensors.update(layer(randn, p))
        save_file(tensors, path / f"model-{i:05d}.safetensors", metadata={"format": "pt"})


def build_peak_rss(repo: Path, checkpoint: Path, output: Path, scheme: str, extra: list[str]) -> dict:
    """Build ``checkpoint`` with ``repo``'s engine.build in a child; its peak RSS, wall time and engine bytes."""
    command = [sys.executable, "-m", "engine.build", "--checkpoint", str(checkpoint), "--output", str(output),
               "--dtype", "bfloat16", "--max_seq_len", "1024", *extra]
    if scheme != "none":
        command += ["--quantization", scheme]
    start = time.perf_counter()
    env = dict(os.environ, PYTHONPATH=str(repo))  # repo's engine, not an installed one
    child = subprocess.Popen(command, cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(child.pid, 0)
    stderr = child.stderr.read().decode()
    if status != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({status}):\n{stderr[-2000:]}")
    return {"scheme": scheme, "extra": " ".join(extra), "peak_rss_gib": round(usage.ru_maxrss * 1024 / GIB, 2),
            "wall_s": round(time.perf_counter() - start, 1),
            "engine_gib": round(sum(f.stat().st_size for f in output.glob("rank*.safetensors")) / GIB, 2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", required=True, help="folder for the checkpoint and the engines")
    p.add_argument("--repo", default=str(Path(__file__).resolve().parents[2]), help="checkout whose engine.build runs")
    p.add_argument("--shape", choices=["llama", "llama4_scout"], default="llama",
                   help="llama: the sizes below; llama4_scout: Scout's layers (about 4.4 GB each), --layers of them")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv_heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--schemes", type=name_list, default=["none", "fp8", "int4_wo"],
                   help="comma-separated --quantization values; none: plain --dtype bfloat16")
    p.add_argument("--extra", default="", help="more engine.build flags for every build, e.g. '--tp_size 2'")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint (reused by a later run) and engines")
    args = p.parse_args(argv)
    work = Path(args.work)
    if args.shape == "llama4_scout":
        checkpoint = work / f"scout_random_{args.layers}"
        if not (checkpoint / "config.json").exists():
            write_random_scout(checkpoint, layers=args.layers)
    else:
        checkpoint = work / f"llama_random_{args.layers}x{args.hidden}"
        if not (checkpoint / "config.json").exists():
            write_random_llama(checkpoint, layers=args.layers, hidden=args.hidden, intermediate=args.intermediate,
                               heads=args.heads, kv_heads=args.kv_heads, vocab=args.vocab)
    checkpoint_gib = sum(f.stat().st_size for f in checkpoint.glob("*.safetensors")) / GIB
    repo = Path(args.repo).resolve()
    print(f"# {utc_now()} repo {repo} at {git_commit() if repo == Path(__file__).resolve().parents[2] else '?'}; "
          f"checkpoint {checkpoint.name} {checkpoint_gib:.2f} GiB ({args.layers} layers)")
    for scheme in args.schemes:
        output = work / f"engine_{scheme}"
        row = build_peak_rss(repo, checkpoint, output, scheme, args.extra.split())
        row["checkpoint_gib"] = round(checkpoint_gib, 2)
        print(json.dumps(row), flush=True)
        if not args.keep:
            shutil.rmtree(output)
    if not args.keep:
        shutil.rmtree(checkpoint)
    return 0


if __name__ == "__main__":
    sys.exit(main())
