"""`ems.transport.tcp`: a node connection's lookup channel, a TCP socket of its own beside its UCX connection that
carries that connection's lookups (EXISTS), between hosts and on one host without shared memory.

Layout:
* `wire`: the protocol and the security model (LOOKUP_OPEN, the token, the channel's limits), what both sides keep;
* `client`: the client's end (`TcpLookups`, handed what it needs of its node client: `transport.base.NodeLink`);
* `server`: the node's end (`LookupService`: the listener, the tokens offered, each channel's lookups answered).

Both ends of the channel's socket are `transport.stream`'s (the client's) and `transport.stream_node`'s, which
shared memory's region channel uses too. The TCP medium imports no other medium.
"""

from ems.transport.tcp.wire import LookupSettings

__all__ = ["LookupSettings"]
