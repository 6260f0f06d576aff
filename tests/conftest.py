"""Session-wide fixtures: one real Kubernetes control plane for the whole test run.

`k8s` starts etcd, kube-apiserver and kube-controller-manager from the real binaries (v1.28.7 or v1.36.2)
(see tests/realk8s.py) once per run; `cluster` hands it to a test and clears what the test
created afterwards. Without the binaries these tests are skipped with one line saying how to get
them, unless GPUPACK_REQUIRE_K8S=1 (set by .ci/run), where that is an error.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import realk8s

pytest_plugins = ["markers"]  # the suite's markers, applied from fixtures (tests/markers.py)


def _require() -> bool:
    return os.environ.get("GPUPACK_REQUIRE_K8S", "") not in ("", "0")


def pytest_report_header() -> str:
    assets = realk8s.assets_dir()
    return f"kubernetes binaries: {assets or 'none'}" + (f" ({_version(assets)})" if assets else "")


def _version(assets: Path) -> str:
    try:
        return "v{}.{}".format(*realk8s.binary_version("kube-apiserver", assets))
    except Exception as e:  # the header must not stop the run; the k8s fixture reports it properly
        return f"version unknown: {e}"


@pytest.fixture(scope="session")
def k8s() -> Iterator[realk8s.ControlPlane]:
    if realk8s.assets_dir() is None:
        if _require():
            pytest.fail(f"GPUPACK_REQUIRE_K8S is set but {realk8s.HOW_TO_GET}")
        pytest.skip(realk8s.HOW_TO_GET)
    workdir = Path(tempfile.mkdtemp(prefix="gpupack-k8s-"))
    cp = realk8s.ControlPlane(workdir)
    try:
        cp.start(controller_manager=True)
    except Exception:
        cp.stop()
        raise
    yield cp
    cp.stop()
    if os.environ.get("GPUPACK_KEEP_K8S_LOGS"):
        print(f"\nkube logs kept in {workdir / 'logs'}")
    else:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def cluster(k8s: realk8s.ControlPlane) -> Iterator[realk8s.ControlPlane]:
    """The shared control plane, emptied of this test's pods, nodes, namespaces and webhooks after."""
    yield k8s
    k8s.reset()
