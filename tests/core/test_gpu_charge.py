"""GPU.charge: the one way a pod (or a defrag reservation) is counted on a GPU, used by
ClusterState.place, the extender's view for what the API says is already there, and the
reservations it honours."""

from __future__ import annotations

import pytest

from gpupack.core.model import FULL, GPU


def gpu(**kw) -> GPU:
    return GPU("GPU-0", 0, "H100", 80_000, **kw)


def test_a_share_adds_to_what_is_used_and_an_empty_gpu_takes_its_class():
    g = gpu()
    g.charge("ns/a", 10_000, 300, False, "online")
    g.charge("ns/b", 5_000, 200, False, "online")
    assert (g.mem_used, g.milli_used, g.pod_class, g.exclusive) == (15_000, 500, "online", False)
    assert g.holders == {"ns/a": (10_000, 300), "ns/b": (5_000, 200)}


def test_exclusive_takes_the_whole_gpu():
    g = gpu()
    g.charge("ns/a", 0, 0, True, "offline")
    assert (g.free_mem, g.free_milli, g.pod_class, g.exclusive) == (0, 0, "offline", True)
    assert g.holders == {"ns/a": (80_000, FULL)}


@pytest.mark.parametrize(("held_class", "want"), [("online", "online"), (None, "offline")])
def test_a_gpu_with_pods_keeps_its_class(held_class, want):
    """What the API says is there is charged even where it conflicts; the class stays the first's."""
    g = gpu(mem_used=1_000, milli_used=100, pod_class=held_class, holders={"ns/a": (1_000, 100)})
    g.charge("ns/b", 1_000, 100, False, "offline")
    assert g.pod_class == want and g.milli_used == 200


def test_an_empty_gpu_takes_the_new_class_whatever_it_said():
    g = gpu(pod_class="online")
    g.charge("reservation:r1", 0, 500, False, "offline")
    assert g.pod_class == "offline"
