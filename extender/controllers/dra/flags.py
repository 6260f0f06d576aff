"""`gpupack extender`'s flags for the DRA allocator (extender/controllers/dra/controller.py) and its
start from them: off unless --dra-allocate is given; the class names are checked before it starts."""

from __future__ import annotations

import argparse
import logging
import re
import socket
from collections.abc import Callable

from kubernetes import client
from prometheus_client.registry import CollectorRegistry

from gpupack.core.policy_base import Policy
from gpupack.events import EventRecorder
from gpupack.kubeclient import KubeClient

from .controller import DraAllocator
from .metrics import register

log = logging.getLogger("gpupack.extender.dra")
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")


def _class_name(v: str) -> str:
    """A DeviceClass name, checked as the flag is parsed (a bad one is argparse's one line, status 2)."""
    if not _NAME.match(v):
        raise argparse.ArgumentTypeError(f"{v[:80]!r} is not a DeviceClass name")
    return v


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dra-allocate",
        action="store_true",
        help="allocate the gpu.gpupack.io ResourceClaims of pods gated by gpupack.io/dra-allocate "
        "(node and GPU chosen by the policy), then ungate them (docs/dra.md)",
    )
    p.add_argument(
        "--dra-place-pods",
        action="store_true",
        help="with --dra-allocate: a gated pod with no gpupack claims gets the node gpupack's policy "
        "picks (a required node affinity) as it is ungated, as the extender places CPU pods",
    )
    p.add_argument("--dra-online-class", action="append", default=None, type=_class_name,
                   help="DeviceClass whose claims are online (repeatable; default gpupack-online)")  # fmt: skip
    p.add_argument("--dra-offline-class", action="append", default=None, type=_class_name,
                   help="DeviceClass whose claims are offline (repeatable; default gpupack-offline)")  # fmt: skip


def classes_from_args(args: argparse.Namespace) -> dict[str, str]:
    """DeviceClass -> online/offline; ValueError for a name that is not a DeviceClass name or is
    given as both."""
    online = args.dra_online_class or ["gpupack-online"]
    offline = args.dra_offline_class or ["gpupack-offline"]
    out: dict[str, str] = {}
    for cls, names in (("online", online), ("offline", offline)):
        for n in names:
            if not _NAME.match(n):
                raise ValueError(f"--dra-{cls}-class: {n[:80]!r} is not a DeviceClass name")
            if out.get(n, cls) != cls:
                raise ValueError(f"DeviceClass {n} is given as both online and offline")
            out[n] = cls
    return out


def start_from_args(
    args: argparse.Namespace,
    api: client.ApiClient,
    fence: Callable[[], str] | None,
    policy: Policy,
    registry: CollectorRegistry | None = None,
) -> DraAllocator | None:
    if not getattr(args, "dra_allocate", False):
        return None
    classes = classes_from_args(args)
    identity = getattr(args, "identity", "") or socket.gethostname()
    events = EventRecorder(KubeClient(api, timeout_s=10.0), identity, "gpupack-dra-allocator")
    alloc = DraAllocator(api, policy, classes, events, fence, place_pods=args.dra_place_pods)
    if registry is not None:  # the extender's /metrics
        register(registry, lambda: alloc.counts)
    alloc.start()
    log.info("DRA allocator on: classes %s", ", ".join(f"{k}={v}" for k, v in sorted(classes.items())))
    return alloc
