from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from defrag_cluster import Cluster

from gpupack.testing.kubeapi import KubeAPIServer


@pytest.fixture
def kubeapi() -> Iterator[KubeAPIServer]:
    with KubeAPIServer(bookmark_interval=0.5) as srv:
        yield srv


@pytest.fixture
def cluster(kubeapi: KubeAPIServer) -> Iterator[Cluster]:
    c = Cluster(kubeapi)
    c.namespace("gpupack-system")  # where the run's Lease lives
    yield c
    c.stop()


@pytest.fixture
def kubeconfig(kubeapi: KubeAPIServer, tmp_path: Path) -> Path:
    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "t", "cluster": {"server": kubeapi.url}}],
        "users": [{"name": "t", "user": {}}],
        "contexts": [{"name": "t", "context": {"cluster": "t", "user": "t"}}],
        "current-context": "t",
    }
    path = tmp_path / "kubeconfig"
    path.write_text(json.dumps(cfg))
    return path
