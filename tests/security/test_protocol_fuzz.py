"""Protocol fuzzing of a live node from raw UCX clients (issue 7): random bytes, valid headers with mutated fields,
truncated frames, lengths that disagree with the data, and handshake abuse, several hundred cases from a fixed
seed, eight connections at a time. After each batch the node must be alive, serve a good client byte-exact, show
tenant beta nothing of tenant alpha's, and keep its resident memory and descriptor count bounded. The figures are
printed (run with -s to see them) and kept in `FIGURES` for the notes."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from pool_testlib import KEY_A, KEY_B, joined, make_values, wait_until
from raw_ucx import CLOSED, RawSession, Reply

from ems.transport import metas, protocol

pytestmark = pytest.mark.slow
SEED = 20261129
CASES = 800
BATCH = 100
PARALLEL = 8
WAIT_S = 0.3
MiB = 1 << 20
TENANTS = {"alpha": KEY_A, "beta": KEY_B}
FIGURES: dict = {}


class Case:
    """One fuzz case: its kind and the random generator it draws from."""

    def __init__(self, index: int) -> None:
        self.rng = np.random.default_rng([SEED, index])
        self.kind = KINDS[int(self.rng.integers(len(KINDS)))]

    def bytes(self, n: int) -> bytes:
        return self.rng.integers(0, 256, n, dtype=np.uint8).tobytes()

    def length(self) -> int:
        return int(self.rng.choice([0, 1, 7, 8, 16, 31, 32, 33, 100, 4096, int(self.rng.integers(1, 3000))]))


def _mutated_header(case: Case, op: int) -> np.ndarray:
    header = protocol.pack_header(
        op, count=int(case.rng.integers(0, 4)), meta_len=int(case.rng.integers(0, 64)), data_len=int(case.rng.integers(0, 4096))
    )
    raw = header.copy()
    for _ in range(int(case.rng.integers(1, 4))):
        field = int(case.rng.integers(0, 9))
        view = raw.view(protocol.HEADER_DTYPE)
        name = protocol.HEADER_DTYPE.names[field]
        big = [0, 1, 2**16 - 1, 2**31, 2**32 - 1, protocol.MAX_KEYS + 1, protocol.MAX_META_BYTES + 1, 2**40, 2**63]
        choice = int(case.rng.choice(big)) if case.rng.random() < 0.5 else int(case.rng.integers(0, 2**16))
        limit = np.iinfo(protocol.HEADER_DTYPE[name]).max
        view[name] = min(choice, limit)
    return raw


def _request_frames(case: Case) -> list:
    """A valid request of a random kind, as frames."""
    keys = [case.bytes(int(case.rng.integers(1, 40))) for _ in range(int(case.rng.integers(1, 5)))]
    what = int(case.rng.integers(3))
    if what == 0:
        meta = metas.encode_keys_meta(keys)
        return [
            protocol.pack_header(protocol.Op.GET, count=len(keys), meta_len=len(meta), meta_end=protocol.end_byte(meta)),
            meta,
        ]
    if what == 1:
        meta = metas.encode_keys_meta(keys)
        return [
            protocol.pack_header(protocol.Op.EXISTS, count=len(keys), meta_len=len(meta), meta_end=protocol.end_byte(meta)),
            meta,
        ]
    lens = case.rng.integers(1, 200_000, len(keys))
    data = [case.bytes(int(n)) for n in lens]
    meta = metas.encode_put_meta(keys, lens, lens, protocol.end_bytes(data))
    return [
        protocol.pack_header(
            protocol.Op.PUT, count=len(keys), meta_len=len(meta), meta_end=protocol.end_byte(meta), data_len=int(lens.sum())
        ),
        meta,
        *data,
    ]


# ---- the kinds of case: each returns what the node did ----


def random_bytes(case: Case, raw: RawSession) -> object:
    if case.rng.random() < 0.5:
        raw.login("beta", KEY_B)
    raw.send(*[case.bytes(case.length()) or b"\0" for _ in range(int(case.rng.integers(1, 4)))])
    return raw.reply(WAIT_S)


def mutated_header(case: Case, raw: RawSession) -> object:
    authed = case.rng.random() < 0.7
    if authed:
        raw.login("beta", KEY_B)
    op = int(
        case.rng.choice(
            [protocol.Op.HELLO, protocol.Op.AUTH, protocol.Op.PUT, protocol.Op.GET, protocol.Op.EXISTS, protocol.Op.PING, 99]
        )
    )
    raw.send(_mutated_header(case, op), case.bytes(int(case.rng.integers(1, 64))))
    return raw.reply(WAIT_S)


def truncated(case: Case, raw: RawSession) -> object:
    raw.login("beta", KEY_B)
    frames = _request_frames(case)
    cut = int(case.rng.integers(len(frames)))
    frame = bytes(np.asarray(frames[cut], dtype=np.uint8)) if not isinstance(frames[cut], bytes) else frames[cut]
    frames[cut] = frame[: int(case.rng.integers(0, max(1, len(frame))))] or b"\0"
    raw.send(*frames)
    return raw.reply(WAIT_S)


def disagreeing_lengths(case: Case, raw: RawSession) -> object:
    raw.login("beta", KEY_B)
    announced = int(case.rng.integers(8, 300_000))
    how = int(case.rng.integers(4))
    if how == 0:  # shorter data
        data = [case.bytes(int(case.rng.integers(1, announced)))]
    elif how == 1:  # longer data
        data = [case.bytes(announced + int(case.rng.integers(1, 1000)))]
    elif how == 2:  # split into more frames than announced
        half = announced // 2
        data = [case.bytes(half), case.bytes(announced - half)]
    else:  # no data at all, then another request
        meta = metas.encode_keys_meta([b"k"])
        data = [protocol.pack_header(protocol.Op.GET, count=1, meta_len=len(meta), meta_end=protocol.end_byte(meta)), meta]
    raw.send(*raw.put_frames(case.bytes(8), announced, data))
    return raw.reply(WAIT_S)


def handshake_abuse(case: Case, raw: RawSession) -> object:
    how = int(case.rng.integers(6))
    if how == 0:  # skipped AUTH
        raw.hello("alpha")
        meta = metas.encode_keys_meta([b"a-0"])
        raw.send(protocol.pack_header(protocol.Op.GET, count=1, meta_len=len(meta), meta_end=protocol.end_byte(meta)), meta)
    elif how == 1:  # PUT before anything
        raw.send(*raw.put_frames(b"x", 40, [case.bytes(40)]))
    elif how == 2:  # replayed MAC (over another nonce)
        raw.hello("alpha")
        raw.auth(protocol.auth_mac(KEY_A, case.bytes(protocol.NONCE_BYTES), "alpha"))
    elif how == 3:  # second HELLO
        raw.hello("beta")
        raw.hello("alpha")
    elif how == 4:  # another tenant's MAC
        raw.hello("beta")
        raw.auth(protocol.auth_mac(KEY_A, raw.nonce, "alpha"))
    else:  # random MAC
        raw.hello("alpha")
        raw.auth(case.bytes(protocol.MAC_BYTES))
    # whatever happened, this connection must not read alpha's data
    got = raw.get([b"a-0", b"a-1"], timeout_s=WAIT_S)
    if isinstance(got, list) and any(v is not None for v in got):
        return "LEAK"
    return got if isinstance(got, str) else "refused"


KINDS = [random_bytes, mutated_header, truncated, disagreeing_lengths, handshake_abuse]


def _run_case(port: int, index: int) -> str:
    case = Case(index)
    try:
        with RawSession(port) as raw:
            outcome = case.kind(case, raw)
    except AssertionError:  # the node refused the handshake of a case that needed it: also a survival
        outcome = "refused"
    except Exception as error:  # connecting failed: the node is in trouble
        return f"error: {error!r}"
    if outcome == "LEAK":
        return "LEAK"
    if isinstance(outcome, Reply):
        return f"reply:{outcome.header.status}"
    return str(outcome)


def test_fuzz_the_node(pool_nodes, node_clients):
    node = pool_nodes("32MiB", keys=TENANTS, args=("--stall-timeout", "2", "--handshake-timeout", "2"))
    alpha = node_clients(node.address, access_id="alpha", access_key=KEY_A)
    keys = [b"a-0", b"a-1", b"a-2"]
    values = [make_values(1, s, seed=i)[0] for i, s in enumerate([3000, 200_000, protocol.SEGMENT_BYTES + 7])]
    assert alpha.put(keys, values, 5.0) == [True] * 3
    # the good client's same-host region is populated in the background (`transport.shm`): part of the baseline
    samples = [node.rss_bytes()]

    def settled() -> bool:
        time.sleep(0.3)
        samples.append(node.rss_bytes())
        return abs(samples[-1] - samples[-2]) < MiB

    assert wait_until(settled, 10.0, 0.0), samples
    base_rss, base_fds = node.rss_bytes(), node.fd_count()
    outcomes: dict[str, int] = {}
    rss_peak, fds_peak = base_rss, base_fds
    t0 = time.monotonic()
    with ThreadPoolExecutor(PARALLEL) as pool:
        for start in range(0, CASES, BATCH):
            for outcome in pool.map(lambda i: _run_case(node.port, i), range(start, start + BATCH)):
                outcomes[outcome] = outcomes.get(outcome, 0) + 1
            assert node.proc.poll() is None, node.log_text()[-3000:]
            got = alpha.get(keys, 5.0)
            assert [bytes(v) for v in got] == [joined(v) for v in values], "the good client lost data"
            rss_peak, fds_peak = max(rss_peak, node.rss_bytes()), max(fds_peak, node.fd_count())
    elapsed = time.monotonic() - t0
    assert wait_until(lambda: node.fd_count() <= base_fds + 4, 15.0, 0.5), (node.fd_count(), base_fds)
    final_rss, final_fds = node.rss_bytes(), node.fd_count()
    failed = outcomes.get("LEAK", 0) + sum(n for o, n in outcomes.items() if o.startswith("error"))
    FIGURES.update(
        cases=CASES,
        survived=CASES - failed,
        seconds=round(elapsed, 1),
        rss_growth_mib=round((final_rss - base_rss) / MiB, 1),
        rss_peak_growth_mib=round((rss_peak - base_rss) / MiB, 1),
        fd_growth=final_fds - base_fds,
        fd_peak_growth=fds_peak - base_fds,
        outcomes=outcomes,
    )
    print(f"\nfuzz figures: {FIGURES}")
    assert "LEAK" not in outcomes, outcomes
    assert not any(o.startswith("error") for o in outcomes), outcomes
    assert FIGURES["survived"] == CASES
    assert final_rss - base_rss < 96 * MiB, FIGURES
    assert final_fds - base_fds <= 4, FIGURES
    assert node_clients(node.address, access_id="alpha", access_key=KEY_A).ping(2.0)
    assert outcomes.get(CLOSED, 0) > CASES // 4  # the cases do reach the checks that close connections
