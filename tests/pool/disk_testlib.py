"""Helpers for tests of pool nodes with a disk tier (`--disk`): start one on a directory, read its tier metrics,
wait for its write queue, damage its record files, mount a small filesystem."""

from __future__ import annotations

import contextlib
import os
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster_testlib import free_port
from pool_testlib import PoolProcess, wait_until

parser = pytest.importorskip("prometheus_client.parser")


class DiskNode:
    """A `PoolProcess` with `--disk DIR` and a metrics endpoint; `restart(kill=...)` starts it again on DIR."""

    def __init__(
        self,
        disk: Path,
        capacity: str = "4MiB",
        disk_capacity: str = "64MiB",
        keys: dict[str, str] | None = None,
        queue: str | None = "256MiB",
        extra: tuple = (),
    ) -> None:
        """`queue`: the write ring (`--disk-queue`; None: the node's default); the default here is large enough
        that the tests' bursts are never dropped however slowly the shared disk writes."""
        self.disk = disk
        self.metrics = f"127.0.0.1:{free_port()}"
        ring = ("--disk-queue", queue) if queue is not None else ()
        args = ("--disk", str(disk), "--disk-capacity", disk_capacity, *ring, "--metrics", self.metrics, *extra)
        self.process = PoolProcess(capacity, keys, args=args)

    @property
    def address(self) -> str:
        return self.process.address

    def scrape(self) -> dict:
        with urllib.request.urlopen(f"http://{self.metrics}/metrics", timeout=5) as r:
            text = r.read().decode()
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in parser.text_string_to_metric_families(text)
            for s in family.samples
        }

    def tier(self, name: str, tier: str = "disk") -> float:
        return self.scrape().get((name, (("tier", tier),)), 0.0)

    def drained(self, timeout_s: float = 20.0) -> bool:
        """Wait until no evicted value waits to be written."""
        return wait_until(lambda: self.scrape()[("ems_pool_disk_queued_values", ())] == 0, timeout_s)

    def restart(self, kill: bool = True) -> None:
        """SIGKILL (or SIGTERM) and start again on the same directory and port."""
        if kill:
            self.process.restart()
        else:
            assert self.process.terminate() == 0
            self.process.start()

    def cleanup(self) -> None:
        self.process.cleanup()


@pytest.fixture
def disk_nodes():
    """`start(disk_dir, **kw)` → a running `DiskNode`; all are killed when the test ends."""
    started: list[DiskNode] = []

    def start(disk: Path, **kwargs) -> DiskNode:
        node = DiskNode(disk, **kwargs)
        started.append(node)
        return node

    yield start
    for node in started:
        node.cleanup()


def record_files(disk: Path) -> list[Path]:
    return sorted(disk.glob("*/*.rec"))


@contextlib.contextmanager
def small_filesystem(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` mounted at `path` (root only; the test is skipped where mounting is not allowed)."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode(errors='replace').strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)
