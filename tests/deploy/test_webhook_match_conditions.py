"""The webhooks' CEL matchConditions select exactly the pods the webhook code treats as gpupack's.

Evaluated with cel-python (a CEL implementation outside the API server): a syntax error, a wrong
field path or a missed case (init containers, requests-only) fails here rather than at apply time
or, worse, by silently skipping GPU pods.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from extender.serve.webhook import uses_gpupack

celpy = pytest.importorskip("celpy", reason="needs the test extra (cel-python)")

REPO = Path(__file__).resolve().parents[2]
WEBHOOKS = list(yaml.safe_load_all((REPO / "deploy" / "webhook" / "webhooks.yaml").read_text()))


def shared_dir() -> Path:
    env = os.environ.get("GPUPACK_SHARED")
    return Path(env) if env else REPO / ".." / "shared"


def programs():
    env = celpy.Environment()
    out = []
    for cfg in WEBHOOKS:
        # the state and plugin-node webhooks select on who changes what, not on resources (tested against
        # the real API server in test_webhook_apiserver.py)
        for hook in (
            h for h in cfg["webhooks"] if h["name"] not in ("state.pods.gpupack.io", "plugin-node.gpupack.io")
        ):
            for cond in hook["matchConditions"]:
                out.append(
                    (
                        f"{cfg['kind']} {hook['name']} {cond['name']}",
                        env.program(env.compile(cond["expression"])),
                    )
                )
    return out


PROGRAMS = programs()


def c(name: str, **res: dict) -> dict:
    return {"name": name, "image": "x:1", **({"resources": res} if res else {})}


PODS = {
    "shared gpu in limits": {"containers": [c("a", limits={"gpupack.io/gpu-mem": "20k", "cpu": "1"})]},
    "whole gpus": {"containers": [c("a", limits={"gpupack.io/gpu": "2"})]},
    "only requests (the webhook must see it, to refuse it)": {
        "containers": [c("a", requests={"gpupack.io/gpu-sm": "10"})]
    },
    "init container only": {
        "initContainers": [c("i", limits={"gpupack.io/gpu-mem": "2048"})],
        "containers": [c("a")],
    },
    "second container": {
        "containers": [c("a", limits={"cpu": "1"}), c("b", limits={"gpupack.io/gpu-sm": "50"})]
    },
    "cpu only": {"containers": [c("a", limits={"cpu": "1", "memory": "1Gi"}, requests={"cpu": "1"})]},
    "no resources at all": {"containers": [c("a")]},
    "empty resources": {"containers": [{"name": "a", "image": "x:1", "resources": {}}]},
    "nvidia plugin gpu": {"containers": [c("a", limits={"nvidia.com/gpu": "1"})]},
    "init without gpu": {
        "initContainers": [c("i", limits={"cpu": "1"})],
        "containers": [c("a", limits={"cpu": "1"})],
    },
}


@pytest.mark.parametrize("case", list(PODS))
def test_match_conditions_agree_with_the_webhook_code(case):
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "n"}, "spec": PODS[case]}
    want = uses_gpupack(pod)
    for what, prog in PROGRAMS:
        assert bool(prog.evaluate({"object": celpy.json_to_cel(pod)})) is want, what


def test_pods_a_real_kube_scheduler_sent_are_matched():
    payloads = shared_dir() / "payloads"
    if not payloads.is_dir():
        pytest.skip("recorded scheduler payloads not found (set GPUPACK_SHARED to the shared/ directory)")
    pods = {}
    for f in sorted(payloads.glob("*/*-filter.json")):
        pod = json.loads(f.read_text())["Pod"]
        pods[pod["metadata"]["name"]] = pod
    assert len(pods) == 3
    for name, pod in pods.items():
        for what, prog in PROGRAMS:
            assert bool(prog.evaluate({"object": celpy.json_to_cel(pod)})), f"{what} skips {name}"
