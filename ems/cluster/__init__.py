"""Which pool nodes there are and which of them holds a key: membership and placement, in one place.

* `etcd`: a small etcd v3 client (etcd's JSON gateway, stdlib only); etcd holds who is in the pool, never data.
* `membership`: nodes register themselves in etcd (`Registration`, node side); engines watch the live set
  (`MembershipWatcher`).
* `routing`: key → node(s) by rendezvous hashing (`owners`, `ranked_owners`), the same on every client.
* `placement`: `Members`, the live set a `PoolClient` places keys on, changed by membership while calls run.

This package imports nothing at import time (a pool node uses `membership` and `etcd` without the client side), and
nothing of the pool backends: they build on it (`ems.backends.remote_pool` opens a pool client over these members).
"""
