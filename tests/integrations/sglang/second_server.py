"""A second SGLang "server" in a process of its own: builds its own host pool and backend through SGLang's loader,
gets the pages it is told about from the pool, and prints what it got as JSON (per page: hit, and the SHA-256 of
the page's bytes in SGLang's flat form).

Usage: python second_server.py EXTRA_JSON LAYOUT KEY[,KEY...]
"""

from __future__ import annotations

import hashlib
import json
import sys

from sglang_testlib import build, fill, host_pool, page_bytes, page_indices


def main() -> None:
    extra, layout, keys = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3].split(",")
    host = host_pool(layout)
    fill(host, 99)  # (anything the get does not overwrite stays random)
    backend = build(extra, host)
    pages = list(range(2, 2 + len(keys)))
    hits = backend.batch_exists(keys)
    got = backend.batch_get_v1(keys, page_indices(host, pages))
    digests = [hashlib.sha256(page_bytes(host, p).numpy().tobytes()).hexdigest() for p in pages]
    print(json.dumps({"exists": hits, "got": got, "digests": digests}))


if __name__ == "__main__":
    main()
