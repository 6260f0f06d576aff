"""The per-GPU gauges kept per node version (extender/state/gpu_gauges.py): what a scrape serves equals
what a collector with nothing kept writes for the same view, whatever happened between scrapes."""

from __future__ import annotations

import copy

from ext_helpers import assigned, container, node_obj, pod_obj
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from extender.state.gpu_gauges import GpuGauges, _node_text, render
from extender.state.metrics import Metrics
from extender.state.view import ClusterView
from gpupack.contract import GPUShare

NODES = ("a", "b", "c")


def scrape(m: Metrics) -> str:
    # a *_created sample is the time its metric was made: not the view's, and not equal across registries
    return "".join(line + "\n" for line in render(m.registry).decode().splitlines() if "_created" not in line)


def fresh(view: ClusterView) -> str:
    m = Metrics()
    m.attach_view(view)
    return scrape(m)


def gauges(m: Metrics) -> GpuGauges:
    (collector,) = [c for c in m.registry._collector_to_names if hasattr(c, "gpus")]
    return collector.gpus  # type: ignore[no-any-return]


step = st.one_of(
    st.tuples(
        st.just("charge"),
        st.sampled_from(NODES),
        st.integers(0, 1),
        st.integers(1, 4),
        st.sampled_from(["online", "offline"]),
    ),  # fmt: skip
    st.tuples(st.just("release"), st.integers(0, 20)),
    st.tuples(st.just("node"), st.sampled_from(NODES), st.integers(1, 2), st.sampled_from([81559, 24576])),
    st.tuples(st.just("delete-node"), st.sampled_from(NODES)),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(step, max_size=25))
def test_a_scrape_serves_what_a_collector_with_nothing_kept_writes(steps):
    view = ClusterView()
    view.replace_nodes([node_obj(n, 2) for n in NODES])
    view.replace_pods([])
    kept = Metrics()
    kept.attach_view(view)
    pods: list[dict] = []
    for i, s in enumerate(steps):
        if s[0] == "charge":
            _, node, gpu, tenths, cls = s
            pod = assigned(
                pod_obj(f"p{i}", [container("c", 1, 1000 * tenths, 10 * tenths)], cls=cls),
                node,
                {"c": (GPUShare(f"GPU-{node}-{gpu}", gpu, 1000 * tenths, 10 * tenths),)},
            )
            view.apply_pod(pod)
            pods.append(pod)
        elif s[0] == "release" and pods:
            view.apply_pod(copy.deepcopy(pods.pop(s[1] % len(pods))), deleted=True)
        elif s[0] == "node":
            _, node, n, mem = s
            view.apply_node(node_obj(node, n, mem=mem))
        elif s[0] == "delete-node":
            view.delete_node(s[1])
        assert scrape(kept) == fresh(view), steps[: i + 1]


def test_only_changed_nodes_are_written_again():
    view = ClusterView()
    view.replace_nodes([node_obj(n, 8) for n in NODES])
    view.replace_pods([])
    m = Metrics()
    m.attach_view(view)
    g = gauges(m)
    scrape(m)
    assert g.formatted == 3
    scrape(m)
    assert g.formatted == 3  # nothing changed: nothing written
    view.apply_pod(
        assigned(pod_obj("p", [container("c", 1, 1000, 10)]), "b", {"c": (GPUShare("GPU-b-0", 0, 1000, 10),)})
    )
    text = scrape(m)
    assert g.formatted == 4  # the one node the pod went to
    assert (
        'gpupack_gpu_reserved_memory_bytes{index="0",model="NVIDIA-H100-80GB-HBM3",node="b",uuid="GPU-b-0"}'
        in text
    )
    assert 'gpupack_gpu_class{class="online",index="0"' in text


def test_the_samples_read_from_the_family_are_those_of_its_text():
    """prometheus_client's own writer (which reads `samples`) and `render` give the same text."""
    view = ClusterView()
    view.replace_nodes([node_obj(n, 2) for n in NODES])
    view.replace_pods([])
    view.apply_pod(
        assigned(
            pod_obj("p", [container("c", 1, 1000, 10)], cls="offline"),
            "c",
            {"c": (GPUShare("GPU-c-1", 1, 1000, 10),)},
        )
    )
    m = Metrics()
    m.attach_view(view)
    slow = "".join(
        line + "\n" for line in generate_latest(m.registry).decode().splitlines() if "_created" not in line
    )
    assert slow == scrape(m)


def test_label_values_are_escaped_as_the_text_format_wants():
    odd = 'H100 "SXM"\\v2\nrev'
    node = _node_text(1, (("n1", 0, "GPU-0", odd, 0, 81559, 0, "online", True, 81559, False),))
    text = "".join(f"# TYPE x{i} gauge\n" + line.replace("gpupack_gpu_", f"x{i}_", 1) for i, line in
                   enumerate(node.lines) if line)  # fmt: skip
    families = list(text_string_to_metric_families(text))
    assert families and all(s.labels["model"] == odd for f in families for s in f.samples)


def test_a_standby_replica_keeps_nothing():
    view = ClusterView()
    view.replace_nodes([node_obj("a", 8)])
    view.replace_pods([])
    active = [True]
    m = Metrics()
    m.attach_view(view, active=lambda: active[0])
    g = gauges(m)
    assert "gpupack_gpu_memory_bytes{" in scrape(m)
    active[0] = False
    assert "gpupack_gpu_memory_bytes" not in scrape(m)
    assert g._kept == {}
