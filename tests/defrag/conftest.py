from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from defrag_cluster import Cluster
from processes import write_kubeconfig

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
    return write_kubeconfig(tmp_path / "kubeconfig", kubeapi.url)
