"""deploy/kubernetes/leaderworkerset.yaml, rendered without a cluster: each pod's command is run by
bash with the environment LWS gives pod r (a stand-in ``tritonserver`` prints what it was started
with), and the rank environment it exports is read by the engine's own rank parser."""
from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import yaml

from engine.tensor_parallel.distributed import DistSettings, RankInfo, rank_info_from_env

MANIFEST = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "leaderworkerset.yaml"


def render(command: str, index: int, size: int, tmp_path: Path) -> dict:
    """What pod ``index`` starts: tritonserver's arguments and the rank variables it sees."""
    fake = tmp_path / "tritonserver"
    fake.write_text('#!/bin/bash\necho "ARGS $*"\nenv | grep -E "^(RANK|WORLD_SIZE|LOCAL_|TRITONLLM_DIST_)"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = {"PATH": f"{tmp_path}:{os.environ['PATH']}", "LWS_WORKER_INDEX": str(index), "LWS_GROUP_SIZE": str(size),
           "LWS_LEADER_ADDRESS": "tritonllm-0.tritonllm.default"}
    out = subprocess.run(["bash", "-c", command], env=env, capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    return {"args": lines[0].split()[1:], "env": dict(line.split("=", 1) for line in lines[1:])}


def test_every_pod_is_a_rank_and_only_the_leader_serves(tmp_path):
    lws, service = list(yaml.safe_load_all(MANIFEST.read_text()))
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1" and lws["kind"] == "LeaderWorkerSet"
    template = lws["spec"]["leaderWorkerTemplate"]
    size = template["size"]
    leader = template["leaderTemplate"]["spec"]["containers"][0]
    worker = template["workerTemplate"]["spec"]["containers"][0]
    assert leader["args"] == worker["args"]  # one command; the rank decides
    assert {p["containerPort"] for p in leader["ports"]} == {8000, 8001, 8002} and "ports" not in worker
    assert service["spec"]["selector"]["role"] == template["leaderTemplate"]["metadata"]["labels"]["role"]
    for index in range(size):
        pod = render(leader["args"][0], index, size, tmp_path)
        assert f"--backend-config=python,shm-region-prefix-name=prefix{index}_" in pod["args"]
        assert ("--load-model=*" if index == 0 else "--load-model=tensorrt_llm") in pod["args"]
        info = rank_info_from_env(pod["env"])
        assert info == RankInfo(index, size, 0, 1)
        assert DistSettings.from_env(info, pod["env"]).addr == "tritonllm-0.tritonllm.default"
