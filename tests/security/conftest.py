"""tests/security reuses tests/deploy's loader of the shipped manifests (deploy_objects) and
tests/extender's helpers (ext_helpers: kill_tree)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "deploy"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "extender"))
