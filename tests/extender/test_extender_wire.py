import pytest
from ext_helpers import payloads

from extender.api.wire import WireError, filter_result, parse_bind_args, parse_extender_args


@pytest.mark.parametrize("mode", ["nodecache-true", "nodecache-false"])
def test_recorded_payloads_parse(mode):
    seen = set()
    for verb, body in payloads(mode):
        seen.add(verb)
        if verb == "bind":
            b = parse_bind_args(body)
            assert b.node in ("gpu-node-a", "gpu-node-b") and b.pod_uid
        else:
            a = parse_extender_args(body)
            assert a.node_names == ["gpu-node-a", "gpu-node-b"]
            assert a.node_cache_capable == (mode == "nodecache-true")
    assert seen == {"filter", "prioritize", "bind"}


def test_nodecache_false_result_echoes_node_objects():
    _, body = payloads("nodecache-false")[0]
    a = parse_extender_args(body)
    out = filter_result(a, ["gpu-node-b"], {"gpu-node-a": "full"}, {})
    assert [n["metadata"]["name"] for n in out["Nodes"]["items"]] == ["gpu-node-b"]
    assert out["FailedNodes"] == {"gpu-node-a": "full"} and out["Error"] == ""


POD = {"metadata": {"name": "p", "namespace": "d"}, "spec": {"containers": []}}


@pytest.mark.parametrize(
    "body,needle",
    [
        ([], "JSON object"),
        ("x", "JSON object"),
        ({}, "missing field Pod"),
        ({"Pod": "x", "NodeNames": []}, "Pod object"),
        ({"Pod": {"metadata": 3, "spec": {}}, "NodeNames": []}, "metadata"),
        ({"Pod": {"metadata": {"name": 5}, "spec": {}}, "NodeNames": []}, "metadata.name must be a string"),
        ({"Pod": {"metadata": {"name": "p"}, "spec": []}, "NodeNames": []}, "Pod.spec"),
        ({"Pod": POD}, "NodeNames"),
        ({"Pod": POD, "NodeNames": "a"}, "list of strings"),
        ({"Pod": POD, "NodeNames": ["a", 1]}, "NodeNames[1]"),
        ({"Pod": POD, "NodeNames": ["x" * 300]}, "at most 253"),
        ({"Pod": POD, "Nodes": {"items": "a"}}, "NodeList"),
        ({"Pod": POD, "Nodes": {"items": [{"metadata": {}}]}}, "Nodes.items[0].metadata.name"),
    ],
)
def test_bad_extender_args(body, needle):
    with pytest.raises(WireError) as e:
        parse_extender_args(body)
    assert needle in str(e.value) and e.value.status == 400


@pytest.mark.parametrize(
    "body,needle",
    [
        ({"PodName": "p", "PodNamespace": "d"}, "missing field Node"),
        ({"PodName": 1, "PodNamespace": "d", "Node": "n"}, "PodName must be a string"),
        ({"PodName": "p", "PodNamespace": "d", "Node": ""}, "Node must not be empty"),
        ({"PodName": "p", "PodNamespace": "d", "Node": "n", "PodUID": 7}, "PodUID"),
    ],
)
def test_bad_bind_args(body, needle):
    with pytest.raises(WireError) as e:
        parse_bind_args(body)
    assert needle in str(e.value)
