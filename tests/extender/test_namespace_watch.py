"""A pod's default class comes from its namespace's labels, which the extender's Sync watches
(real API server, the extender's Kube behind a FaultProxy that records what it asks)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import realk8s
from faultproxy import FaultProxy
from kubernetes import client
from realk8s import until

from extender.api.kube import Kube, api_client
from extender.state.sync import Sync
from extender.state.view import ClusterView
from gpupack.contract import LABEL_CLASS

NS_LIST = r"^/api/v1/namespaces$"  # the namespace list and watch


def test_namespace_labels_come_from_the_watch_and_a_namespace_it_has_not_delivered_is_read(
    cluster: realk8s.ControlPlane, sfx: str, tmp_path: Path
) -> None:
    core = cluster.core
    first, later = f"nsw-a-{sfx}", f"nsw-b-{sfx}"
    cluster.ensure_namespace(first, {LABEL_CLASS: "offline"})
    with FaultProxy(cluster.url) as proxy:
        kube = Kube(api_client(str(cluster.write_kubeconfig(tmp_path / "kc", server=proxy.url))))
        sync = Sync(ClusterView(track_host=True), kube, watch_timeout_s=30)
        sync.start()
        try:
            assert sync.wait_ready(20)
            assert first in kube.watched_namespaces()
            got = rf"^/api/v1/namespaces/{first}$"
            # listed: answered from memory, never read on the verb path
            assert kube.namespace_labels(first).get(LABEL_CLASS) == "offline"
            # a relabel reaches the extender through the watch, without a read and without the
            # minute a cached read took to expire
            core.patch_namespace(first, {"metadata": {"labels": {LABEL_CLASS: "online"}}})
            until(
                lambda: kube.namespace_labels(first).get(LABEL_CLASS) == "online", 10, "the relabel watched"
            )
            assert proxy.count("GET", got) == 0

            # a namespace created while the namespace watch is away (cut, its next request held):
            # read once, with its labels; an unlabelled default would have made its pods online
            until(lambda: "/api/v1/namespaces" in proxy.open_watches(), 20, "the namespace watch open")
            proxy.delay(NS_LIST, 8, method="GET")
            assert proxy.cut_watches() >= 1
            cluster.ensure_namespace(later, {LABEL_CLASS: "offline"})
            assert kube.namespace_labels(later).get(LABEL_CLASS) == "offline"
            assert proxy.count("GET", rf"^/api/v1/namespaces/{later}$") == 1
            # once the watch is back it delivers the namespace, and its changes win over that read
            core.patch_namespace(later, {"metadata": {"labels": {LABEL_CLASS: "online"}}})
            until(lambda: kube.namespace_labels(later).get(LABEL_CLASS) == "online", 20, "the watch back")
            assert proxy.count("GET", rf"^/api/v1/namespaces/{later}$") == 1

            # a deleted namespace is forgotten: a read of it answers that it is gone (no labels)
            core.delete_namespace(first)
            until(lambda: first not in kube.watched_namespaces(), 60, "the namespace's deletion watched")
            assert kube.namespace_labels(first) == {}
        finally:
            sync.close()
            for name in (first, later):
                with contextlib.suppress(client.ApiException):  # gone already
                    core.delete_namespace(name)
