"""Fixtures of the DRA plugin's tests: the device plugin's fake NVML (tests/deviceplugin/fake_nvml.py)
is importable from here too, and the real-cluster tests share one set-up (dra_env.py)."""

from __future__ import annotations

import sys
from pathlib import Path

DEVICEPLUGIN_TESTS = str(Path(__file__).resolve().parents[1] / "deviceplugin")
if DEVICEPLUGIN_TESTS not in sys.path:
    sys.path.insert(0, DEVICEPLUGIN_TESTS)
