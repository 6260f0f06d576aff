"""Generate draplugin/api/<name>_pb2*.py and the messages' type stubs <name>_pb2.pyi from
proto/<name>.proto (grpcio-tools), as deviceplugin/api/generate.py does for the device plugin's.

`python -m draplugin.api.generate` rewrites the stubs; `--check` exits 1 when they are stale.
"""

from __future__ import annotations

import sys
from pathlib import Path

from deviceplugin.api.generate import Stubs

OUT_DIR = Path(__file__).resolve().parent
STUBS = Stubs(
    "draplugin.api", ("dra_v1", "dra_v1beta1", "pluginregistration_v1", "dra_health_v1alpha1"), OUT_DIR
)
FILES = STUBS.files


def generate() -> dict[str, str]:
    """Return {file name: generated text} without touching the tree."""
    return STUBS.generate()


def stale_files() -> list[str]:
    return STUBS.stale_files()


def main(argv: list[str]) -> int:
    return STUBS.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
