"""`ems.transport`: how a pool node is reached and served, by medium.

Layout:
* the contract, here (what the client and the node of every medium share): `base` (`NodeClient`, `TransportError`,
  how a failure ended a connection), `protocol` (the wire protocol: headers, ops, request limits), `auth`
  (challenge-response), `holds` (an EXISTS's leases and pins), `handler` (what the node's sessions ask of the node
  they serve), `scratch` (reusable buffers for packed segments) and `inprocess` (a store in this process served as
  a node);
* `ucx/`: the client and the node's sessions over UCX (`ucx.client.UcxNode`, `ucx.remote.connect`,
  `ucx.server.PoolServer`);
* `shm/`: same-host shared memory beside a UCX connection (its protocol in `shm.wire`; `shm.client`,
  `shm.server` ...);
* `tcp/`: a UCX connection's lookup channel, a TCP socket of its own for its lookups (its protocol in `tcp.wire`;
  `tcp.client`, `tcp.server`); `stream` holds both ends of a request channel on a stream socket, which it and
  shared memory's region channel use.

Layering: the contract imports no medium, and shared memory and the lookup channel import no other medium:
`shm.client.ShmClient` and `tcp.client.TcpLookups` are handed what they need of their node client
(`base.NodeLink`) by that client (tests/test_layers.py). Of `ems` the
transport imports only leaf modules, never the store nor `ems.pool` (tests/transport/test_layering.py).
"""
