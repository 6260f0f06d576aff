from datetime import UTC, datetime, timedelta

from extender.state import reservations as resv
from gpupack.contract import GPUShare, Reservation
from gpupack.core.fit import fit
from gpupack.core.model import GPU, ContainerRequest, Node, PodRequest

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def _node() -> Node:
    return Node("n1", [GPU(f"u{i}", i, "H100", 80000, 132) for i in range(4)])


def _res(
    rid="r1", uuid="u2", mem=40000, sm=50, expires=NOW + timedelta(minutes=5), owner=("ReplicaSet", "web")
):
    return Reservation(
        id=rid,
        namespace="prod",
        owner_kind=owner[0],
        owner_name=owner[1],
        pod_class="online",
        containers={"main": (GPUShare(uuid, 2, mem, sm),)},
        expires=expires.isoformat().replace("+00:00", "Z"),
    )


def _pod(owner=("ReplicaSet", "web"), ns="prod", cls="online", mem=40000):
    return PodRequest(
        key=f"{ns}/p",
        pod_class=cls,
        containers=(ContainerRequest("main", 1, mem, 500),),
        namespace=ns,
        owner=owner,
    )


def test_active_skips_expired_consumed_and_unreadable():
    live = _res("a")
    expired = _res("b", expires=NOW - timedelta(seconds=1))
    bad = Reservation(**{**live.__dict__, "id": "c", "expires": "tomorrow"})
    assert [r.id for r in resv.active([live, expired, bad], NOW)] == ["a"]
    assert resv.active([live], NOW, consumed={"a"}) == []


def test_matches_needs_namespace_owner_and_class():
    r = _res()
    assert resv.matches(r, _pod())
    assert not resv.matches(r, _pod(owner=("ReplicaSet", "other")))
    assert not resv.matches(r, _pod(ns="dev"))
    assert not resv.matches(r, _pod(cls="offline"))
    assert not resv.matches(r, _pod(owner=None))


def test_hold_charges_without_touching_the_original():
    n = _node()
    held = resv.hold(n, [_res(mem=70000)])
    assert n.gpus[2].mem_used == 0
    assert held.gpus[2].mem_used == 70000 and held.gpus[2].pod_class == "online"
    assert "reservation:r1" in held.gpus[2].holders


def test_other_pods_cannot_use_held_capacity_but_the_owner_is_steered_there():
    n = Node("n1", [GPU("u2", 0, "H100", 80000, 132)])
    r = _res(mem=50000)
    stranger = _pod(owner=("ReplicaSet", "other"))
    cands = resv.candidates(n, [r], stranger, NOW, set())
    assert len(cands) == 1 and cands[0][1] is None
    f = fit(cands[0][0], stranger)
    assert not f and "largest free is 30000 MiB" in f.reason

    owner = _pod()
    cands = resv.candidates(n, [r], owner, NOW, set())
    assert cands[0][1] is r
    f = fit(cands[0][0], owner)
    assert f and f.placement.containers["main"][0].gpu_index == 0


def test_steer_uses_only_the_reserved_gpus():
    n = _node()
    steered = resv.steer(n, _res(uuid="u3"), [])
    assert [g.healthy for g in steered.gpus] == [False, False, False, True]
    f = fit(steered, _pod())
    assert f and f.placement.containers["main"][0].gpu_index == 3


def test_no_active_reservation_returns_the_node_itself():
    n = _node()
    assert resv.candidates(n, [_res(expires=NOW - timedelta(1))], _pod(), NOW, set()) == [(n, None)]
