"""Generate draplugin/api/<name>_pb2*.py and the messages' type stubs <name>_pb2.pyi from
proto/<name>.proto (grpcio-tools), as deviceplugin/api/generate.py does for the device plugin's.

`python -m draplugin.api.generate` rewrites the stubs; `--check` exits 1 when they are stale.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROTO_DIR = REPO / "proto"
OUT_DIR = Path(__file__).resolve().parent
PROTOS = ("dra_v1", "dra_v1beta1", "pluginregistration_v1", "dra_health_v1alpha1")
FILES = tuple(f"{p}{suffix}" for p in PROTOS for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"))


def generate() -> dict[str, str]:
    """Return {file name: generated text} without touching the tree."""
    from grpc_tools import protoc  # only needed at build time

    with tempfile.TemporaryDirectory() as tmp:
        rc = protoc.main(
            [
                "grpc_tools.protoc",
                f"-I{PROTO_DIR}",
                f"--python_out={tmp}",
                f"--pyi_out={tmp}",
                f"--grpc_python_out={tmp}",
                *(f"{p}.proto" for p in PROTOS),
            ]
        )
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit status {rc}")
        out = {name: (Path(tmp) / name).read_text() for name in FILES}
    # protoc writes a top-level import; the stubs live in a package.
    for p in PROTOS:
        out[f"{p}_pb2_grpc.py"] = out[f"{p}_pb2_grpc.py"].replace(
            f"\nimport {p}_pb2 as ", f"\nfrom draplugin.api import {p}_pb2 as "
        )
    return out


def stale_files() -> list[str]:
    return [
        n for n, text in generate().items() if not (OUT_DIR / n).exists() or (OUT_DIR / n).read_text() != text
    ]


def main(argv: list[str]) -> int:
    if "--check" in argv:
        stale = stale_files()
        if stale:
            print(f"stale generated stubs: {', '.join(stale)}; run python -m draplugin.api.generate")
            return 1
        print("generated stubs are up to date")
        return 0
    for name, text in generate().items():
        (OUT_DIR / name).write_text(text)
    print(f"wrote {', '.join(FILES)} to {OUT_DIR.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
