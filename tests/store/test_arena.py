"""The store's arena reserves address space, not memory: a store whose capacity exceeds the host's memory is built,
and the process holding it can still start subprocesses (an engine starts its pool node so)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from ems.store.kv_store import KvStore


def _host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _vm_flags_of(address: int) -> list[str]:
    """The kernel's flags for the mapping holding `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                begin, end = (int(x, 16) for x in head.split("-"))
                inside = begin <= address < end
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's overcommit accounting")
def test_a_store_larger_than_the_host_is_address_space_and_the_process_still_forks():
    payload = np.arange(4096, dtype=np.uint8)
    store = KvStore(2 * _host_memory_bytes(), verify_on_put=False, prefault_ahead=1 << 20)
    try:
        assert store.put(b"k", [payload])
        (got,), (address,) = store.get_many_with_addresses([b"k"])
        assert got is not None and address is not None and bytes(got) == payload.tobytes()
        flags = _vm_flags_of(address)  # the value lies in the arena's mapping: reserved, not charged
        assert "nr" in flags and "ac" not in flags, flags
        child = subprocess.run([sys.executable, "-c", "print('started')"], capture_output=True, text=True, timeout=60)
        assert child.stdout.strip() == "started"
    finally:
        store.close()
