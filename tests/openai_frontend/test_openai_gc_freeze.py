"""openai_frontend/workers.py serve: a frontend that hosts a vision tower freezes what its start made
(engine/executor/gc_freeze.py, a no-op off CUDA) before it serves; a text-only one leaves the collector alone."""
import types

import aiohttp.web
import pytest

import openai_frontend.app
from engine.executor import gc_freeze
from openai_frontend import workers


@pytest.mark.parametrize("images", [None, types.SimpleNamespace(runner=types.SimpleNamespace(device="cuda:0"))])
def test_serve_freezes_after_building_the_app_when_it_has_a_tower(monkeypatch, images):
    app = {openai_frontend.app.FRONTEND: types.SimpleNamespace(images=images)}
    calls = []
    monkeypatch.setattr(openai_frontend.app, "create_app", lambda config: calls.append("app") or app)
    monkeypatch.setattr(gc_freeze, "freeze_after_load", lambda device: calls.append(("freeze", device)))
    monkeypatch.setattr(aiohttp.web, "run_app", lambda served, **options: calls.append(("run", served is app)))
    workers.serve(None, "127.0.0.1", 0, reuse_port=False)
    assert calls == (["app", ("run", True)] if images is None else ["app", ("freeze", "cuda:0"), ("run", True)])
