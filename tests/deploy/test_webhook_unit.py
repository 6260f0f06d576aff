"""The webhook's pure core: JSON patches and denials for pods, without an API server."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from extender.api.wire import WireError
from extender.serve.webhook import WebhookConfig, mutate, review, validate


def container(name: str, gpu: int | None = None, mem: int | str | None = None, sm: int | None = None) -> dict:
    limits = {k: str(v) for k, v in (("gpupack.io/gpu", gpu), ("gpupack.io/gpu-mem", mem), ("gpupack.io/gpu-sm", sm))
              if v is not None}  # fmt: skip
    return {
        "name": name,
        "image": "registry.invalid/x:1",
        "resources": {"limits": limits, "requests": dict(limits)},
    }


def pod_obj(
    name: str, containers: list[dict], cls: str | None = "online", init: list[dict] | None = None
) -> dict:
    meta: dict[str, Any] = {"name": name, "namespace": "default", "labels": {}}
    if cls is not None:
        meta["labels"]["gpupack.io/class"] = cls
    spec: dict[str, Any] = {"containers": containers}
    if init:
        spec["initContainers"] = init
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def test_mutate_adds_gpu_count_and_scheduler_name():
    pod = pod_obj(
        "p",
        [container("a", None, 1000), container("b", 2, 1000), {"name": "c", "image": "i"}],
        init=[container("i", None, None, 20)],
    )
    pod["spec"]["schedulerName"] = "default-scheduler"
    ops = mutate(pod, WebhookConfig(set_scheduler_name=True))
    assert {"op": "add", "path": "/spec/containers/0/resources/limits/gpupack.io~1gpu", "value": "1"} in ops
    assert {
        "op": "add",
        "path": "/spec/initContainers/0/resources/limits/gpupack.io~1gpu",
        "value": "1",
    } in ops
    assert not any("/containers/1/" in o["path"] or "/containers/2/" in o["path"] for o in ops)
    assert {"op": "replace", "path": "/spec/schedulerName", "value": "gpupack-scheduler"} in ops
    assert mutate(pod_obj("q", [{"name": "c", "image": "i"}]), WebhookConfig(set_scheduler_name=True)) == []


def test_mutate_creates_missing_limits():
    pod = pod_obj("p", [{"name": "a", "image": "i", "resources": {"requests": {"gpupack.io/gpu-mem": "10"}}}])
    ops = mutate(pod, WebhookConfig())
    assert [o["path"] for o in ops] == [
        "/spec/containers/0/resources/limits",
        "/spec/containers/0/resources/limits/gpupack.io~1gpu",
    ]


@pytest.mark.parametrize(
    "c,needle",
    [
        (
            {
                "name": "a",
                "resources": {
                    "limits": {"gpupack.io/gpu-mem": "100"},
                    "requests": {"gpupack.io/gpu-mem": "200"},
                },
            },
            "requests must equal limits for gpupack.io/gpu-mem; requests=200 limits=100",
        ),
        (container("a", 1, 100, 0), "gpu-sm must be a whole percent in 1..100; got 0"),
        (container("a", 1, 100, 101), "got 101"),
        (container("a", 1, 0), "gpu-mem must be a positive number of MiB; got 0"),
        (container("a", 1, 90000), "at most the largest GPU in the cluster; got 90000 MiB"),
        (container("a", 1, "90k"), "at most the largest GPU in the cluster; got 90000 MiB"),
        (container("a", 1, "1.5"), "gpu-mem must be a positive number of MiB"),
    ],
)
def test_validate_names_rule_and_value(c, needle):
    errs = validate(pod_obj("p", [c]), 81559)
    assert any(needle in e for e in errs), errs


def test_validate_class_label_and_accepts_good_pods():
    assert any(
        "must be one of online, offline; got 'batch'" in e
        for e in validate(pod_obj("p", [container("a", 1, 100)], cls="batch"), 0)
    )
    assert validate(pod_obj("p", [container("a", 1, 100, 50)], cls="offline"), 81559) == []
    assert validate(pod_obj("p", [{"name": "a", "image": "i"}], cls="weird"), 0) == []  # not ours


def test_review_shapes():
    pod = pod_obj("p", [container("a", None, 100)])
    body = {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {"uid": "u1", "kind": {"kind": "Pod"}, "operation": "CREATE", "object": pod},
    }
    out = review(body, "mutate", WebhookConfig(), 0)["response"]
    assert out["uid"] == "u1" and out["allowed"] and out["patchType"] == "JSONPatch"
    assert json.loads(base64.b64decode(out["patch"]))[0]["value"] == "1"
    bad = review(
        body | {"request": body["request"] | {"object": pod_obj("p", [container("a", 1, 999999)])}},
        "validate",
        WebhookConfig(),
        1000,
    )["response"]
    assert not bad["allowed"] and "largest GPU" in bad["status"]["message"]
    # the mutating review refuses requests != limits itself (the API server's check comes first)
    neq = {
        "name": "a",
        "resources": {"limits": {"gpupack.io/gpu-mem": "100"}, "requests": {"gpupack.io/gpu-mem": "200"}},
    }
    out = review(
        body | {"request": body["request"] | {"object": pod_obj("p", [neq])}}, "mutate", WebhookConfig(), 0
    )
    assert not out["response"]["allowed"] and "patch" not in out["response"]
    assert "requests must equal limits for gpupack.io/gpu-mem" in out["response"]["status"]["message"]
    with pytest.raises(WireError):
        review({"request": {"uid": 3}}, "validate", WebhookConfig(), 0)
