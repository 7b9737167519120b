"""Speculative decoding: drafts proposed, verified by the target in one forward, accepted or rolled back.

Sources of drafts: the request itself (``Request.external_draft``, TensorRT-LLM's external draft
tokens, verified at the request's first generation step) and a per-step ``DraftProposer``
(``ExecutorConfig.speculative``; ``ngram.py``: prompt lookup). The executor packs a drafted
sequence's chunk as its known tokens plus k drafts, asks for logits at the last known token and at
each draft, and hands them to ``verify.verify_batch``; ``acceptance.py`` holds the rules. It
then keeps the accepted drafts plus one token of the target's own, and rolls back the KV of the
rest: ``num_computed_tokens`` stops after the last accepted draft, the blocks that held only
rejected positions go back to the pool, and a block is registered for prefix reuse only once all
its tokens are accepted ones (the executor registers after the rollback).
"""
from engine.executor.speculative.proposers import make_proposer  # noqa: F401
from engine.executor.speculative.proposer import DraftProposer, draft_room  # noqa: F401
from engine.executor.speculative.verify import Verified, verify_batch, verify_drafts  # noqa: F401
