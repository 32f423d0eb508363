"""The ucxx and UCX internals this package relies on, beyond ucxx's public API, and a check that they are there.

Contract: `INTERNALS` lists each one as (where it lives, the name, which module of ours uses it and why);
`missing()` returns those the installed ucxx lacks, `check()` raises `RuntimeError` naming every missing one and
the ucxx version the package was tested with. `init_ucx` calls `check()` once per process, right after ucxx loads:
a moved internal then fails loudly at start instead of, say, the notifier replacement silently not applying (the
transport would still work, only slower) or a listener failing on its first connection. tests/transport/
test_ucxx_internals.py runs the same check and also fails when a module here imports a private ucxx name that this
table does not list.

pyproject.toml pins `ucxx-cu12` to the minor series these were read from (TESTED_UCXX); moving the pin means
reading each entry again against the new ucxx source.
"""

from __future__ import annotations

import ctypes
import importlib
from dataclasses import dataclass
from typing import Any

TESTED_UCXX = "0.52"


@dataclass(frozen=True)
class Internal:
    where: str  # a Python module, or "libucp" / "libucs" (a C symbol of the loaded library)
    name: str  # an attribute path below `where` ("UCXWorker.arm"), or a C symbol
    used_by: str  # our module, and what for


INTERNALS: tuple[Internal, ...] = (
    Internal("ucxx._lib_async.application_context", "_notifierThread", "ucx.config: replaced by a lighter notifier"),
    Internal("ucxx._lib_async.application_context", "ProgressTasks", "ucx.progress: the loop's progress driver"),
    Internal("ucxx._lib_async.listener", "exchange_peer_info", "ucx.endpoint: replaced by a bounded exchange"),
    Internal("ucxx._lib_async.endpoint", "Endpoint", "ucx.endpoint, ucx.listener: endpoints from raw ones"),
    Internal("ucxx._lib_async.utils", "hash64bits", "ucx.endpoint, ucx.progress, ucx.connector: message tags"),
    Internal("ucxx._lib.arr", "Array", "ucx.endpoint, ucx.progress, ucx.direct: buffers posted without ucxx's wrappers"),
    Internal("ucxx._lib.libucxx", "UCXXTag", "ucx.progress: tagged sends and receives"),
    Internal("ucxx._lib.libucxx", "UCXXTagMaskFull", "ucx.progress: tagged receives"),
    Internal("ucxx._lib.libucxx", "UCXEndpoint.create", "ucx.endpoint, ucx.connector: connect with a timeout"),
    Internal("ucxx._lib.libucxx", "UCXContext", "ucx.client_worker: the client's own UCX context"),
    Internal("ucxx._lib.libucxx", "UCXWorker", "ucx.client_worker: the client's worker (delayed submission, notifications)"),
    Internal("ucxx._lib.libucxx", "UCXWorker.start_progress_thread", "ucx.direct: the C++ progress thread"),
    Internal("ucxx._lib.libucxx", "UCXWorker.stop_progress_thread", "ucx.direct: stopped at exit"),
    Internal("ucxx._lib.libucxx", "UCXEndpoint.tag_send", "ucx.direct: posting a frame"),
    Internal("ucxx._lib.libucxx", "UCXEndpoint.tag_recv", "ucx.direct: posting a receive"),
    Internal("ucxx._lib.libucxx", "UCXEndpoint.stream_send", "ucx.connector: the peer-info exchange"),
    Internal("ucxx._lib.libucxx", "UCXEndpoint.stream_recv", "ucx.connector: the peer-info exchange"),
    Internal("ucxx._lib.libucxx", "UCXEndpoint.close_blocking", "ucx.direct, ucx.connector: aborting a connection"),
    Internal("ucxx._lib.libucxx", "UCXEndpoint.raise_on_error", "ucx.direct: a failed endpoint's error"),
    Internal("ucxx._lib.libucxx", "UCXRequest.completed", "ucx.direct: waits"),
    Internal("ucxx._lib.libucxx", "UCXRequest.check_error", "ucx.direct: a request's UCX error"),
    Internal("ucxx._lib.libucxx", "UCXListener.create", "ucx.listener: the endpoint factory"),
    Internal("ucxx._lib.libucxx", "PythonRequestNotifierWaitState.Ready", "ucx.config: the notifier"),
    Internal("ucxx._lib.libucxx", "PythonRequestNotifierWaitState.Shutdown", "ucx.config: the notifier"),
    Internal("ucxx._lib.libucxx", "UCXWorker.run_request_notifier", "ucx.config: the notifier; ucx.direct: waits"),
    Internal("ucxx._lib.libucxx", "UCXWorker.wait_request_notifier", "ucx.config: the notifier; ucx.direct: waits"),
    Internal("ucxx._lib.libucxx", "UCXWorker.populate_python_futures_pool", "ucx.config, ucx.direct: the notifier"),
    Internal("ucxx._lib.libucxx", "UCXWorker.clear_python_futures_pool", "ucx.config, ucx.direct: the notifier"),
    Internal("ucxx._lib.libucxx", "UCXWorker.init_blocking_progress_mode", "ucx.progress: loop progress"),
    Internal("ucxx._lib.libucxx", "UCXWorker.epoll_file_descriptor", "ucx.progress: loop progress"),
    Internal("ucxx._lib.libucxx", "UCXWorker.progress_once", "ucx.progress: loop progress"),
    Internal("ucxx._lib.libucxx", "UCXWorker.arm", "ucx.progress: loop progress"),
    Internal("ucxx.core", "_get_ctx", "ucx.config, ucx.endpoint, ucx.listener: the process's ucxx context"),
    Internal("ucxx.exceptions", "UCXCloseError", "ucx.progress: a closed endpoint's error"),
    Internal("ucxx", "stop_notifier_thread", "ems.pool, tests/ucx_loop.py: stopping UCX's threads at exit"),
    Internal("ucxx._lib.libucxx", "UCXWorker.handle", "ucx.client_worker: the worker's UCX handle, to signal it"),
    Internal("libucp", "ucp_worker_signal", "ucx.client_worker: waking the progress thread (direct submission)"),
    Internal("libucp", "ucp_ep_query", "ucx.endpoint: a connection's peer address"),
    Internal("libucp", "ucp_listener_create", "ucx.listener: listening on one address"),
    Internal("libucp", "ucp_listener_query", "ucx.listener: the bound port"),
    Internal("libucp", "ucp_listener_destroy", "ucx.listener"),
    Internal("libucp", "ucp_listener_reject", "ucx.listener"),
    Internal("libucs", "ucs_status_string", "ucx.listener: UCX's error text"),
)


def loaded_library(name: str) -> Any:
    """A UCX library this process has already loaded (through ucxx), e.g. "libucp", for its C symbols that ucxx
    does not expose."""
    with open("/proc/self/maps", encoding="ascii", errors="replace") as maps:
        for line in maps:
            if f"/{name}.so" in line:
                return ctypes.CDLL(line.split(None, 5)[-1].strip())
    raise OSError(f"{name} is not loaded (import ucxx first)")


def _present(internal: Internal) -> bool:
    if internal.where.startswith("lib"):
        try:
            return hasattr(loaded_library(internal.where), internal.name)
        except OSError:
            return False
    try:
        value: object = importlib.import_module(internal.where)
    except ImportError:
        return False
    for part in internal.name.split("."):
        if not hasattr(value, part):
            return False
        value = getattr(value, part)
    return True


def missing() -> list[Internal]:
    """The internals the installed ucxx lacks (imports ucxx: call it once UCX's environment is in place)."""
    return [internal for internal in INTERNALS if not _present(internal)]


def check() -> None:
    """Raise RuntimeError naming every internal the installed ucxx lacks."""
    gone = missing()
    if gone:
        import ucxx

        names = "; ".join(f"{i.where}.{i.name} (used by {i.used_by})" for i in gone)
        raise RuntimeError(
            f"ucxx {getattr(ucxx, '__version__', '?')} lacks internals ems.transport relies on (tested with ucxx "
            f"{TESTED_UCXX}; install 'ucxx-cu12=={TESTED_UCXX}.*'): {names}"
        )
