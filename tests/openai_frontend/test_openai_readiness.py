"""/v1/models agrees with /health: while Triton or its models are not ready both answer 503
``model_not_ready`` (the model list used to be served at once, so a client that waited for it got
a 503 for its first request), and both answer 200 once they are. An unknown model is a 404 either
way. Triton's readiness comes from a fake admin client standing in for the server."""
import asyncio
import json

import pytest
from aiohttp.test_utils import TestClient, TestServer

from openai_frontend.app import FRONTEND, FrontendConfig, create_app

BASE = "base"


class FakeAdmin:
    """Triton's readiness calls, answering ``state``: "down" (no answer), "loading" or "ready"."""

    def __init__(self):
        self.state = "down"

    async def is_server_ready(self):
        if self.state == "down":
            raise ConnectionError("connection refused")
        return True

    async def is_model_ready(self, name):
        return self.state == "ready"

    async def close(self):
        pass


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory, byte_level_tokenizer):
    path = tmp_path_factory.mktemp("readiness_engine")
    byte_level_tokenizer.save_pretrained(str(path))
    (path / "config.json").write_text(json.dumps({"build": {"max_input_len": 256, "max_seq_len": 512}}))
    return str(path)


def answers(engine_dir, states):
    """For each Triton state in turn: the status and error code of /health, /v1/models,
    /v1/models/<base> and /v1/models/<unknown>."""
    async def run():
        app = create_app(FrontendConfig(grpc_url="127.0.0.1:1", tokenizer_dir=engine_dir, served_model_name=BASE))
        async with TestClient(TestServer(app)) as client:
            admin = app[FRONTEND].client._admin = FakeAdmin()
            seen = []
            for state in states:
                admin.state = state
                app[FRONTEND].client._ready_until = 0.0  # a fresh readiness check for this state
                row = {}
                for path in ("/health", "/v1/models", f"/v1/models/{BASE}", "/v1/models/nope"):
                    response = await client.get(path)
                    body = await response.text()
                    code = json.loads(body)["error"]["code"] if response.status >= 400 else None
                    row[path] = (response.status, code)
                seen.append(row)
            return seen
    return asyncio.run(run())


def test_models_and_health_say_not_ready_together_then_ready_together(engine_dir):
    down, loading, ready = answers(engine_dir, ["down", "loading", "ready"])
    for row in (down, loading):
        assert row["/health"] == row["/v1/models"] == row[f"/v1/models/{BASE}"] == (503, "model_not_ready")
        assert row["/v1/models/nope"] == (404, "model_not_found")
    assert ready["/health"] == ready["/v1/models"] == ready[f"/v1/models/{BASE}"] == (200, None)
    assert ready["/v1/models/nope"] == (404, "model_not_found")


def test_a_model_that_goes_away_leaves_both(engine_dir):
    """An engine restart (the model unloads and loads itself) takes the model out of both."""
    ready, restarting, back = answers(engine_dir, ["ready", "loading", "ready"])
    assert ready["/v1/models"][0] == back["/v1/models"][0] == 200
    assert restarting["/v1/models"] == restarting["/health"] == (503, "model_not_ready")
