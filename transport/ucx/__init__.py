"""The transport over UCX (ucxx): a remote pool node's client and the node's sessions.

Layout:
* the client: `client` (`UcxNode`, a `NodeClient` for one remote node; it hands same-host calls to `transport.shm`),
  `client_requests` (each request's frames), `connector` (its connection: made, authenticated, backed off),
  `remote` (`connect(address, ...)`: the node client of one configured address), `direct` (its calls posted and
  waited for on the calling thread) and `client_worker` (the process's client UCX worker);
* the node's sessions: `server` (`PoolServer`: the listener and each connection's loop), `connections` (admission,
  tags, watchdog), `handshake`, `channel` (one request's frames and reply), `listener`, `endpoint`, `sockets`
  (abandoned TCP connections reaped), `unexpected` (messages nobody will receive, discarded);
* both sides: `frames` (the framings on UCX and length-checked frames), `progress` (UCX progressed on a node's event
  loop), `config` (UCX's environment and the transport's UCX settings) and `ucxx_internals` (the ucxx internals all of
  it relies on).

Layering: this subpackage builds on the transport's contract (`transport.base`, `protocol`, `auth`, `holds`,
`handler`, `scratch`) and on `transport.shm` (the client's same-host path); neither imports it
(tests/test_layers.py).
"""
