"""engine/vision/encode_queue.py staging: sized to the forward (+ 1/4, not the next power of two), capped by
max_staging_bytes, and a forward over the cap still completes (through ordinary host memory)."""
import torch

from engine.vision.encode_queue import ImageEncodeQueue


class _Tower(torch.nn.Module):
    """Each image's rows: its patches times 2 (rows = patches, width = patch_dim)."""

    def image_features(self, patches, grids):
        return list((patches * 2).split([t * h * w for t, h, w in grids]))


def _encode(queue, patches: int, width: int = 8):
    x = torch.arange(patches * width, dtype=torch.float32).reshape(patches, width) % 7
    got = queue.encode(x, [[1, 1, patches]])
    assert torch.equal(got, (x * 2).half())


def test_staging_is_sized_to_the_forward_not_the_next_power_of_two():
    queue = ImageEncodeQueue(_Tower(), "cpu")
    try:
        _encode(queue, 1100)  # 8800 float16 rows' elements: 11000 kept, not 16384
        assert queue._staging[0]["rows"].numel() == 8800 + 8800 // 4
    finally:
        queue.close()


def test_forward_over_the_staging_cap_completes_without_growing_it():
    queue = ImageEncodeQueue(_Tower(), "cpu", max_staging_bytes=4096)  # 2048 float16 elements
    try:
        _encode(queue, 200)  # 1600 elements: staged, 2000 kept
        assert queue._staging[0]["rows"].numel() == 2000
        _encode(queue, 240)  # slot 1: 1920 elements -> min(2400, 2048)
        assert queue._staging[1]["rows"].numel() == 2048
        _encode(queue, 1000)  # 8000 elements, over the cap: through ordinary memory, the kept buffer unchanged
        assert queue._staging[0]["rows"].numel() == 2000
    finally:
        queue.close()


def test_a_forwards_tables_complete_together():
    """Each table is copied out before any future of its forward completes: a caller woken by the first finds the
    others done (vlm_bench's enqueuing thread then sends them in one call; the executor prefills them together).
    Whether the idle worker's first forward took the first item alone or all four, the later three are set in one
    run of the worker's loop, with no copy (a GIL release) between them."""
    import threading

    gate = threading.Event()

    class Gated(_Tower):
        def image_features(self, patches, grids):
            gate.wait(5)
            return super().image_features(patches, grids)

    queue = ImageEncodeQueue(Gated(), "cpu")
    try:
        x = torch.ones(4, 8)
        first = queue.submit(x, [[1, 1, 4]])  # the idle worker's forward, held at the gate
        later = [queue.submit(x * i, [[1, 1, 4]]) for i in range(3)]  # pending meanwhile: the next forward's
        seen = []  # what a caller woken by the first of them sees (the worker sets the rest without letting go of the GIL)
        waiter = threading.Thread(target=lambda: seen.append(later[0].result(5) is not None and [f.done() for f in later]))
        waiter.start()
        gate.set()
        waiter.join(5)
        first.result(5)
        assert [torch.equal(f.result(5), (x * i * 2).half()) for i, f in enumerate(later)] == [True] * 3
        assert seen == [[True, True, True]]
    finally:
        queue.close()
