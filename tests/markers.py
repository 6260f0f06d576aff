"""The suite's markers (registered in pyproject.toml [tool.pytest.ini_options]), applied here where
a test's fixtures say it, so that a new test cannot forget them:

- `k8s`: the test uses the real control plane (the `k8s` fixture, directly or through `cluster`
  and the fixtures built on it). A test that starts real Kubernetes binaries without it is marked
  by hand (`pytestmark = pytest.mark.k8s`).
- `openb`: the test reads the openb trace (the `openb` fixture of tests/simulate/, or by hand).
- `slow`: by hand, for a test that takes seconds of CPU without a control plane.

The quick loop (`scripts/quick`) runs `-m "not k8s and not slow"`.
"""

from __future__ import annotations

import pytest

# fixture -> the marker every test that (transitively) uses it gets
_BY_FIXTURE = {"k8s": "k8s", "openb": "openb"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        for fixture, marker in _BY_FIXTURE.items():
            if fixture in used:
                item.add_marker(marker)
