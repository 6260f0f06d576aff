"""CDI spec files: one per prepared claim, the plugin's only state.

A prepared claim is the file `<cdi dir>/gpupack-<claim UID>.json` (kind `gpu.gpupack.io/gpu`), with
one CDI device per allocation result named `<claim UID>-<device>` whose containerEdits carry the
container's environment. The spec's annotations record the claim (namespace/name, UID, class) and
each device's GPU and shares, so that after a restart the plugin knows what is prepared on this node
from the directory alone: no checkpoint of its own, nothing to lose.

File names are derived from the claim UID only, never from tenant-written strings, and the UID is
checked to be a UID first. Files are written atomically (a temporary file in the same directory,
fsync, rename), so a container runtime never reads half a spec; the temporary file's name does not
end in .json or .yaml, which CDI readers skip.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draplugin.slices import DRIVER

CDI_VERSION = "0.6.0"
CDI_KIND = f"{DRIVER}/gpu"
DEFAULT_CDI_DIR = "/var/run/cdi"
FILE_PREFIX = "gpupack-"
# what the annotations record (CDI annotation keys: a qualified name, as Kubernetes labels)
A_CLAIM = f"{DRIVER}/claim"
A_UID = f"{DRIVER}/claim-uid"
A_CLASS = f"{DRIVER}/class"
A_GPU = f"{DRIVER}/gpu-uuid"
A_DEVICE = f"{DRIVER}/device"
A_MEMORY = f"{DRIVER}/memory-mib"
A_SM = f"{DRIVER}/sm-pct"
# API server UIDs are RFC 4122 strings; anything else never reaches a file name
_UID = re.compile(r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")


class BadUID(ValueError):
    pass


def check_uid(uid: str) -> str:
    if not _UID.match(uid):
        raise BadUID(f"claim UID {uid[:80]!r} is not a UID")
    return uid.lower()


def spec_path(cdi_dir: str | Path, uid: str) -> Path:
    return Path(cdi_dir) / f"{FILE_PREFIX}{check_uid(uid)}.json"


@dataclass(frozen=True)
class PreparedDevice:
    """One allocation result of a claim, as prepared on this node."""

    request: str
    pool: str
    device: str  # the slice's device name, gpu-<index>
    gpu_uuid: str
    mem_mib: int
    sm_pct: int  # 0: no SM share asked (no SM limit)
    share_id: str
    env: dict[str, str]

    def cdi_name(self, uid: str) -> str:
        return f"{uid}-{self.device}"


@dataclass(frozen=True)
class PreparedClaim:
    uid: str
    namespace: str
    name: str
    pod_class: str
    devices: tuple[PreparedDevice, ...]

    def cdi_ids(self) -> list[str]:
        return [f"{CDI_KIND}={d.cdi_name(self.uid)}" for d in self.devices]


def spec(claim: PreparedClaim) -> dict[str, Any]:
    """The CDI spec of one prepared claim."""
    return {
        "cdiVersion": CDI_VERSION,
        "kind": CDI_KIND,
        "annotations": {
            A_CLAIM: f"{claim.namespace}/{claim.name}"[:253],
            A_UID: claim.uid,
            A_CLASS: claim.pod_class,
        },
        "devices": [
            {
                "name": d.cdi_name(claim.uid),
                "annotations": {
                    A_DEVICE: d.device,
                    A_GPU: d.gpu_uuid,
                    A_MEMORY: str(d.mem_mib),
                    A_SM: str(d.sm_pct),
                    f"{DRIVER}/request": d.request[:253],
                    f"{DRIVER}/pool": d.pool[:253],
                    f"{DRIVER}/share-id": d.share_id[:64],
                },
                "containerEdits": {"env": [f"{k}={v}" for k, v in sorted(d.env.items())]},
            }
            for d in claim.devices
        ],
    }


def from_spec(doc: dict[str, Any]) -> PreparedClaim:
    """The claim a spec file records (ValueError/KeyError/TypeError for one not written by us)."""
    ann = doc["annotations"]
    ns, _, name = str(ann[A_CLAIM]).partition("/")
    uid = check_uid(str(ann[A_UID]))
    devices = []
    for d in doc["devices"]:
        a = d["annotations"]
        env = dict(str(e).split("=", 1) for e in d["containerEdits"]["env"])
        devices.append(
            PreparedDevice(
                request=str(a[f"{DRIVER}/request"]),
                pool=str(a[f"{DRIVER}/pool"]),
                device=str(a[A_DEVICE]),
                gpu_uuid=str(a[A_GPU]),
                mem_mib=int(a[A_MEMORY]),
                sm_pct=int(a[A_SM]),
                share_id=str(a[f"{DRIVER}/share-id"]),
                env=env,
            )
        )
    return PreparedClaim(
        uid=uid, namespace=ns, name=name, pod_class=str(ann[A_CLASS]), devices=tuple(devices)
    )


def write(cdi_dir: str | Path, claim: PreparedClaim) -> Path:
    """Write the claim's spec atomically; the same claim written twice leaves one identical file."""
    path = spec_path(cdi_dir, claim.uid)
    data = json.dumps(spec(claim), indent=2, sort_keys=True).encode()
    with contextlib.suppress(FileNotFoundError):
        if path.read_bytes() == data:
            return path  # prepared already (a kubelet retry, or re-prepare after its restart)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # the runtime reads it
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return path


def remove(cdi_dir: str | Path, uid: str) -> bool:
    """Remove the claim's spec; False when there was none (unpreparing an unknown claim is fine)."""
    try:
        spec_path(cdi_dir, uid).unlink()
        return True
    except FileNotFoundError:
        return False


def read(cdi_dir: str | Path, uid: str) -> PreparedClaim | None:
    try:
        return from_spec(json.loads(spec_path(cdi_dir, uid).read_text()))
    except FileNotFoundError:
        return None


def prepared(cdi_dir: str | Path) -> tuple[list[PreparedClaim], list[str]]:
    """Every claim prepared on this node (from the directory), and the files that could not be read."""
    out: list[PreparedClaim] = []
    bad: list[str] = []
    d = Path(cdi_dir)
    if not d.is_dir():
        return out, bad
    for p in sorted(d.glob(f"{FILE_PREFIX}*.json")):
        try:
            out.append(from_spec(json.loads(p.read_text())))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            bad.append(f"{p.name}: {type(e).__name__}: {e}")
    return out, bad


def holds(cdi_dir: str | Path) -> dict[str, str]:
    """Slice device name -> the class of the claims prepared on it ("mixed" when both are)."""
    out: dict[str, str] = {}
    for c in prepared(cdi_dir)[0]:
        for d in c.devices:
            seen = out.get(d.device)
            out[d.device] = c.pod_class if seen in (None, c.pod_class) else "mixed"
    return out
