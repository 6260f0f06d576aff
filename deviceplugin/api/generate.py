"""Generate deviceplugin/api/<name>_pb2*.py and the messages' type stubs <name>_pb2.pyi from
proto/<name>.proto (grpcio-tools): the device plugin API (api.proto) and the kubelet's PodResources
API (podresources.proto).

`python -m deviceplugin.api.generate` rewrites the stubs; `--check` exits 1 when they are stale.
"""

from __future__ import annotations

import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROTO_DIR = REPO / "proto"
OUT_DIR = Path(__file__).resolve().parent
PROTOS = ("api", "podresources")


@dataclass(frozen=True)
class Stubs:
    """One package's generated stubs: proto/<name>.proto for each of `protos`, written to `out_dir`
    as the modules of `package` (draplugin/api/generate.py uses it for the DRA plugin's APIs)."""

    package: str
    protos: tuple[str, ...]
    out_dir: Path

    @property
    def files(self) -> tuple[str, ...]:
        return tuple(
            f"{p}{suffix}" for p in self.protos for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
        )

    def generate(self) -> dict[str, str]:
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
                    *(f"{p}.proto" for p in self.protos),
                ]
            )
            if rc != 0:
                raise RuntimeError(f"protoc failed with exit status {rc}")
            out = {name: (Path(tmp) / name).read_text() for name in self.files}
        # protoc writes a top-level import; the stubs live in a package.
        for p in self.protos:
            out[f"{p}_pb2_grpc.py"] = out[f"{p}_pb2_grpc.py"].replace(
                f"\nimport {p}_pb2 as ", f"\nfrom {self.package} import {p}_pb2 as "
            )
        return out

    def stale_files(self) -> list[str]:
        out = self.out_dir
        return [
            n
            for n, text in self.generate().items()
            if not (out / n).exists() or (out / n).read_text() != text
        ]

    def main(self, argv: list[str]) -> int:
        if "--check" in argv:
            stale = self.stale_files()
            if stale:
                print(f"stale generated stubs: {', '.join(stale)}; run python -m {self.package}.generate")
                return 1
            print("generated stubs are up to date")
            return 0
        for name, text in self.generate().items():
            (self.out_dir / name).write_text(text)
        print(f"wrote {', '.join(self.files)} to {self.out_dir.relative_to(REPO)}")
        return 0


STUBS = Stubs("deviceplugin.api", PROTOS, OUT_DIR)
FILES = STUBS.files


def generate() -> dict[str, str]:
    """Return {file name: generated text} without touching the tree."""
    return STUBS.generate()


def proto_descriptor(name: str = "api") -> bytes:
    """FileDescriptorProto of proto/<name>.proto as protoc compiles it now (serialized)."""
    from google.protobuf import descriptor_pb2
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / f"{name}.desc"
        rc = protoc.main(
            ["grpc_tools.protoc", f"-I{PROTO_DIR}", f"--descriptor_set_out={out}", f"{name}.proto"]
        )
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit status {rc}")
        fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    f = fds.file[0]
    # Generated modules embed descriptors without json_name; drop it to compare like with like.
    stack = list(f.message_type)
    while stack:
        m = stack.pop()
        for fld in m.field:
            fld.ClearField("json_name")
        stack.extend(m.nested_type)
    return f.SerializeToString(deterministic=True)


def stale_files() -> list[str]:
    return STUBS.stale_files()


def main(argv: list[str]) -> int:
    return STUBS.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
