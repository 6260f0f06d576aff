"""A token of another ServiceAccount for a container beside this one, minted and kept fresh.

`python -m gpupack.token` runs in the scheduler pod (deploy/scheduler/deployment.yaml), once as an
init step and then as a sidecar that listens on nothing. With the pod's own account
(`gpupack-scheduler`, whose RBAC may create `serviceaccounts/token` for `gpupack-extender` only)
it asks the TokenRequest API for a token of `--service-account`, valid for `--expiry-s` and bound
to this pod's life, and writes into `--out-dir` (a memory emptyDir mounted only into the extender):

- `token`, replaced by a rename (a reader never sees half of one) at half its lifetime, so that an
  API server that is away for a while still finds the old token valid when it returns;
- `ca.crt`, the API server's CA as this process trusts it;
- `kubeconfig`, naming that server, that CA and `tokenFile: token`, for the extender's
  `--kubeconfig` (gpupack.kubeclient re-reads a tokenFile when it changes).

So the extender, which listens on the network, holds only its own account's rights, while the
pod keeps one identity for kube-scheduler and the certificate step.

Bound to the pod's life, not to the pod: the API server refuses to bind a token to a pod that runs
as another account ("cannot bind token for serviceaccount ... to pod running with different
serviceaccount name"). So the minter creates an empty Secret (type gpupack.io/token-binding) owned
by its pod and binds the token to that Secret: when the pod is deleted the garbage collector
deletes the Secret, and from then on the API server refuses the token, as it would a pod-bound one.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpupack import logs

PROG = "gpupack.token"
MIN_EXPIRY_S = 600  # the API server refuses a TokenRequest for less
BINDING_TYPE = "gpupack.io/token-binding"
log = logging.getLogger(PROG)


class TokenError(Exception):
    """A token request the API server refused or answered unusably: the message says what to fix."""


class Unbound(TokenError):
    """The Secret the token was to be bound to is gone: a new one is needed."""


@dataclass(frozen=True)
class Minted:
    token: str
    expires: dt.datetime


@dataclass(frozen=True)
class Binding:
    """The Secret a token is bound to (it dies with it)."""

    name: str
    uid: str


def binding_secret(
    api: Any, namespace: str, account: str, pod_name: str, pod_uid: str, timeout_s: float = 30.0
) -> Binding:
    """A new empty Secret owned by pod `pod_name`: the garbage collector deletes it with the pod."""
    from gpupack.kubeclient import ApiException, api_reason, bounded, request_json

    body = {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": BINDING_TYPE,
        "metadata": {
            "generateName": f"{account}-token-",
            "namespace": namespace,
            "labels": {"app.kubernetes.io/part-of": "gpupack", "gpupack.io/token-for": account},
            "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": pod_name, "uid": pod_uid}],
        },
    }
    try:
        out = bounded(request_json)(api, "POST", f"/api/v1/namespaces/{namespace}/secrets", body, timeout_s)
    except ApiException as e:
        hint = (
            f": this pod's ServiceAccount needs `create` on `secrets` in {namespace} (deploy/scheduler/rbac.yaml, "
            "Role gpupack-extender-token)"
            if e.status == 403
            else ""
        )
        raise TokenError(
            f"cannot create the Secret that binds the token to pod {pod_name}: {api_reason(e)}{hint}"
        ) from e
    except ValueError as e:
        raise TokenError(f"creating the binding Secret: {e}") from e
    meta = out.get("metadata") or {}
    return Binding(str(meta.get("name") or ""), str(meta.get("uid") or ""))


def request_token(
    api: Any,
    namespace: str,
    account: str,
    expiry_s: int,
    bound: Binding | None,
    timeout_s: float = 30.0,
) -> Minted:
    """One TokenRequest for `account`, bound to the Secret `bound` when given."""
    from gpupack.kubeclient import ApiException, api_reason, bounded, request_json

    spec: dict[str, Any] = {"expirationSeconds": expiry_s}
    if bound is not None:
        spec["boundObjectRef"] = {"apiVersion": "v1", "kind": "Secret", "name": bound.name, "uid": bound.uid}
    path = f"/api/v1/namespaces/{namespace}/serviceaccounts/{account}/token"
    try:
        out = bounded(request_json)(api, "POST", path, {"apiVersion": "authentication.k8s.io/v1",
                                                        "kind": "TokenRequest", "spec": spec}, timeout_s)  # fmt: skip
    except ApiException as e:
        if e.status == 403:
            raise TokenError(
                f"the API server refused a token of ServiceAccount {namespace}/{account} ({api_reason(e)}): "
                f"this pod's ServiceAccount needs `create` on `serviceaccounts/token` with resourceNames "
                f"[{account}] in {namespace} (deploy/scheduler/rbac.yaml, Role gpupack-extender-token)"
            ) from e
        if e.status == 404:
            raise TokenError(
                f"no ServiceAccount {namespace}/{account}: {api_reason(e)}; apply deploy/scheduler/serviceaccount.yaml"
            ) from e
        if e.status in (400, 422) and bound is not None:
            raise Unbound(f"token request for {namespace}/{account}: its binding Secret {bound.name} is gone or "
                          f"changed ({api_reason(e)})") from e  # fmt: skip
        raise TokenError(f"token request for {namespace}/{account} failed: {api_reason(e)}") from e
    except ValueError as e:
        raise TokenError(f"token request for {namespace}/{account}: {e}") from e
    status = out.get("status") or {}
    token, stamp = status.get("token"), status.get("expirationTimestamp")
    if not isinstance(token, str) or not token or not isinstance(stamp, str):
        raise TokenError(f"token request for {namespace}/{account}: the answer has no token or expiry")
    try:
        expires = dt.datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    except ValueError as e:
        raise TokenError(f"token request for {namespace}/{account}: bad expirationTimestamp {stamp!r}") from e
    return Minted(token, expires)


def _write(path: Path, data: bytes) -> None:
    """`data` to `path` by a rename: a reader sees the old file or the new one, whole."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def write_files(out: Path, minted: Minted, server: str, ca_pem: bytes) -> None:
    """token, ca.crt and a kubeconfig naming both, in `out`. The token goes last: a kubeconfig
    is never there without the token it names (the extender starts once the init step wrote all)."""
    out.mkdir(parents=True, exist_ok=True)
    if ca_pem:
        _write(out / "ca.crt", ca_pem)
    cluster: dict[str, Any] = {"server": server}
    if ca_pem:
        cluster["certificate-authority"] = "ca.crt"
    kubeconfig = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "cluster", "cluster": cluster}],
        "users": [{"name": "minted", "user": {"tokenFile": "token"}}],
        "contexts": [{"name": "minted", "context": {"cluster": "cluster", "user": "minted"}}],
        "current-context": "minted",
    }
    _write(out / "token", minted.token.encode())
    _write(out / "kubeconfig", json.dumps(kubeconfig, indent=1).encode())


def refresh_at(minted: Minted, now: dt.datetime) -> dt.datetime:
    """Half the token's remaining life from `now`: a refresh that fails can be retried for as long
    again before the old token expires."""
    return now + (minted.expires - now) / 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--service-account", required=True, help="the ServiceAccount whose token to mint")
    p.add_argument("--namespace", default=os.environ.get("POD_NAMESPACE", ""),
                   help="its namespace (default: $POD_NAMESPACE)")  # fmt: skip
    p.add_argument("--pod-name", default=os.environ.get("POD_NAME", ""),
                   help="the token dies with this pod (default: $POD_NAME; with --pod-uid)")  # fmt: skip
    p.add_argument(
        "--pod-uid", default=os.environ.get("POD_UID", ""), help="that pod's uid (default: $POD_UID)"
    )
    p.add_argument("--expiry-s", type=int, default=1800, help=f"token lifetime, at least {MIN_EXPIRY_S}")
    p.add_argument("--out-dir", required=True, help="write token, ca.crt and kubeconfig here")
    p.add_argument("--once", action="store_true", help="mint one token and exit (the init step)")
    p.add_argument("--retry-s", type=float, default=10.0, help="seconds between attempts after a failure")
    p.add_argument(
        "--kubeconfig", default=None, help="kubeconfig file (default: in-cluster, then $KUBECONFIG)"
    )
    logs.add_log_flags(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    logs.setup(args)
    if not args.namespace:
        print(f"{PROG}: --namespace is required outside a pod", file=sys.stderr)
        return 2
    if args.expiry_s < MIN_EXPIRY_S:
        print(
            f"{PROG}: --expiry-s must be at least {MIN_EXPIRY_S} (the API server's minimum)", file=sys.stderr
        )
        return 2
    if bool(args.pod_name) != bool(args.pod_uid):
        print(f"{PROG}: --pod-name and --pod-uid go together", file=sys.stderr)
        return 2
    from gpupack.kubeclient import KubeConfigError, api_client

    try:
        api = api_client(args.kubeconfig)
    except KubeConfigError as e:
        print(f"{PROG}: no Kubernetes credentials: {e}", file=sys.stderr)
        return 1
    ca_file = api.configuration.ssl_ca_cert
    ca_pem = Path(ca_file).read_bytes() if ca_file else b""
    out = Path(args.out_dir)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    if not args.pod_name:
        log.warning("no --pod-name: the token is bound to no pod and lives until it expires")
    bound: Binding | None = None
    while True:
        try:
            if args.pod_name and bound is None:
                bound = binding_secret(api, args.namespace, args.service_account, args.pod_name, args.pod_uid)
            minted = request_token(api, args.namespace, args.service_account, args.expiry_s, bound)
            write_files(out, minted, str(api.configuration.host), ca_pem)
        except (TokenError, OSError) as e:
            if isinstance(e, Unbound):
                bound = None  # someone deleted it: the next attempt makes another
            if args.once:
                print(f"{PROG}: {e}", file=sys.stderr)
                return 1
            log.error("%s; the token in %s stays until it expires; retrying in %.0f s", e, out, args.retry_s)
            if stop.wait(args.retry_s):
                return 0
            continue
        now = dt.datetime.now(dt.UTC)
        log.info("token of %s/%s written to %s, valid until %s", args.namespace, args.service_account, out,
                 minted.expires.isoformat())  # fmt: skip
        if args.once:
            return 0
        wait_s = max((refresh_at(minted, now) - now).total_seconds(), 1.0)
        if stop.wait(wait_s):
            return 0


if __name__ == "__main__":
    sys.exit(main())
