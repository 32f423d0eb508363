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
  `shm.server` ...).

Layering: the contract imports neither medium, and shared memory does not import UCX: `shm.client.ShmClient` is
handed what it needs of its node client (`shm.opening.NodeLink`) by that client (tests/test_layers.py). Of `ems` the
transport imports only leaf modules, never the store nor `ems.pool` (tests/transport/test_layering.py).
"""
