"""tests/security reuses tests/deploy's loader of the shipped manifests (deploy_objects)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "deploy"))
