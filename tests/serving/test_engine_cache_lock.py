"""scripts/serve_default.py's engine cache when several processes ask for the same entry at once
(the launcher and its server's model, model instances loading in parallel): one builds, the others
wait on the entry's lock and reuse what it built."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# One asking process: engine.build replaced by a slow fake that logs each build, so the second
# process surely arrives while the first is building.
DRIVER = """
import importlib.util, json, os, subprocess, sys, time
from pathlib import Path

spec = importlib.util.spec_from_file_location("serve_default", sys.argv[1])
serve = importlib.util.module_from_spec(spec)
spec.loader.exec_module(serve)

def fake_build(command, **kwargs):
    with open(sys.argv[3], "a") as log:
        log.write(f"{os.getpid()}\\n")
    time.sleep(3)
    output = Path(command[command.index("--output") + 1])
    output.mkdir(parents=True)
    (output / "config.json").write_text(json.dumps({"pid": os.getpid()}))
    return subprocess.CompletedProcess(command, 0)

serve.subprocess.run = fake_build
print("ENGINE", serve.ensure_checkpoint_engine(sys.argv[2], ["--tp_size", "2"]), flush=True)
"""


def test_two_processes_asking_at_once_build_once(tmp_path):
    checkpoint = tmp_path / "tiny.gguf"
    checkpoint.write_bytes(b"GGUF")
    driver, builds = tmp_path / "driver.py", tmp_path / "builds.log"
    driver.write_text(DRIVER)
    env = {**os.environ, "TRITONLLM_CACHE": str(tmp_path / "cache")}
    command = [sys.executable, str(driver), str(ROOT / "scripts" / "serve_default.py"), str(checkpoint), str(builds)]
    processes = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for _ in range(2)]
    outputs = [process.communicate(timeout=60)[0] for process in processes]
    assert [process.returncode for process in processes] == [0, 0], outputs
    assert len(builds.read_text().split()) == 1, outputs  # built once
    engines = {line.split(" ", 1)[1] for output in outputs for line in output.splitlines() if line.startswith("ENGINE")}
    assert len(engines) == 1, outputs  # both got the same entry
    engine = Path(engines.pop())
    assert json.loads((engine / "config.json").read_text())["pid"] == int(builds.read_text().split()[0])
    assert any("waiting for another process building" in output for output in outputs), outputs
    assert not list(engine.parent.glob("*.partial-*"))
