"""kernels/draft_topk.py: a draft head's k best ids mapped through d2t, against torch.topk + the gather
(the reference, what EAGLE-3's drafting ran before). Triton runs on CUDA or under TRITON_INTERPRET=1."""
from __future__ import annotations

import pytest
import torch

from kernels.draft_topk import draft_top_ids, draft_top_ids_ref, draft_top_ids_triton


def _case(shape, vocab, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(*shape, vocab, generator=g).to(device)
    d2t = torch.randint(0, 1000, (vocab,), generator=g).to(device)
    return logits, d2t


def test_reference_is_topk_then_d2t():
    logits, d2t = _case((3,), 50, "cpu")
    ids = logits.topk(4, dim=-1).indices
    assert torch.equal(draft_top_ids(logits, d2t, 4), ids + d2t[ids])  # the CPU entry runs the reference
    assert torch.equal(draft_top_ids(logits, None, 4), ids)


@pytest.mark.parametrize("shape,vocab,k", [((1,), 32000, 4), ((2, 3), 1000, 3), ((5,), 97, 1), ((4,), 64, 8)])
def test_kernel_equals_reference(device, shape, vocab, k):
    logits, d2t = _case(shape, vocab, device, seed=vocab)
    assert torch.equal(draft_top_ids_triton(logits, d2t, k).cpu(), draft_top_ids_ref(logits, d2t, k).cpu())
    assert torch.equal(draft_top_ids_triton(logits, None, k).cpu(), draft_top_ids_ref(logits, None, k).cpu())


def test_kernel_takes_the_first_of_ties_and_blanks_only_the_one_found(device):
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, 2.0, -float("inf")]], device=device)
    assert draft_top_ids_triton(logits, None, 4).cpu().tolist() == [[1, 3, 4, 2]]


def test_out_is_written_in_place_or_copied_into(device, monkeypatch):
    """``out``: a contiguous one the kernel writes (a recorded graph's buffer), a strided view gets a copy."""
    import kernels.draft_topk

    monkeypatch.setattr(kernels.draft_topk, "use_triton", lambda t: True)
    logits, d2t = _case((2, 3), 300, device, seed=3)
    want = draft_top_ids_ref(logits, d2t, 4)
    ranked = torch.zeros(2, 5, 4, dtype=torch.int64, device=device)
    assert draft_top_ids(logits, d2t, 4, out=ranked[:, 1:4]) is not None  # (2, 3, 4) of (2, 5, 4): strided
    whole = torch.zeros(2, 3, 4, dtype=torch.int64, device=device)
    assert draft_top_ids(logits, d2t, 4, out=whole).data_ptr() == whole.data_ptr()
    assert torch.equal(ranked[:, 1:4].cpu(), want.cpu()) and torch.equal(whole.cpu(), want.cpu())
    assert ranked[:, 0].abs().sum() == 0 and ranked[:, 4].abs().sum() == 0
