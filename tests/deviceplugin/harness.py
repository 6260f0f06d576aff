"""The kubelet's real device manager (``devicemanager-harness``, Kubernetes v1.28.7) driving the real
``gpupack device-plugin`` process.

The harness serves ``kubelet.sock`` in its own directory, starts the plugin with
``HARNESS_PLUGIN_CMD`` (or finds one already running), waits for its registration and device list,
then admits the pods of a pods file exactly as the kubelet does (``Allocate`` per init and app
container, device reuse between them, checkpoint) and prints JSON lines, which :class:`Harness`
collects. See ``../shared/k8s/README.md``.

Unix socket paths are limited to ~107 bytes, so every run lives in a short ``/tmp/dp*`` folder.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import realk8s

from gpupack.contract import RES_GPU

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def podresources_socket(kubelet_dir: str | Path) -> Path:
    """Where the PodResources emulator of a harness folder listens (beside ``k/``: the device
    manager deletes every file in its own folder when it starts)."""
    return Path(kubelet_dir).parent / "podres.sock"


def plugin_command(
    node: str,
    kubelet_dir: str | Path,
    kubeconfig: str | Path,
    nvml: Mapping[str, Any],
    *extra: str,
    podresources: bool = True,
) -> str:
    """Shell command running the real plugin process over the fake NVML of tests/deviceplugin, and
    beside it (same process group: stopped with it) the PodResources emulator its PreStartContainer
    asks (tests/deviceplugin/podresources_emulator.py). `podresources=False`: no emulator (the
    plugin then refuses every container start, fail closed)."""
    sock = podresources_socket(kubelet_dir)
    argv = [
        sys.executable, "-m", "gpupack", "device-plugin", "--node-name", node,
        "--kubelet-dir", str(kubelet_dir), "--kubeconfig", str(kubeconfig),
        "--pod-resources-socket", str(sock),
        "--nvml-module", "fake_nvml", "--nvml-config", json.dumps(dict(nvml)), "--probe-interval", "0.2", *extra,
    ]  # fmt: skip
    path = os.pathsep.join([str(HERE), str(REPO)])
    cmd = f"cd {shlex.quote(str(REPO))} || exit 1; "
    if podresources:
        emu = [
            sys.executable, str(HERE / "podresources_emulator.py"), "--socket", str(sock),
            "--checkpoint-dir", str(kubelet_dir), "--pods-glob", str(Path(kubelet_dir).parent / "pods*.json"),
        ]  # fmt: skip
        cmd += f"{shlex.join(emu)} & "
    # exec: the harness signals the plugin's process group; no shell left in between
    return cmd + f"PYTHONPATH={shlex.quote(path)} exec {shlex.join(argv)}"


def harness_pod(pod: Mapping[str, Any], expect_error: bool = False) -> dict[str, Any]:
    """A pods-file entry for an API pod (same uid, name, namespace; `gpupack.io/gpu` as `request`)."""

    def containers(lst: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for c in lst:
            limits = (c.get("resources") or {}).get("limits") or {}
            entry: dict[str, Any] = {"name": c["name"]}
            if RES_GPU in limits:
                entry["request"] = int(limits[RES_GPU])
            out.append(entry)
        return out

    meta, spec = pod["metadata"], pod["spec"]
    return {
        "uid": meta["uid"], "name": meta["name"], "namespace": meta["namespace"],
        "initContainers": containers(spec.get("initContainers") or []),
        "containers": containers(spec["containers"]), "expect_error": expect_error,
    }  # fmt: skip


class Harness:
    """One run of the device manager harness; events are collected as they arrive."""

    def __init__(self, base: Path, kubelet_dir: Path) -> None:
        self.base = base
        self.dir = kubelet_dir
        self.events: list[dict[str, Any]] = []
        self.proc: subprocess.Popen[str] | None = None
        self._cond = threading.Condition()
        self._reader: threading.Thread | None = None
        self.log = base / "harness.log"
        self.plugin_log = base / "plugin.log"
        self.runs = 0

    # -- running --
    def start(
        self,
        pods: Iterable[Mapping[str, Any]] = (),
        *,
        plugin_cmd: str | None = None,
        restart: str | None = None,
        restart_delay: float | None = None,
        pods_after_restart: bool = False,
        keep_checkpoint: bool = False,
        wait_s: float = 30,
        timeout_s: float = 120,
    ) -> Harness:
        """Start the harness. With `pods_after_restart`, write the second pods file with
        :meth:`write_pods_after_restart` before the plugin re-registers."""
        self.runs += 1
        self.events = []
        pods_file = self.base / f"pods-{self.runs}.json"
        pods_file.write_text(json.dumps(list(pods)))
        env = {
            **os.environ,
            "HARNESS_DIR": str(self.dir), "HARNESS_RESOURCE": RES_GPU, "HARNESS_WAIT": str(wait_s),
            "HARNESS_PODS": str(pods_file), "HARNESS_TIMEOUT": str(timeout_s),
            "HARNESS_PLUGIN_LOG": str(self.plugin_log.with_suffix(f".{self.runs}.log")),
        }  # fmt: skip
        if plugin_cmd:
            env["HARNESS_PLUGIN_CMD"] = plugin_cmd
        if restart:
            env["HARNESS_RESTART"] = restart
        if restart_delay is not None:
            env["HARNESS_RESTART_DELAY"] = str(restart_delay)
        if pods_after_restart:
            env["HARNESS_PODS_AFTER_RESTART"] = str(self.base / "pods-after.json")
        if keep_checkpoint:
            env["HARNESS_KEEP_CHECKPOINT"] = "1"
        with self.log.open("a") as log:
            self.proc = subprocess.Popen(
                [str(realk8s.binary("devicemanager-harness"))], env=env, stdout=subprocess.PIPE,
                stderr=log, text=True, start_new_session=True,
            )  # fmt: skip
        self._reader = threading.Thread(target=self._read, args=(self.proc,), daemon=True)
        self._reader.start()
        return self

    def write_pods_after_restart(self, pods: Iterable[Mapping[str, Any]]) -> None:
        tmp = self.base / "pods-after.json.tmp"
        tmp.write_text(json.dumps(list(pods)))
        os.replace(tmp, self.base / "pods-after.json")

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                ev = json.loads(line)
            except json.JSONDecodeError:
                ev = {"event": "unparsed", "line": line}
            with self._cond:
                self.events.append(ev)
                self._cond.notify_all()

    def wait_event(
        self, pred: Callable[[dict[str, Any]], bool], timeout: float = 30, what: str = "event"
    ) -> dict:
        end = time.monotonic() + timeout
        with self._cond:
            while True:
                for ev in self.events:
                    if pred(ev):
                        return ev
                left = end - time.monotonic()
                if left <= 0 or (self.proc is not None and self.proc.poll() is not None and self._done()):
                    raise AssertionError(f"harness: no {what} within {timeout:g}s\n{self.report()}")
                self._cond.wait(min(left, 0.2))

    def _done(self) -> bool:
        return any(e.get("event") == "done" for e in self.events)

    def finish(self, timeout: float = 60) -> int:
        """Wait for the run to end; its exit code (0 ok, 3 allocation errors, ...)."""
        assert self.proc is not None
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(f"harness still running after {timeout:g}s\n{self.report()}") from None
        if self._reader is not None:
            self._reader.join(5)
        return rc

    def run(self, pods: Iterable[Mapping[str, Any]] = (), **kw: Any) -> int:
        return self.start(pods, **kw).finish()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # the harness stops its plugin, then exits
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)

    # -- reading events --
    def of(self, kind: str) -> list[dict[str, Any]]:
        with self._cond:
            return [e for e in self.events if e.get("event") == kind]

    def allocations(self, uid: str) -> dict[str, dict[str, Any]]:
        """container name -> the "allocate" event (device IDs, env) of pod `uid`, in kubelet order."""
        return {e["container"]: e for e in self.of("allocate") if e["uid"] == uid}

    def errors(self) -> list[dict[str, Any]]:
        return self.of("error")

    def report(self) -> str:
        """Events and log tails, for assertion messages."""
        with self._cond:
            evs = "\n".join(json.dumps(e)[:600] for e in self.events[-30:])
        logs = []
        for f in [self.log, *sorted(self.base.glob("plugin.*.log"))]:
            if f.exists():
                logs.append(f"--- {f.name}\n{f.read_text()[-3000:]}")
        return f"events:\n{evs}\n" + "\n".join(logs)


class HarnessDir:
    """A short temp folder: the kubelet's device-plugin dir in ``k/``, pods files and logs beside it."""

    def __init__(self) -> None:
        self.base = Path(tempfile.mkdtemp(prefix="dp"))
        self.kubelet_dir = self.base / "k"
        self.kubelet_dir.mkdir()
        self.harness = Harness(self.base, self.kubelet_dir)

    def close(self) -> None:
        self.harness.stop()
        shutil.rmtree(self.base, ignore_errors=True)
