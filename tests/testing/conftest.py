from __future__ import annotations

from collections.abc import Iterator

import pytest
from kubernetes import client

from gpupack.testing.kubeapi import KubeAPIServer


@pytest.fixture
def server() -> Iterator[KubeAPIServer]:
    with KubeAPIServer() as srv:
        yield srv


@pytest.fixture
def api(server: KubeAPIServer) -> Iterator[client.ApiClient]:
    api_client = server.api_client()
    yield api_client
    api_client.close()


@pytest.fixture
def core(api: client.ApiClient) -> client.CoreV1Api:
    return client.CoreV1Api(api)
