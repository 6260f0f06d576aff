import json
from pathlib import Path

import pytest

from gpupack.contract import ContractError, parse_quantity
from gpupack.core.request import RequestError, parse_pod

SHARED = Path(__file__).resolve().parents[2] / ".." / "shared"


def pod(containers, labels=None, init=None, annotations=None):
    return {
        "metadata": {
            "name": "p",
            "namespace": "ns",
            "labels": labels or {},
            "annotations": annotations or {},
        },
        "spec": {"containers": containers, "initContainers": init or []},
    }


def ctr(name="c", **limits):
    return {
        "name": name,
        "resources": {"limits": {f"gpupack.io/{k.replace('_', '-')}": v for k, v in limits.items()}},
    }


@pytest.mark.parametrize(
    "text,expected",
    [("20k", 20000), ("1500m", 1.5), ("16Gi", 16 * 2**30), (3, 3), ("1e3", 1000), ("0.5", 0.5)],
)
def test_quantities_parse_like_kubernetes(text, expected):
    assert parse_quantity(text) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["", "abc", "12Q", "1..2", True, None, [1]])
def test_bad_quantities_are_contract_errors(text):
    with pytest.raises(ContractError):
        parse_quantity(text)


def test_gpu_defaults_to_one_when_memory_or_sm_set():
    r = parse_pod(pod([ctr(gpu_mem="15360", gpu_sm="40")]))
    (c,) = r.containers
    assert (c.gpus, c.mem_mib, c.milli, c.exclusive) == (1, 15360, 400, False)
    assert r.pod_class == "online"


def test_gpu_count_alone_means_whole_gpus():
    (c,) = parse_pod(pod([ctr(gpu="2")])).containers
    assert c.gpus == 2 and c.exclusive


def test_class_from_pod_label_then_namespace():
    assert parse_pod(pod([ctr(gpu="1")], labels={"gpupack.io/class": "offline"})).pod_class == "offline"
    assert parse_pod(pod([ctr(gpu="1")]), {"gpupack.io/class": "offline"}).pod_class == "offline"
    with pytest.raises(RequestError, match="'batch' is not one of"):
        parse_pod(pod([ctr(gpu="1")], labels={"gpupack.io/class": "batch"}))


def test_requests_must_equal_limits():
    c = ctr(gpu_mem="1000")
    c["resources"]["requests"] = {"gpupack.io/gpu-mem": "2000"}
    with pytest.raises(RequestError, match="must equal limits"):
        parse_pod(pod([c]))


@pytest.mark.parametrize(
    "limits,match",
    [
        ({"gpu_sm": "0"}, "1..100"),
        ({"gpu_sm": "101"}, "1..100"),
        ({"gpu_mem": "-5"}, "negative"),
        ({"gpu_mem": "0"}, "positive"),
        ({"gpu_mem": "1.5"}, "whole number"),
        ({"gpu": "0", "gpu_mem": "100"}, "gpu=0"),
        ({"gpu_mem": "lots"}, "not a Kubernetes quantity"),
    ],
)
def test_bad_values_name_container_and_value(limits, match):
    with pytest.raises(RequestError, match=match) as e:
        parse_pod(pod([ctr("main", **limits)]))
    assert "ns/p" in str(e.value) and "'main'" in str(e.value)


def test_gpu_models_annotation():
    r = parse_pod(pod([ctr(gpu="1")], annotations={"gpupack.io/gpu-models": "A10|T4, V100"}))
    assert r.gpu_models == frozenset({"A10", "T4", "V100"})


@pytest.mark.parametrize("bad", [None, [], "x", {"metadata": [], "spec": {}}, {"spec": {"containers": {}}}])
def test_malformed_pods_raise_request_error(bad):
    with pytest.raises(RequestError):
        parse_pod(bad)


def test_real_scheduler_payloads_parse():
    d = SHARED / "payloads" / "nodecache-true"
    if not d.is_dir():
        pytest.skip("../shared/payloads not present")
    shapes = {}
    for f in sorted(d.glob("*-filter.json")):
        p = json.loads(f.read_text())["Pod"]
        r = parse_pod(p)
        shapes[r.key] = r
    online = shapes["default/llm-7b-online"]
    assert online.pod_class == "online"
    assert [(c.gpus, c.mem_mib, c.milli) for c in online.containers] == [(1, 15360, 400)]
    batch = shapes["default/batch-eval-offline"]
    assert batch.pod_class == "offline"
    assert sorted((c.mem_mib, c.milli) for c in batch.containers) == [(4096, None), (20000, 500)]
    assert [c.mem_mib for c in batch.init_containers] == [2048]
    trainer = shapes["default/trainer-2gpu"]
    assert [(c.gpus, c.exclusive) for c in trainer.containers] == [(2, True)]
