"""The disk tier's write helper: a small process that writes record files from the write ring (shared memory), so
the node's Python threads never wait on each file's system calls.

Why a process: in the node, a writer thread must take the interpreter lock back after every system call (open,
write, close, rename), and the node's event loop holds that lock while it serves: measured, a record write took
5x as long next to a busy Python thread as alone, and the loop lost time at each hand-over. The helper has an
interpreter of its own; the node hands it a batch of records in one pipe write and reads the batch's results in
one pipe read.

Contract:
* Started by `WriteHelper(ring_fd, size)`: runs this file (stdlib only: it imports nothing of `ems`, so it starts
  in milliseconds) with the ring's memfd, and exits when its stdin closes (the node stopped or died).
* `write_batch(jobs)`: each job (ring offset, bytes, file to reuse or "", file to write) is written: the reused file
  is renamed to the target first (an existing file of exactly that size, overwritten in place), else the target
  is created; the bytes are written with O_DIRECT when `direct`. Returns each job's errno (0: written). A failed
  job's target is removed. Jobs of one batch run in order.
* The helper gone (killed, crashed) raises `OSError(EPIPE)` from `write_batch`: the caller turns the tier off.
* Wire (little-endian): a batch is `<I count>` then per job `<QQHH offset nbytes len(reuse) len(target)>`, the two
  paths (UTF-8); the reply is `<i>` per job.
"""

from __future__ import annotations

import errno
import mmap
import os
import struct
import subprocess
import sys
from collections.abc import Sequence

_COUNT = struct.Struct("<I")
_JOB = struct.Struct("<QQHH")
_RESULT = struct.Struct("<i")


def _read_exact(fd: int, n: int) -> bytes:
    chunks = []
    while n:
        chunk = os.read(fd, n)
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


class WriteHelper:
    """The node's side of the helper process (used by the disk tier's writer thread only)."""

    def __init__(self, ring_fd: int, size: int, direct: bool) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-S", os.path.abspath(__file__), str(ring_fd), str(size), "1" if direct else "0"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            pass_fds=(ring_fd,),
            close_fds=True,
        )
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._to = self._proc.stdin.fileno()
        self._from = self._proc.stdout.fileno()

    def write_batch(self, jobs: Sequence[tuple[int, int, str, str]]) -> list[int]:
        parts = [_COUNT.pack(len(jobs))]
        for offset, nbytes, reuse, target in jobs:
            r, t = reuse.encode(), target.encode()
            parts += [_JOB.pack(offset, nbytes, len(r), len(t)), r, t]
        message = memoryview(b"".join(parts))
        try:
            while message:
                message = message[os.write(self._to, message) :]
            reply = _read_exact(self._from, _RESULT.size * len(jobs))
        except (OSError, EOFError) as error:
            raise OSError(errno.EPIPE, f"the disk write helper is gone ({error})") from error
        return [code for (code,) in _RESULT.iter_unpack(reply)]

    def close(self) -> None:
        for stream in (self._proc.stdin, self._proc.stdout):
            if stream is not None:
                stream.close()
        try:
            self._proc.wait(5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(5)


def _write_one(ring: memoryview, offset: int, nbytes: int, reuse: str, target: str, direct: int) -> int:
    try:
        if reuse:
            os.rename(reuse, target)
            fd = os.open(target, os.O_WRONLY | direct)
        else:
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | direct, 0o600)
        try:
            data = ring[offset : offset + nbytes]
            done = 0
            while done < nbytes:
                done += os.pwrite(fd, data[done:], done)
        finally:
            os.close(fd)
        return 0
    except OSError as error:
        try:
            os.unlink(target)
        except OSError:
            pass
        return error.errno or errno.EIO


def _serve(ring_fd: int, size: int, direct: int) -> None:
    ring = memoryview(mmap.mmap(ring_fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ))
    source, sink = sys.stdin.buffer.fileno(), sys.stdout.buffer.fileno()
    while True:
        try:
            (count,) = _COUNT.unpack(_read_exact(source, _COUNT.size))
            results = []
            for _ in range(count):
                offset, nbytes, reuse_len, target_len = _JOB.unpack(_read_exact(source, _JOB.size))
                reuse = _read_exact(source, reuse_len).decode() if reuse_len else ""
                target = _read_exact(source, target_len).decode()
                results.append(_write_one(ring, offset, nbytes, reuse, target, direct))
            reply = memoryview(b"".join(_RESULT.pack(code) for code in results))
            while reply:
                reply = reply[os.write(sink, reply) :]
        except (EOFError, BrokenPipeError):
            return


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]), getattr(os, "O_DIRECT", 0) if sys.argv[3] == "1" else 0)
