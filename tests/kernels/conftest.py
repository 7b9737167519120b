"""The ``device`` fixture of the kernel tests: where the Triton kernels run (see kernel_testing)."""
from __future__ import annotations

import pytest
from kernel_testing import triton_device


@pytest.fixture
def device() -> str:
    found = triton_device()
    if found is None:
        pytest.skip("needs a CUDA device (or TRITON_INTERPRET=1 with triton installed)")
    return found
