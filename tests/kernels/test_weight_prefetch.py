"""$TRITONLLM_WEIGHT_PREFETCH's rule (kernels/_triton.py weight_prefetch): the normed decode router's rows read
before its PDL wait by default ("router"), not with "0" or ""; only with PDL; no other kind. (The router launch
itself, both ways: tests/kernels/test_moe_router.py.)"""
from __future__ import annotations

import pytest


def test_weight_prefetch_is_the_router_by_default_and_needs_pdl(monkeypatch):
    from kernels._triton import WEIGHT_PREFETCH_ENV, weight_prefetch

    monkeypatch.delenv(WEIGHT_PREFETCH_ENV, raising=False)
    assert weight_prefetch("router", True) and not weight_prefetch("router", False)
    for off in ("0", ""):
        monkeypatch.setenv(WEIGHT_PREFETCH_ENV, off)
        assert not weight_prefetch("router", True)
    monkeypatch.setenv(WEIGHT_PREFETCH_ENV, "router")
    assert weight_prefetch("router", True)
    with pytest.raises(AssertionError):
        weight_prefetch("skinny", True)  # (the L2 prefetch kinds were removed)
