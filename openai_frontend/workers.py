"""Serving the app, in this process or in a spawned worker (``--workers``; in a module of its
own so a spawned process can import its target: ``__main__`` of ``python -m`` is not importable).
"""
from __future__ import annotations

import os
import threading
import time

PARENT_CHECK_PERIOD_S = 1.0


def serve(config, host: str, port: int, reuse_port: bool) -> None:
    """One worker: the app on host:port until SIGINT/SIGTERM."""
    from aiohttp import web

    from openai_frontend.app import FRONTEND, create_app

    app = create_app(config)
    images = app[FRONTEND].images
    if images is not None:  # a vision tower in this process (its encode queue's launches stop during a full GC pass)
        from engine.executor.gc_freeze import freeze_after_load

        freeze_after_load(images.runner.device)  # (on CUDA: what the start made is never scanned again)
    # handler_cancellation: a client that hangs up cancels its handler, which cancels the Triton call.
    web.run_app(app, host=host, port=port, handler_cancellation=True, access_log=None,
                print=None, reuse_port=reuse_port or None)


def worker(config, host: str, port: int, parent: int) -> None:
    """A spawned worker (--workers > 1): serves until the first process ends, however it ends."""
    def watch_parent():
        while os.getppid() == parent:
            time.sleep(PARENT_CHECK_PERIOD_S)
        os._exit(0)

    threading.Thread(target=watch_parent, daemon=True).start()
    serve(config, host, port, reuse_port=True)
