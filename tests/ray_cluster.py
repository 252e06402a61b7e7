"""A real Ray cluster on 127.0.0.1 for the tests: a head and worker nodes, each `ray start --block` with one CPU in a
session of its own, so that one node can be killed (every process of its session) and the cluster stopped without
`ray stop`, which would stop a user's Ray too."""

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from mergeflow.demo.fsdp import _free_port

START_SECONDS = 90
STOP_SECONDS = 10
HEALTH_CHECKS = {"RAY_health_check_period_ms": "500", "RAY_health_check_failure_threshold": "4"}
"""The head declares a killed node dead within about two seconds (Ray's default waits fifteen)."""


class LocalRayCluster:
    """A head node and worker nodes on this machine; `address` is the head's GCS address, `dashboard` the address
    of Ray's state API."""

    def __init__(self, temp_dir: Path, env: dict[str, str]):
        self.temp_dir = temp_dir
        self.env = {**env, "RAY_USAGE_STATS_ENABLED": "0", **HEALTH_CHECKS}
        self.address = f"127.0.0.1:{_free_port()}"
        self.dashboard = f"http://127.0.0.1:{_free_port()}"
        self.client_address = f"ray://127.0.0.1:{_free_port()}"
        """The head's Ray Client address."""
        self.nodes: list[subprocess.Popen] = []

    def start(self, worker_nodes: int = 1) -> "LocalRayCluster":
        self._start_node(
            "--head", f"--port={self.address.rpartition(':')[2]}", f"--temp-dir={self.temp_dir}",
            "--include-dashboard=true", f"--dashboard-port={self.dashboard.rpartition(':')[2]}",
            f"--ray-client-server-port={self.client_address.rpartition(':')[2]}", "--disable-usage-stats",
        )  # fmt: skip
        self._wait_for_nodes(1)
        for _ in range(worker_nodes):
            self.add_worker_node()
        return self

    def add_worker_node(self, **env: str) -> subprocess.Popen:
        """Start one more worker node (its Ray workers see `env` besides the cluster's), once it has joined."""
        node = self._start_node(f"--address={self.address}", **env)
        self._wait_for_nodes(len(self.nodes))
        return node

    def kill_node(self, node: subprocess.Popen) -> None:
        """SIGKILL every process of the node's session (its raylet and Ray workers), as a lost machine."""
        _kill_session(node)
        self.nodes.remove(node)
        self._wait_for_nodes(len(self.nodes))

    def stop(self) -> None:
        """SIGTERM every node's session, and SIGKILL what is left of it after a few seconds."""
        for node in reversed(self.nodes):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_SECONDS
        for node in self.nodes:
            try:
                node.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                _kill_session(node)

    def node_ids(self) -> set[str]:
        """The ids of the alive nodes, from Ray's state API."""
        from ray.util.state import list_nodes

        return {node.node_id for node in list_nodes(address=self.dashboard) if node.state == "ALIVE"}

    def _start_node(self, *arguments: str, **env: str) -> subprocess.Popen:
        node = subprocess.Popen(
            [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--node-ip-address=127.0.0.1",
             "--num-cpus=1", *_own_agent_ports(), *arguments],
            env={**self.env, **env},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        self.nodes.append(node)
        return node

    def _wait_for_nodes(self, count: int) -> None:
        deadline = time.monotonic() + START_SECONDS
        while True:
            if any(node.poll() is not None for node in self.nodes):
                raise RuntimeError(f"a Ray node exited while starting; logs in {self.temp_dir}")
            try:
                if len(self.node_ids()) == count:
                    return
            except Exception:
                if time.monotonic() > deadline:
                    raise
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Ray cluster did not have {count} alive nodes within {START_SECONDS} s")
            time.sleep(0.5)


def _own_agent_ports() -> list[str]:
    """Free ports for a node's agents: their fixed defaults (52365 and others) clash between nodes on one host."""
    flags = ("--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--runtime-env-agent-port", "--metrics-export-port")
    return [f"{flag}={_free_port()}" for flag in flags]


def _kill_session(node: subprocess.Popen) -> None:
    """SIGKILL every process of the session `node` leads, and reap it."""
    for process in psutil.process_iter():
        try:
            if os.getsid(process.pid) == node.pid:
                process.kill()
        except (ProcessLookupError, psutil.Error):
            continue
    node.wait()
