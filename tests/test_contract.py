import json
from dataclasses import asdict

import pytest

from gpupack.contract import (
    Assignment,
    ContractError,
    GPUInfo,
    GPUShare,
    NodeInventory,
    Reservation,
    decode_allocated,
    decode_assignment,
    decode_inventory,
    decode_reservations,
    encode_reservations,
)


def inv(n=8):
    return NodeInventory(
        gpus=tuple(GPUInfo(f"GPU-{i}", i, "NVIDIA H200", 143771, 132, numa_node=i // 4) for i in range(n))
    )


def test_inventory_round_trip_and_size():
    text = inv().to_json()
    assert decode_inventory(text, "n1") == inv()
    assert len(text) < 4096  # an 8 x H200 node's inventory stays a small annotation


def test_assignment_round_trip():
    a = Assignment(
        "uid-1",
        "n1",
        "online",
        {"main": (GPUShare("GPU-1", 1, 15360, 40),), "trainer": (GPUShare("GPU-2", 2, 143771, 100, True),)},
        bound_at="2026-01-01T00:00:00Z",
    )
    assert decode_assignment(a.to_json(), "ns/p") == a
    assert a.gpu_uuids() == {"GPU-1", "GPU-2"}
    # the encoding writes GPUShare's fields by name: every field, as asdict has them
    shares = json.loads(a.to_json())["containers"]
    assert shares == {c: [asdict(s) for s in ss] for c, ss in a.containers.items()}


def test_reservations_round_trip():
    r = Reservation(
        "r1",
        "ns",
        "ReplicaSet",
        "web-abc",
        "offline",
        {"c": (GPUShare("GPU-3", 3, 2048, 10),)},
        "2026-01-01T00:00:00Z",
    )
    assert decode_reservations(encode_reservations([r]), "n1") == [r]
    assert '"host"' not in encode_reservations([r])  # unchanged for readers that predate it


def test_reservation_host_room_round_trips_and_bad_values_are_refused():
    r = Reservation("preempt-1", "ns", "Pod", "web", "online", {}, "2026-01-01T00:00:00Z",
                    host_cpu_milli=2000, host_mem_bytes=4 << 30, host_pods=1)  # fmt: skip
    text = encode_reservations([r])
    assert decode_reservations(text, "n1") == [r]
    d = json.loads(text)
    for bad in ({"cpu_milli": -1}, {"pods": "1"}, {"mem_bytes": True}, []):
        d["reservations"][0]["host"] = bad
        with pytest.raises(ContractError, match="host"):
            decode_reservations(json.dumps(d), "n1")


@pytest.mark.parametrize(
    "text,match",
    [
        ("{", "not valid JSON"),
        ("[]", "expected a JSON object"),
        ('{"v": 2, "gpus": []}', "unsupported version"),
        ('{"v": 1}', "missing field 'gpus'"),
        (
            '{"v": 1, "gpus": [{"uuid": "a", "index": 0, "model": "x", "mem_mib": "big", "sm_count": 1}]}',
            "wrong type",
        ),
        (
            '{"v": 1, "gpus": [{"uuid": "a", "index": 0, "model": "x", "mem_mib": -1, "sm_count": 1}]}',
            "positive",
        ),
        (
            '{"v": 1, "gpus": ['
            + ",".join(['{"uuid": "a", "index": 0, "model": "x", "mem_mib": 1, "sm_count": 1}'] * 2)
            + "]}",
            "duplicate",
        ),
        ("[" * 100000, "not valid JSON"),
    ],
)
def test_corrupt_inventory_is_a_contract_error_naming_the_node(text, match):
    with pytest.raises(ContractError, match=match) as e:
        decode_inventory(text, "gpu-7")
    assert "node gpu-7" in str(e.value)


@pytest.mark.parametrize(
    "d",
    [
        {"v": 1, "pod_uid": "u", "node": "n", "class": "gold", "containers": {}},
        {"v": 1, "pod_uid": "u", "node": "n", "class": "online", "containers": {"c": []}},
        {"v": 1, "pod_uid": "u", "node": "n", "class": "online", "containers": {"c": [{"uuid": "g"}]}},
        {
            "v": 1,
            "pod_uid": "u",
            "node": "n",
            "class": "online",
            "containers": {"c": [{"uuid": "g", "index": 0, "mem_mib": 1, "sm_pct": 101}]},
        },
    ],
)
def test_corrupt_assignment_is_a_contract_error(d):
    with pytest.raises(ContractError):
        decode_assignment(json.dumps(d), "ns/p")


def test_allocated_list():
    assert decode_allocated('["a","b"]') == ["a", "b"]
    with pytest.raises(ContractError):
        decode_allocated('{"a": 1}')
