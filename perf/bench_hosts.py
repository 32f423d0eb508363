"""The pool across hosts: one client host, node hosts and an etcd host, each a network namespace behind one bridge,
every node host's link limited to 4 Gbit/s each way by a token bucket (`tests/pool/hosts_testlib.py`; this kernel has
no netem: no delay is added, a round trip is what the veths and the bridge cost). Everything runs in one run, side by
side, so the ratios hold even on a busy machine. Needs root (network namespaces), iperf3 and etcd.

Sections (`--only` picks some):
* `link`: iperf3 client->node and node->client (3 s each, one TCP stream), UCX's own tag bandwidth each way
  (`ucx_perftest -t tag_bw`, 32 MiB messages: the transport the API rides on), TCP round trip (8-byte ping-pong,
  median of 2,000), next to `ContextCaching.exists` of one block (median of 1,000 calls) and, for its stage timings,
  a 32 MiB save and load through the API to one node (32 blocks of 1 MiB: 16 layers x 8 KV heads x 128 fp16,
  16 tokens a block), best and median of N rounds, with the stages of the best.
* `calls`: where one block's `exists` goes, layer by layer (the API, the pool client, `UcxNode.exists` and the part
  of it spent waiting for UCX, `UcxNode.ping`, the node's handler from its metrics), next to a TCP round trip and
  UCX's own tag ping-pong (`ucx_perftest`, busy polling and sleeping in epoll) between the same two hosts; one
  engine per client submission mode (`--submit`, `EMS_UCX_CLIENT_SUBMIT`; `MODE+mutex`: that mode with UCX's worker
  lock a mutex, `UCX_USE_MT_MUTEX=y`), rounds alternating, each with a 32 MiB save and load (best / median).
* `lookups`: `ContextCaching.exists` of one block from the client host, on the lookup channel (a node host with the
  default `--lookup-port`) and over UCX (another node host with `--lookup-port off`), one engine each, rounds of 200
  calls alternating (median and p99 of all), next to each host's TCP round trip and the node client's own `exists`
  and `ping` (UCX); recorded in perf/results/hosts-lookups.json.
* `fanout`: a load of 96 blocks spread over three node hosts (each ~32 MiB) next to each node's share alone (its
  blocks only): the fan-out's time against the slowest share's, each node's requests inside the fastest, and the
  client's CPU time by thread in the fastest load of each kind.
* `scenario`: the issue's rows on etcd membership with replicas=2 of 3 nodes: one node killed (blocks exact), another
  partitioned (each call bounded by its 2 s timeout, none wrong), the killed node restarted empty and the partition
  healed: seconds until every block is back to two copies or more (each node asked directly) and until repair
  reports done on every node (metrics); 15 s after the heal, a third node lost: blocks loaded. Twice: the partition
  lasting one load of the blocks (~2 s), then held 30 s.
* `repair`: four nodes (replicas=2) holding 256 MiB of 1 MiB values; one is killed: how long the survivors take to
  bring every value back to two copies, at the default `--repair-rate` (64 MiB/s) and unbounded, and the latency of
  one-block loads meanwhile (p50/p99) next to the same loads before the kill.
* `slow`: replicas=2 over three nodes, one node's link squeezed to 8 Mbit/s each way: p50/p99 of one-block loads
  (64 KiB blocks) with hedging on and off (`EMS_POOL_HEDGE`), and of the same loads with no slow node.

* `sweep` (not in the default run): `link`'s save and load under other UCX and chunk settings, one at a time.

Usage: python perf/bench_hosts.py [--only link,calls,lookups,fanout,scenario,repair,slow,sweep] [--rounds N] [--rate 4gbit]
       [--submit delayed,direct]
Prints tables (markdown) for perf/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "pool"))
sys.path.insert(0, str(ROOT / "tests"))

from benchlib import machine, percentile  # noqa: E402
from cluster_testlib import Engine  # noqa: E402
from hosts_testlib import HostCluster, HostEtcd, HostNode, unavailable  # noqa: E402
from results import Figure, Goal, Run, command_line, markdown, record  # noqa: E402

MIB = 1 << 20
BIG = {"layers": 16, "heads": 8, "head_size": 128, "block_size": 16}  # 1 MiB blocks (fp16 K and V)
SMALL = {"layers": 4, "heads": 4, "head_size": 64, "block_size": 16}  # 64 KiB blocks


def block_bytes(geometry: dict) -> int:
    return 2 * geometry["layers"] * geometry["block_size"] * geometry["heads"] * geometry["head_size"] * 2


def iperf(hosts: HostCluster, client: str, server: str, reverse: bool, seconds: int = 3) -> float:
    """GB/s of one TCP stream, server -> client when `reverse` (a load's direction), else client -> server."""
    srv = hosts.popen(server, ["iperf3", "-s", "-1", "-p", "5299"], stdout=-3, stderr=-3)
    time.sleep(0.5)
    argv = ["iperf3", "-c", hosts.ip(server), "-p", "5299", "-t", str(seconds), "-J"] + (["-R"] if reverse else [])
    out = hosts.run(client, argv, timeout_s=seconds + 30)
    srv.wait(10)
    return json.loads(out.stdout)["end"]["sum_received"]["bits_per_second"] / 8e9


PINGPONG = r"""
import socket, sys, time, statistics
mode, host = sys.argv[1], sys.argv[2]
if mode == "serve":
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((host, 5298)); s.listen(1)
    c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:
        d = c.recv(8)
        if not d: break
        c.sendall(d)
else:
    c = socket.create_connection((host, 5298)); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    t = []
    for _ in range(2200):
        a = time.perf_counter(); c.sendall(b"12345678"); c.recv(8); t.append(time.perf_counter() - a)
    print(statistics.median(t[200:]))
"""


def tcp_rtt(hosts: HostCluster, client: str, server: str) -> float:
    srv = hosts.popen(server, [sys.executable, "-c", PINGPONG, "serve", hosts.ip(server)])
    time.sleep(0.5)
    out = hosts.run(client, [sys.executable, "-c", PINGPONG, "client", hosts.ip(server)])
    srv.kill()
    return float(out.stdout.strip())


class Bench:
    def __init__(self, nodes: int, rate: str) -> None:
        self.names = [f"n{i + 1}" for i in range(nodes)]
        self.hosts = HostCluster(["etcd", "client", *self.names], rate, shaped=self.names)
        for name in self.names:
            self.hosts.shape(name, rate, ingress=True)
        self.etcd: HostEtcd | None = None
        self.nodes: dict[str, HostNode] = {}
        self.engines: list[Engine] = []

    def start_etcd(self) -> str:
        self.etcd = HostEtcd(self.hosts, "etcd")
        return self.etcd.url

    def node(self, host: str, *args: str, capacity: str = "1GiB", etcd: bool = False) -> HostNode:
        node = HostNode(self.hosts, host, self.etcd.url if etcd and self.etcd else None, capacity, args)
        self.nodes[host] = node
        return node

    def engine(self, **config) -> Engine:
        engine = Engine(self.hosts.exec_prefix("client"), **config)
        self.engines.append(engine)
        return engine

    def close(self) -> None:
        for e in self.engines:
            e.close()
        for n in self.nodes.values():
            n.cleanup()
        if self.etcd is not None:
            self.etcd.cleanup()
        self.hosts.close()


def section_link(rate: str, rounds: int) -> str:
    b = Bench(1, rate)
    try:
        up, down = iperf(b.hosts, "client", "n1", False), iperf(b.hosts, "client", "n1", True)
        ucx_up, ucx_down = ucx_perftest_bw(b.hosts, "client", "n1"), ucx_perftest_bw(b.hosts, "n1", "client")
        rtt = tcp_rtt(b.hosts, "client", "n1")
        node = b.node("n1")
        e = b.engine(nodes=[node.address], replicas=1, timeout_ms=60_000, blocks=64, **BIG)
        blocks = list(range(32))
        nbytes = 32 * (block_bytes(BIG) + 40)
        saves, loads = [], []
        save_stages, load_stages = {}, {}
        for r in range(rounds + 2):
            s = e.call(op="bulk", what="save", blocks=blocks, rounds=1, base=10_000 * (r + 1), timeout_s=600)
            ld = e.call(op="bulk", what="load", blocks=blocks, rounds=1, base=10_000 * (r + 1), timeout_s=600)
            assert s["success"] == [32] and ld["success"] == [32], (s, ld)
            if r >= 2:  # two rounds warm up (connection, staging, the node's memory)
                if not saves or s["seconds"][0] < min(saves):
                    save_stages = s["stages"]
                if not loads or ld["seconds"][0] < min(loads):
                    load_stages = ld["stages"]
                saves.append(s["seconds"][0])
                loads.append(ld["seconds"][0])
        e.call(op="save", blocks=[0])
        exists = e.call(op="timed", what="exists", blocks=[0], rounds=1000, timeout_s=600)["seconds"]
        probe = e.call(op="probe", rounds=1000, timeout_s=600)
    finally:
        b.close()
    ex = statistics.median(exists)
    best_s, best_l = nbytes / min(saves) / 1e9, nbytes / min(loads) / 1e9
    med_s, med_l = nbytes / statistics.median(saves) / 1e9, nbytes / statistics.median(loads) / 1e9
    lines = [
        f"Link {rate} each way; iperf3 client->node {up:.3f} GB/s, node->client {down:.3f} GB/s; TCP round trip "
        f"{rtt * 1e6:.0f} us (median)",
        "",
        "| what | through the API | reference | ratio (best) | ratio (median) |",
        "|---|---|---|---|---|",
        f"| 32 MiB save (best / median of {rounds}) | {best_s:.3f} / {med_s:.3f} GB/s | iperf3 {up:.3f} GB/s "
        f"| {best_s / up:.2f}x | {med_s / up:.2f}x |",
        f"| 32 MiB load | {best_l:.3f} / {med_l:.3f} GB/s | iperf3 {down:.3f} GB/s | {best_l / down:.2f}x "
        f"| {med_l / down:.2f}x |",
        f"| UCX's own tag bandwidth, 32 MiB messages (`ucx_perftest -t tag_bw`), client->node / node->client "
        f"| {ucx_up:.3f} / {ucx_down:.3f} GB/s | iperf3 {up:.3f} / {down:.3f} GB/s | {ucx_up / up:.2f}x / "
        f"{ucx_down / down:.2f}x | |",
        f"| 32 MiB save / load through the API against UCX's own | | | {best_s / ucx_up:.2f}x / {best_l / ucx_down:.2f}x "
        f"| {med_s / ucx_up:.2f}x / {med_l / ucx_down:.2f}x |",
        f"| exists of one block (median of 1000; p99 {percentile(exists, 0.99) * 1e6:.0f} us) | {ex * 1e6:.0f} us "
        f"| TCP round trip {rtt * 1e6:.0f} us | RTT + {(ex - rtt) * 1e6:.0f} us | |",
        f"| the same, `UcxNode.exists` alone / `UcxNode.ping` (header only) | {statistics.median(probe['exists']) * 1e6:.0f}"
        f" / {statistics.median(probe['ping']) * 1e6:.0f} us | TCP round trip {rtt * 1e6:.0f} us | | |",
        "",
        "Stages of the best save and load (seconds, stages overlap): save "
        + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in save_stages.items())
        + "; load "
        + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in load_stages.items()),
    ]
    return "\n".join(lines)


def section_lookups(rate: str, rounds: int) -> str:
    """One block's `exists` across hosts on the lookup channel against over UCX, side by side (module docstring)."""
    b = Bench(2, rate)
    paths = {"lookup channel": "n1", "UCX (--lookup-port off)": "n2"}
    try:
        rtt = {host: tcp_rtt(b.hosts, "client", host) for host in paths.values()}
        engines = {}
        for path, host in paths.items():
            node = b.node(host) if host == "n1" else b.node(host, "--lookup-port", "off")
            engines[path] = b.engine(nodes=[node.address], replicas=1, timeout_ms=60_000, blocks=8, **SMALL)
        for e in engines.values():
            e.call(op="save", blocks=[0])
            e.call(op="timed", what="exists", blocks=[0], rounds=300, timeout_s=600)  # warm-up (the channel opens)
        calls: dict[str, list[float]] = {path: [] for path in paths}
        for _ in range(rounds):
            for path, e in engines.items():
                calls[path] += e.call(op="timed", what="exists", blocks=[0], rounds=200, timeout_s=600)["seconds"]
        probes = {path: e.call(op="probe", rounds=500, timeout_s=600) for path, e in engines.items()}
    finally:
        b.close()
    med = {path: statistics.median(v) for path, v in calls.items()}
    lines = [
        f"One block's `exists` through the API across hosts (link {rate}; {rounds} rounds of 200 calls per path, alternating)",
        "",
        "| path | API exists median / p99 | TCP round trip | API - RTT | `UcxNode.exists` / `UcxNode.ping` (medians) |",
        "|---|---|---|---|---|",
    ]
    for path, host in paths.items():
        lines.append(
            f"| {path} | {med[path] * 1e6:.0f} / {percentile(calls[path], 0.99) * 1e6:.0f} us | {rtt[host] * 1e6:.0f} us "
            f"| {(med[path] - rtt[host]) * 1e6:.0f} us | {statistics.median(probes[path]['exists']) * 1e6:.0f} / "
            f"{statistics.median(probes[path]['ping']) * 1e6:.0f} us |"
        )
    channel, ucx = "lookup channel", "UCX (--lookup-port off)"
    note = f"link {rate}, {rounds} rounds of 200 calls per path, alternating; TCP RTT {rtt['n1'] * 1e6:.0f} us"
    run = Run(
        "hosts-lookups",
        command_line(),
        [
            Figure(
                "exists of one block across hosts through the API on the lookup channel, minus the TCP round trip",
                (med[channel] - rtt["n1"]) * 1e6,
                "µs",
                goal=Goal("<=", 100),
                note=note,
            ),
            Figure(
                "exists of one block across hosts through the API on the lookup channel (median)",
                med[channel] * 1e6,
                "µs",
                "the same over UCX (a node with --lookup-port off)",
                med[ucx] * 1e6,
                Goal("<", 1.0),
                note=note,
            ),
        ],
    )
    lines += ["", markdown(run), f"results: {record(run)}"]
    return "\n".join(lines)


SWEEP = (
    {},
    {"EMS_CHUNK_BYTES": "0"},
    {"EMS_CHUNK_BYTES": "4MiB"},
    {"UCX_TCP_TX_SEG_SIZE": "64k", "UCX_TCP_RX_SEG_SIZE": "64k"},
    {"UCX_TCP_TX_SEG_SIZE": "8k", "UCX_TCP_RX_SEG_SIZE": "64k"},
    {"UCX_RNDV_SCHEME": "am"},
    {"UCX_RNDV_SCHEME": "get_zcopy"},
    {"UCX_TCP_SNDBUF": "8m", "UCX_TCP_RCVBUF": "8m"},
    {"UCX_MAX_RNDV_RAILS": "1"},
    {"EMS_UCX_PROGRESS_MODE": "thread"},
)


def ucx_perftest_rtt(hosts: HostCluster, client: str, server: str, mode: str) -> float:
    """Median round trip (s) of UCX's own tag ping-pong (`ucx_perftest -t tag_lat`, 8 bytes, TCP transport) between
    two hosts, both ends in wait mode `mode` (`poll`: busy polling; `sleep`: waiting in the worker's epoll, as our
    progress threads do). ucx_perftest reports half the round trip."""
    import libucx

    home = Path(libucx.__file__).parent
    env = ["env", f"LD_LIBRARY_PATH={home / 'lib'}", "UCX_TLS=tcp", "UCX_NET_DEVICES=eth0"]
    tool = str(home / "bin" / "ucx_perftest")
    srv = hosts.popen(server, [*env, tool, "-p", "5297", "-E", mode], stdout=-3, stderr=-3)
    time.sleep(0.5)
    out = hosts.run(client, [*env, tool, hosts.ip(server), "-p", "5297", "-t", "tag_lat", "-s", "8", "-n", "20000",
                             "-E", mode], timeout_s=120)  # fmt: skip
    srv.wait(10)
    final = [line for line in out.stdout.splitlines() if line.startswith("Final:")]
    if not final:
        raise RuntimeError(f"ucx_perftest: {out.stdout[-2000:]} {out.stderr[-2000:]}")
    return 2 * float(final[0].split()[2]) / 1e6


def ucx_perftest_bw(hosts: HostCluster, client: str, server: str, nbytes: int = 32 << 20) -> float:
    """GB/s of UCX's own tag bandwidth test (`ucx_perftest -t tag_bw`, `nbytes` messages, TCP transport) from
    `client` to `server`: what the transport the API rides on moves over the link, with no Python on either side.
    ucx_perftest's MB/s are MiB/s."""
    import libucx

    home = Path(libucx.__file__).parent
    env = ["env", f"LD_LIBRARY_PATH={home / 'lib'}", "UCX_TLS=tcp", "UCX_NET_DEVICES=eth0"]
    tool = str(home / "bin" / "ucx_perftest")
    srv = hosts.popen(server, [*env, tool, "-p", "5296"], stdout=-3, stderr=-3)
    time.sleep(0.5)
    out = hosts.run(client, [*env, tool, hosts.ip(server), "-p", "5296", "-t", "tag_bw", "-s", str(nbytes), "-n", "40",
                             "-w", "4"], timeout_s=300)  # fmt: skip
    srv.wait(10)
    final = [line for line in out.stdout.splitlines() if line.startswith("Final:")]
    if not final:
        raise RuntimeError(f"ucx_perftest: {out.stdout[-2000:]} {out.stderr[-2000:]}")
    return float(final[0].split()[6]) * (1 << 20) / 1e9


def _handler_seconds(text: str, op: str) -> tuple[float, float]:
    """(sum of seconds, count) of a node's `ems_pool_request_seconds{op}` histogram in a metrics exposition."""
    values = {}
    for line in text.splitlines():
        for part in ("sum", "count"):
            if line.startswith(f'ems_pool_request_seconds_{part}{{op="{op}"}}'):
                values[part] = float(line.split()[-1])
    return values.get("sum", 0.0), values.get("count", 0.0)


SUBMISSIONS = ("delayed", "direct")  # EMS_UCX_CLIENT_SUBMIT values compared by `calls`


def section_calls(rate: str, rounds: int, submissions: list[str]) -> str:
    """Where one block's `exists` goes, layer by layer, next to the wire's and UCX's own round trips; one engine per
    client submission mode (`EMS_UCX_CLIENT_SUBMIT`), all against the same node, their calls interleaved round by
    round, with a 32 MiB save and load each (the bulk path must not pay for a faster small call)."""
    b = Bench(1, rate)
    try:
        rtt = tcp_rtt(b.hosts, "client", "n1")
        poll, sleep = (ucx_perftest_rtt(b.hosts, "client", "n1", mode) for mode in ("poll", "sleep"))
        node = b.node("n1")
        engines: dict[str, Engine] = {}
        for mode in submissions:
            # "MODE+mutex": that mode with UCX's worker lock a mutex instead of a spinlock (UCX_USE_MT_MUTEX=y)
            os.environ["EMS_UCX_CLIENT_SUBMIT"] = mode.split("+")[0]
            if mode.endswith("+mutex"):
                os.environ["UCX_USE_MT_MUTEX"] = "y"
            try:
                engines[mode] = b.engine(nodes=[node.address], replicas=1, timeout_ms=60_000, blocks=64, **BIG)
            finally:
                os.environ.pop("EMS_UCX_CLIENT_SUBMIT", None)
                os.environ.pop("UCX_USE_MT_MUTEX", None)
        url = f"http://{node.metrics_address}/metrics"
        st: dict[str, dict[str, list[float]]] = {m: {} for m in submissions}
        handler: dict[str, dict[str, list[float]]] = {m: {"exists": [0.0, 0.0], "ping": [0.0, 0.0]} for m in submissions}
        bulk: dict[str, dict[str, list[float]]] = {m: {"save": [], "load": []} for m in submissions}
        blocks = list(range(32))
        nbytes = 32 * (block_bytes(BIG) + 40)
        for e in engines.values():
            e.call(op="save", blocks=[0])
            e.call(op="stages", rounds=200, timeout_s=600)  # warm-up
            for r in range(2):  # warm-up of the bulk path (connection, staging, the node's memory)
                e.call(op="bulk", what="save", blocks=blocks, rounds=1, base=1_000_000 * (r + 1), timeout_s=600)
                e.call(op="bulk", what="load", blocks=blocks, rounds=1, base=1_000_000 * (r + 1), timeout_s=600)
        for r in range(rounds):
            for i, (mode, e) in enumerate(engines.items()):
                before = {op: _handler_seconds(e.call(op="scrape", url=url)["text"], op) for op in ("exists", "ping")}
                part = e.call(op="stages", rounds=max(1, 1000 // rounds), timeout_s=600)
                after = {op: _handler_seconds(e.call(op="scrape", url=url)["text"], op) for op in ("exists", "ping")}
                for k, v in part.items():
                    st[mode].setdefault(k, []).extend(v)
                for op in ("exists", "ping"):
                    handler[mode][op][0] += after[op][0] - before[op][0]
                    handler[mode][op][1] += after[op][1] - before[op][1]
                base = 10_000 * (r + 1) + 100 * (i + 1) + 5_000_000
                sv = e.call(op="bulk", what="save", blocks=blocks, rounds=1, base=base, timeout_s=600)
                ld = e.call(op="bulk", what="load", blocks=blocks, rounds=1, base=base, timeout_s=600)
                assert sv["success"] == [32] and ld["success"] == [32], (mode, sv, ld)
                bulk[mode]["save"].append(sv["seconds"][0])
                bulk[mode]["load"].append(ld["seconds"][0])
    finally:
        b.close()
    lines = [
        f"One block's `exists`, layer by layer (medians of {rounds * max(1, 1000 // rounds)} calls each, interleaved; "
        f"link {rate}), per client submission mode (`EMS_UCX_CLIENT_SUBMIT`, one engine each, rounds alternating)",
        "",
        f"TCP round trip {rtt * 1e6:.0f} us (Python, 8 bytes each way, blocking sockets); UCX's own tag ping-pong "
        f"(`ucx_perftest -t tag_lat`, 8 bytes, TCP): busy polling {poll * 1e6:.0f} us, sleeping in epoll "
        f"{sleep * 1e6:.0f} us (both ends woken per message)",
        "",
        "| stage (median us) | " + " | ".join(submissions) + " | what it is |",
        "|---|" + "---|" * len(submissions) + "---|",
    ]
    med = {m: {k: statistics.median(v) * 1e6 for k, v in st[m].items()} for m in submissions}
    p99 = {m: percentile(st[m]["node"], 0.99) * 1e6 for m in submissions}
    outside = {m: statistics.median([n - w for n, w in zip(st[m]["node"], st[m]["wait"])]) * 1e6 for m in submissions}
    hand = {m: {op: handler[m][op][0] / max(1.0, handler[m][op][1]) * 1e6 for op in ("exists", "ping")} for m in submissions}

    def row(name: str, values: dict[str, str], what: str) -> str:
        return f"| {name} | " + " | ".join(values[m] for m in submissions) + f" | {what} |"

    lines += [
        row("`UcxNode.ping`", {m: f"{med[m]['ping']:.0f}" for m in submissions}, "a header each way through our client and node"),
        row("node's handler, exists / ping (mean)", {m: f"{hand[m]['exists']:.0f} / {hand[m]['ping']:.0f}" for m in submissions},
            "`ems_pool_request_seconds` of the node"),
        row("`UcxNode.exists` (p99)", {m: f"{med[m]['node']:.0f} ({p99[m]:.0f})" for m in submissions}, "the transport's call"),
        row("of it, waiting for UCX", {m: f"{med[m]['wait']:.0f}" for m in submissions},
            "posted to completed: the wake-ups, the wire, the node"),
        row("of it, the caller's work", {m: f"{outside[m]:.0f}" for m in submissions},
            "request build, posts, reply parse, connection lookup"),
        row("pool client (`PoolClient.exists`)", {m: f"{med[m]['pool']:.0f}" for m in submissions}, "+ routing and reads"),
        row("API (`ContextCaching.exists`)", {m: f"{med[m]['api']:.0f}" for m in submissions}, "+ keys, binding, result"),
        row("API exists - TCP round trip", {m: f"{med[m]['api'] - rtt * 1e6:.0f}" for m in submissions}, "goal: <= 100"),
        row(f"32 MiB save, GB/s best / median of {rounds}",
            {m: f"{nbytes / min(bulk[m]['save']) / 1e9:.3f} / {nbytes / statistics.median(bulk[m]['save']) / 1e9:.3f}"
             for m in submissions}, "32 blocks of 1 MiB through the API"),
        row(f"32 MiB load, GB/s best / median of {rounds}",
            {m: f"{nbytes / min(bulk[m]['load']) / 1e9:.3f} / {nbytes / statistics.median(bulk[m]['load']) / 1e9:.3f}"
             for m in submissions}, "the same blocks loaded"),
    ]  # fmt: skip
    return "\n".join(lines)


def section_sweep(rate: str, rounds: int) -> str:
    """The 32 MiB save and load of `link` under other settings (environment of the node and the engine alike)."""
    out = [
        "| settings | save GB/s (best / median) | load GB/s (best / median) | load stages of the best (ms) |",
        "|---|---|---|---|",
    ]
    for env in SWEEP:
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        b = Bench(1, rate)
        try:
            node = b.node("n1")
            e = b.engine(nodes=[node.address], replicas=1, timeout_ms=60_000, blocks=64, **BIG)
            blocks = list(range(32))
            nbytes = 32 * (block_bytes(BIG) + 40)
            saves, loads, stages = [], [], {}
            for r in range(rounds + 2):
                sv = e.call(op="bulk", what="save", blocks=blocks, rounds=1, base=10_000 * (r + 1), timeout_s=600)
                ld = e.call(op="bulk", what="load", blocks=blocks, rounds=1, base=10_000 * (r + 1), timeout_s=600)
                if r >= 2:
                    if not loads or ld["seconds"][0] < min(loads):
                        stages = ld["stages"]
                    saves.append(sv["seconds"][0])
                    loads.append(ld["seconds"][0])
        finally:
            b.close()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        name = " ".join(f"{k}={v}" for k, v in env.items()) or "defaults"
        out.append(
            f"| {name} | {nbytes / min(saves) / 1e9:.3f} / {nbytes / statistics.median(saves) / 1e9:.3f} "
            f"| {nbytes / min(loads) / 1e9:.3f} / {nbytes / statistics.median(loads) / 1e9:.3f} "
            f"| {', '.join(f'{k} {v * 1e3:.1f}' for k, v in stages.items())} |"
        )
        print(out[-1], flush=True)
    return "\n".join(out)


def section_fanout(rate: str, rounds: int) -> str:
    b = Bench(3, rate)
    try:
        nodes = [b.node(h) for h in b.names]
        e = b.engine(nodes=[n.address for n in nodes], replicas=1, timeout_ms=60_000, blocks=96, **BIG)
        blocks = list(range(96))
        assert e.call(op="bulk", what="save", blocks=blocks, rounds=1, timeout_s=600)["success"] == [96]
        holders = e.call(op="holders", blocks=blocks)["holders"]
        shares = {n.address: [b_ for b_, h in zip(blocks, holders) if h == [n.address]] for n in nodes}
        whole, parts = [], {a: [] for a in shares}
        best, best_shares, best_stages, best_cpu = float("inf"), [], {}, ({}, 0.0)
        part_cpu: dict[str, tuple[float, tuple[dict, float]]] = {}  # node -> (seconds, client CPU by thread) of its fastest share
        for _ in range(rounds + 1):
            r = e.call(op="bulk", what="load", blocks=blocks, rounds=1, timeout_s=600)
            whole.append(r["seconds"][0])
            if r["seconds"][0] < best:
                best, best_shares, best_stages, best_cpu = r["seconds"][0], r["shares"], r["stages"], (r["cpu"], r["host_cpu"])
            for a, mine in shares.items():
                p = e.call(op="bulk", what="load", blocks=mine, rounds=1, timeout_s=600)
                parts[a].append(p["seconds"][0])
                if a not in part_cpu or p["seconds"][0] < part_cpu[a][0]:
                    part_cpu[a] = (p["seconds"][0], (p["cpu"], p["host_cpu"]))
    finally:
        b.close()
    whole_t = statistics.median(whole[1:])
    part_t = {a: statistics.median(v[1:]) for a, v in parts.items()}
    slowest = max(part_t.values())
    lines = [
        f"Fan-out: 96 blocks of 1 MiB over three node hosts ({rate} each), median of {rounds}",
        "",
        "| load | blocks | ms | GB/s |",
        "|---|---|---|---|",
    ]
    for a, t in part_t.items():
        lines.append(f"| share of {a} alone | {len(shares[a])} | {t * 1e3:.1f} | {len(shares[a]) * MIB / t / 1e9:.3f} |")
    lines.append(f"| all three at once | 96 | {whole_t * 1e3:.1f} | {96 * MIB / whole_t / 1e9:.3f} |")
    lines += ["", f"All three at once took {whole_t / slowest:.2f}x the slowest share alone (sum of shares: "
              f"{whole_t / sum(part_t.values()):.2f}x their sum)."]  # fmt: skip
    lines += [
        "",
        f"Inside the fastest all-three load ({best * 1e3:.1f} ms; stages "
        + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in best_stages.items())
        + "), each node's requests (`FanOut.run`, per chunk of the load):",
        "",
        "| node | requests | first starts at ms | last ends at ms | busy ms (sum) | its share alone ms |",
        "|---|---|---|---|---|---|",
    ]
    for a in part_t:
        mine = [x for x in best_shares if x[0] == a]
        if not mine:
            continue
        lines.append(
            f"| {a} | {len(mine)} | {min(x[1] for x in mine) * 1e3:.1f} | {max(x[1] + x[2] for x in mine) * 1e3:.1f} "
            f"| {sum(x[2] for x in mine) * 1e3:.1f} | {part_t[a] * 1e3:.1f} |"
        )
    lines += [
        "",
        "CPU in the fastest load of each kind: the client's (its threads' CPU time, /proc schedstat; its busiest",
        "threads, Python threads by name, others by id: UCX's progress thread) and the whole machine's (/proc/stat,",
        "10 ms ticks: every process, the nodes' included, and the kernel's network work; this machine has "
        f"{os.cpu_count()} CPUs):",
        "",
        "| load | wall ms | client CPU ms (cores busy) | machine CPU ms (cores busy) | client's busiest threads, CPU ms |",
        "|---|---|---|---|---|",
    ]
    for label, (wall, (cpu, host)) in [("all three at once", (best, best_cpu))] + [
        (f"share of {a} alone", part_cpu[a]) for a in part_t if a in part_cpu
    ]:
        total = sum(cpu.values())
        top = ", ".join(f"{name} {v * 1e3:.1f}" for name, v in list(cpu.items())[:4])
        lines.append(
            f"| {label} | {wall * 1e3:.1f} | {total * 1e3:.1f} ({total / wall:.2f}) "
            f"| {host * 1e3:.0f} ({host / wall:.2f}) | {top} |"
        )
    return "\n".join(lines)


def _holders(e: Engine, blocks: list[int]) -> tuple[list[int], list[str]]:
    """Each block's copies on the live nodes, every node asked directly, and the nodes that never answered."""
    found = e.call(op="holders", blocks=blocks, timeout_s=120)
    return [len(h) for h in found["holders"]], found["unreached"]


def _copies(e: Engine, blocks: list[int]) -> list[int]:
    """`_holders`' copies; a node that never answers is an error."""
    copies, unreached = _holders(e, blocks)
    if unreached:
        raise RuntimeError(f"holders: nodes not reached {unreached}")
    return copies


def _repair_idle(e: Engine, nodes: list[HostNode]) -> bool:
    return _scrape_sum(e, nodes, "ems_pool_repair_running") == 0 and _scrape_sum(e, nodes, "ems_pool_repair_incomplete") == 0


def section_scenario(rate: str) -> str:
    return "\n".join(
        [
            "| what | measured |",
            "|---|---|",
            *_scenario(rate, hold_s=0.0),
            *_scenario(rate, hold_s=30.0),
        ]
    )


def _scenario(rate: str, hold_s: float) -> list[str]:
    """The issue's rows; the partition lasts as long as one load of the blocks, or `hold_s` when longer."""
    b = Bench(3, rate)
    rows = []
    cut_for = f"partition held {hold_s:.0f} s" if hold_s else "partition as long as one load"
    try:
        url = b.start_etcd()
        nodes = [b.node(h, "--replicas", "2", etcd=True, capacity="256MiB") for h in b.names]
        e = b.engine(etcd=url, cluster="hosts", replicas=2, timeout_ms=2000)
        e.wait_members({n.address for n in nodes}, timeout_s=30)
        blocks = list(range(64))
        # a save stores a block once one owner has it, and on a busy host may stop waiting for a lagging owner: save
        # again until both owners hold every block, the premise of the rows below
        saves = 0
        while saves < 10:
            saves += 1
            assert e.call(op="save", blocks=blocks)["saved"] == [1] * 64
            if _copies(e, blocks) == [2] * 64:
                break
        rows.append(("every block at two copies before the losses", f"after {saves} save(s) of the 64 blocks"))
        killed, cut, third = nodes
        killed.kill()
        r = e.call(op="load", blocks=blocks)["result"]
        rows.append(("replicas = 2 of 3 nodes, one node killed", f"{r.count('hit')}/64 blocks exact, {r.count('wrong')} wrong"))
        b.hosts.cut(cut.host)
        cut_at = time.monotonic()
        timed = e.call(op="timed", what="load", blocks=blocks, rounds=1, timeout_s=900)
        rows.append(
            (
                f"one node killed and another partitioned ({cut_for})",
                f"{timed['hits']}/64 hits, {timed['wrong']} wrong, slowest call {max(timed['seconds']):.2f} s at a 2 s timeout",
            )
        )
        time.sleep(max(0.0, hold_s - (time.monotonic() - cut_at)))
        killed.restart()
        b.hosts.restore(cut.host)
        healed = time.monotonic()
        e.wait_members({n.address for n in nodes}, timeout_s=30)
        # every node asked directly, every 0.25 s: when every block that still has a copy is back to two copies (or
        # more: repair only adds copies, so a copy made while the partition lasted stays), and when repair reports
        # done on every node
        two_at = idle_at = None
        while time.monotonic() - healed < 15 and (two_at is None or idle_at is None):
            now, unreached = _holders(e, blocks)
            if two_at is None and not unreached and all(c >= 2 or c == 0 for c in now):
                two_at = time.monotonic() - healed
            if two_at is not None and idle_at is None and _repair_idle(e, nodes):
                idle_at = time.monotonic() - healed
            time.sleep(0.25)
        time.sleep(max(0.0, 15 - (time.monotonic() - healed)))
        copies = _copies(e, blocks)
        copied = _scrape_sum(e, nodes, "ems_pool_repair_copied_values_total")
        third.kill()
        r = e.call(op="load", blocks=blocks)["result"]
        rows.append(
            (
                f"the killed node restarted empty, the partition healed ({cut_for}): every block with a copy at two",
                f"{two_at:.2f} s after the heal, repair done on every node (metrics) {idle_at:.2f} s after"
                if two_at is not None and idle_at is not None
                else f"not within 15 s (at two copies: {two_at}, repair done: {idle_at})",
            )
        )
        rows.append(
            (
                f"15 s after the heal ({cut_for}), then a third node lost",
                f"{r.count('hit')}/64 blocks exact, {r.count('wrong')} wrong (before the loss: {sum(c >= 2 for c in copies)}/64 "
                f"blocks with two copies or more, {copies.count(3)} of them three, {copies.count(0)} lost with both owners; "
                f"{copied:.0f} values copied by repair)",
            )
        )
    finally:
        b.close()
    return [f"| {a} | {m} |" for a, m in rows]


def _scrape_sum(e: Engine, nodes: list[HostNode], name: str) -> float:
    total = 0.0
    for n in nodes:
        try:
            text = e.call(op="scrape", url=f"http://{n.metrics_address}/metrics")["text"]
        except Exception:  # a node that is gone
            continue
        for line in text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                total += float(line.rsplit(" ", 1)[1])
    return total


def section_repair(rate: str) -> str:
    out = [
        "| --repair-rate | values to copy | copied | repair took | MB/s copied | one-block load p50 / p99 before | "
        "during repair |",
        "|---|---|---|---|---|---|---|",
    ]
    for repair_rate in ("64MiB", "4GiB"):
        b = Bench(4, rate)
        try:
            url = b.start_etcd()
            nodes = [b.node(h, "--replicas", "2", "--repair-rate", repair_rate, etcd=True, capacity="1GiB") for h in b.names]
            e = b.engine(etcd=url, cluster="hosts", replicas=2, timeout_ms=5000, blocks=256, **BIG)
            e.wait_members({n.address for n in nodes}, timeout_s=30)
            blocks = list(range(256))
            for start in range(0, 256, 32):
                assert e.call(op="bulk", what="save", blocks=blocks[start : start + 32], rounds=1, timeout_s=600)["success"] == [
                    32
                ]
            probe = list(range(0, 256, 8))
            before = e.call(op="timed", what="load", blocks=probe, rounds=1, timeout_s=600)["seconds"]
            victim = nodes[0]
            holders = e.call(op="holders", blocks=blocks, timeout_s=120)["holders"]
            to_copy = sum(victim.address in h for h in holders)
            copied0 = _scrape_sum(e, nodes[1:], "ems_pool_repair_copied_values_total")
            victim.kill()
            t0 = time.monotonic()
            e.wait_members({n.address for n in nodes[1:]}, timeout_s=30)
            during: list[float] = []
            done_at = None
            while time.monotonic() - t0 < 120:
                during += e.call(op="timed", what="load", blocks=probe[:8], rounds=1, timeout_s=600)["seconds"]
                copied = _scrape_sum(e, nodes[1:], "ems_pool_repair_copied_values_total") - copied0
                running = _scrape_sum(e, nodes[1:], "ems_pool_repair_running")
                if copied >= to_copy and running == 0:
                    done_at = time.monotonic()
                    break
            took = (done_at or time.monotonic()) - t0
            copied_bytes = _scrape_sum(e, nodes[1:], "ems_pool_repair_copied_bytes_total")
            out.append(
                f"| {repair_rate}/s | {to_copy} | {copied:.0f} | {took:.1f} s (from the kill: a lease of 2 s first) "
                f"| {copied_bytes / took / 1e6:.0f} "
                f"| {percentile(before, 0.5) * 1e3:.2f} / {percentile(before, 0.99) * 1e3:.2f} ms "
                f"| {percentile(during, 0.5) * 1e3:.2f} / {percentile(during, 0.99) * 1e3:.2f} ms ({len(during)} loads) |"
            )
        finally:
            b.close()
    return "\n".join(out)


SAVED_AFTER = 16  # blocks of the save right after the timed loads (`section_slow`)


def section_slow(rate: str, rounds: int) -> str:
    out = ["| slow node | hedging | loads | hits | wrong | p50 ms | p99 ms | max ms |", "|---|---|---|---|---|---|---|---|"]
    saves = [
        f"| slow node | hedging | save of {SAVED_AFTER} blocks right after the loads, ms | n1's share (requests), ms "
        "| blocks with a copy on n1 / n1 owns | blocks with two copies |",
        "|---|---|---|---|---|---|",
    ]
    for slow, hedge in ((False, "on"), (True, "off"), (True, "on")):
        b = Bench(3, rate)
        os.environ["EMS_POOL_HEDGE"] = hedge
        try:
            nodes = [b.node(h) for h in b.names]
            e = b.engine(nodes=[n.address for n in nodes], replicas=2, timeout_ms=20_000, blocks=64, **SMALL)
            blocks = list(range(64))
            assert e.call(op="save", blocks=blocks)["saved"] == [1] * 64
            e.call(op="timed", what="load", blocks=blocks, rounds=1, timeout_s=600)  # warm up, latency model
            if slow:
                b.hosts.shape("n1", "8mbit", ingress=True)
            t = e.call(op="timed", what="load", blocks=blocks, rounds=rounds, timeout_s=1800)
            s = t["seconds"]
            out.append(
                f"| {'n1 at 8 Mbit/s' if slow else 'none'} | {hedge} | {len(s)} | {t['hits']} | {t['wrong']} "
                f"| {percentile(s, 0.5) * 1e3:.2f} | {percentile(s, 0.99) * 1e3:.2f} | {max(s) * 1e3:.1f} |"
            )
            # a save of new blocks (hashes 5000 + b) right after the loads (whose hedges may have aborted n1's
            # connection): which blocks got their copy on n1, and how long n1's share took
            after = list(range(SAVED_AFTER))
            saved = e.call(op="bulk", what="save", blocks=after, rounds=1, base=5000)
            held = e.call(op="holders", blocks=[5000 + x for x in after])["holders"]
            n1 = nodes[0].address
            n1_share = [d for a, _, d in saved["shares"] if a == n1]
            blocks_on_n1 = sum(n1 in h for h in held)
            # n1's owned blocks, from where the save put them: with every copy made, each block is on its two owners;
            # a block on one node only lost its copy on n1 when n1 is one of its owners (the other two nodes are fast)
            n1_owns = blocks_on_n1 + sum(len(h) == 1 for h in held)
            saves.append(
                f"| {'n1 at 8 Mbit/s' if slow else 'none'} | {hedge} | {saved['seconds'][0] * 1e3:.1f} "
                f"| {', '.join(f'{d * 1e3:.1f}' for d in n1_share) or '-'} | {blocks_on_n1} / {n1_owns} "
                f"| {sum(len(h) == 2 for h in held)} / {SAVED_AFTER} |"
            )
        finally:
            os.environ.pop("EMS_POOL_HEDGE", None)
            b.close()
    return "\n".join([*out, "", *saves])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="link,calls,lookups,fanout,scenario,repair,slow")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--rate", default="4gbit")
    parser.add_argument("--submit", default=",".join(SUBMISSIONS), help="client submission modes `calls` compares")
    args = parser.parse_args()
    reason = unavailable()
    if reason is not None:
        sys.exit(f"bench_hosts: {reason}")
    print(f"# bench_hosts: {machine()}")
    print(f"command: python perf/bench_hosts.py {' '.join(sys.argv[1:])}".rstrip())
    for name in args.only.split(","):
        print(f"\n## {name}\n", flush=True)
        if name == "link":
            print(section_link(args.rate, args.rounds))
        elif name == "calls":
            print(section_calls(args.rate, args.rounds, args.submit.split(",")))
        elif name == "lookups":
            print(section_lookups(args.rate, args.rounds))
        elif name == "sweep":
            print(section_sweep(args.rate, args.rounds))
        elif name == "fanout":
            print(section_fanout(args.rate, args.rounds))
        elif name == "scenario":
            print(section_scenario(args.rate))
        elif name == "repair":
            print(section_repair(args.rate))
        elif name == "slow":
            print(section_slow(args.rate, max(2, args.rounds // 2)))
        else:
            sys.exit(f"unknown section {name!r}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
