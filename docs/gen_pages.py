"""The docs site's generated parts, made from the code and the results at every build (an MkDocs hook: mkdocs.yml).

Contract:
* `settings_table()` is the configuration reference's table of every setting of `ems.settings.Settings` (the UCX
  ones of `UcxSettings`, the Mooncake ones of `MooncakeSettings`) and of the variables read outside it: its type and
  default come from the code (the dataclasses' annotations, `resolve_settings` in an environment without the
  variables), its environment variable and meaning from `SETTINGS` below, the one place they are written. A field
  without an entry, or an entry without a field, raises `ValueError` (the build fails).
* `connector_table()` is the same for every key of the vLLM connector's `kv_connector_extra_config`
  (`ems.integrations.connector_config.KEYS`): type and default from `ConnectorConfig`'s fields, meaning from
  `CONNECTOR_KEYS`.
* `results_markdown()` is the benchmarks page's body: a row per benchmark's latest run in `perf/results/*.json`,
  linking its page (`result_pages()`, generated)
  (`perf/results.py`'s format: `load_all`, `markdown`), every figure a ratio next to its anchor, and the plot the
  benchmark saves. `archive_pages()` cuts perf/RESULTS.md (every run appended, with its command) into pages of at
  most `ARCHIVE_PAGE_CHARS` characters at its `## ` sections, plus an index.
* As a hook, `on_files` adds the archive's pages and the plots, and `on_page_markdown` replaces the markers
  `<!-- gen:settings -->`, `<!-- gen:connector -->` and `<!-- gen:results -->` of the hand-written pages.
tests/test_docs.py and tests/test_docs_site.py check the tables against the code and the pages' sizes.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.util
import os
import re
import sys
import types
import typing
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the package of this tree, as the tests use it

ARCHIVE_PAGE_CHARS = 14_000
MARKERS = ("<!-- gen:settings -->", "<!-- gen:connector -->", "<!-- gen:results -->")


class Entry(NamedTuple):
    """One setting's documentation: its environment variable (with how it is read), how its default is written when
    the code's is None (`none`), and its meaning."""

    variable: str
    meaning: str
    none: str = "none"


# Every setting, as `Settings` names it ("ucx.x" for UcxSettings, "mooncake_x" for MooncakeSettings), then the
# variables read outside `Settings` (keyed by the reader's name). The one place their variables and meanings are
# written (tests/test_docs.py checks that each variable sets its setting).
SETTINGS: dict[str, Entry] = {
    "pool_nodes": Entry("`EMS_POOL_NODES` (comma-separated)", '`"host:port"` of each pool node', "none: embedded pool"),
    "pool_capacity": Entry("`EMS_POOL_CAPACITY`", "bytes the embedded pool holds (LRU beyond)"),
    "pool_prefault": Entry("`EMS_POOL_PREFAULT`", "embedded pool bytes pre-faulted at `Ems.init` (below)"),
    "pool_prefault_ahead": Entry(
        "`EMS_POOL_PREFAULT_AHEAD`",
        "embedded pool bytes kept faulted in ahead of use, in the background on spare CPU (`0`: off; below)",
    ),
    "read_cache_capacity": Entry("`EMS_READ_CACHE_CAPACITY`", "client read cache with remote nodes (`0`: off)"),
    "staging_capacity": Entry("`EMS_STAGING_CAPACITY`", "staging bytes in flight; more waits (back-pressure)"),
    "max_inflight": Entry("`EMS_MAX_INFLIGHT`", "async calls pending at once; more wait"),
    "kernel_backend": Entry(
        "`EMS_KERNEL_BACKEND`",
        "`auto`, `triton`, `host` (CPU: the compiled loop; `auto` uses it where it builds), `torch` or `memcpy`",
    ),
    "connect_timeout_ms": Entry("`EMS_CONNECT_TIMEOUT_MS`", "connecting to (and authenticating with) a node"),
    "device": Entry("`EMS_DEVICE`", "where V0 `KvBufferWrapper` addresses live (below)", "registered cache's device"),
    "pool_etcd": Entry("`EMS_POOL_ETCD`", "etcd `http://HOST:PORT`: the pool is the nodes registered there"),
    "pool_cluster": Entry("`EMS_POOL_CLUSTER`", "the cluster's name in etcd (`[0-9a-z._-]`)"),
    "pool_replicas": Entry(
        "`EMS_POOL_REPLICAS`", "owners (copies) of each block; loads fall back to the next (Mooncake: its `replica_num`)"
    ),
    "pool_hedge": Entry(
        "`EMS_POOL_HEDGE`",
        "with replicas, a read a node is slow to answer is also sent to the next owner "
        "([failure semantics](../concepts/failure-semantics.md#slow-and-partitioned-nodes)); `off`: never",
    ),
    "pool_backend": Entry(
        "`EMS_POOL_BACKEND`",
        "`ems` (the embedded pool or `ems.pool` nodes) or `mooncake` (a Mooncake Store: [Mooncake](../guides/mooncake.md))",
    ),
    "mooncake_master": Entry("`EMS_MOONCAKE_MASTER`", '`"host:port"` of `mooncake_master`', "none (needed with `mooncake`)"),
    "mooncake_metadata": Entry(
        "`EMS_MOONCAKE_METADATA`", "Mooncake's metadata server (`http://...`, `etcd://...`) or `P2PHANDSHAKE`"
    ),
    "mooncake_protocol": Entry("`EMS_MOONCAKE_PROTOCOL`", "Mooncake transfer protocol (`tcp`, `rdma`, `ascend`, ...)"),
    "mooncake_devices": Entry("`EMS_MOONCAKE_DEVICES`", "transfer devices, e.g. `mlx5_0,mlx5_1` (rdma)"),
    "mooncake_hostname": Entry(
        "`EMS_MOONCAKE_HOSTNAME`",
        "this engine's address as Mooncake peers reach it (set it when they must: rdma, or `mooncake_segment` > 0)",
    ),
    "mooncake_buffer": Entry("`EMS_MOONCAKE_BUFFER`", "the Mooncake client's own transfer buffer (V0 loads pass through it)"),
    "mooncake_segment": Entry("`EMS_MOONCAKE_SEGMENT`", "memory this engine contributes to the store (`0`: a client only)"),
    "chunk_bytes": Entry(
        "`EMS_CHUNK_BYTES` (environment only)",
        "a job's chunk on the pipelined path to pool nodes (`0`: the request as one chunk; below)",
    ),
    "profiling": Entry(
        "`ENABLE_CC_PROFILING` (environment only)", "`1`: each job's stage bytes and timings on the `ems.profile` logger"
    ),
    "sdk_log_dir": Entry("`EMS_SDK_LOG` (environment only)", "a directory: the SDK logs to a file there"),
    "pool_shm": Entry(
        "`EMS_POOL_SHM` (environment only)", "`auto`: shared memory with a pool node on this host; `off`: always UCX"
    ),
    "host_copy": Entry(
        "`EMS_HOST_COPY` (environment only)",
        "`auto`: CPU copies through the compiled host loop where it builds; `off`: torch and numpy ops",
    ),
    "cache_dir": Entry(
        "`EMS_CACHE_DIR` (environment only)",
        "where the compiled host loop is kept",
        "`$XDG_CACHE_HOME/ems`, else `~/.cache/ems`",
    ),
    "ucx.progress_mode": Entry(
        "`EMS_UCX_PROGRESS_MODE` (environment only)",
        "UCX progress mode of pool nodes (pool clients always complete their own requests: `transport/ucx/direct.py`)",
        "`loop` (nodes)",
    ),
    "ucx.python_future": Entry(
        "`EMS_UCX_PYTHON_FUTURE` (environment only)", "`0`: ucxx completes no Python futures (awaits by polling)"
    ),
    "ucx.notifier": Entry(
        "`EMS_UCX_NOTIFIER` (environment only)", "`ucxx`: ucxx's own notifier thread instead of the lighter one"
    ),
    "ucx.client_submit": Entry(
        "`EMS_UCX_CLIENT_SUBMIT` (environment only)",
        "how a pool client's UCX worker submits a request: `delayed`, ucxx's delayed submission (the worker's progress "
        "thread submits each, one wake-up of it per post); `direct` (opt-in, ~35 µs off a small call across hosts), "
        "the posting thread does (a small request leaves at once)",
    ),
    # read outside Settings, not by Ems.init (ems.settings' readers)
    "pool_keys_from_environment": Entry(
        "`EMS_POOL_KEYS` (environment only)",
        "`ems-pool`: tenant keys, `access_id:access_key,...`, added to `--keys-file`'s; never on the command line "
        "([tenants and keys](../guides/pool-nodes.md#tenants-and-keys))",
    ),
    "access_key_from_environment": Entry(
        "`EMS_ACCESS_KEY` (environment only)",
        "the vLLM connector's tenant key, when its `kv_connector_extra_config` names an `access_id` and no `access_key`",
    ),
    "local_pool_dir_from_environment": Entry(
        "`EMS_LOCAL_POOL_DIR`",
        "where the vLLM connector records the host's local pool node (the `local_pool_dir` key wins; "
        "[the local pool node](../guides/vllm.md#with-no-pool-configured-the-hosts-local-pool-node))",
        "`<tmp>/ems-local-pool-<uid>`",
    ),
}
OTHER_READERS = ("pool_keys_from_environment", "access_key_from_environment", "local_pool_dir_from_environment")
# How a setting's default is written, by its kind (the type the table shows)
BOOL_WORDS = {"pool_hedge": ("`on`", "`off`"), "profiling": ("`1`", "off (`1`: on)"), "ucx.python_future": ("`1`", "`0`")}
SIZE_SETTINGS = {
    "pool_capacity",
    "pool_prefault",
    "pool_prefault_ahead",
    "read_cache_capacity",
    "staging_capacity",
    "chunk_bytes",
    "mooncake_buffer",
    "mooncake_segment",
    "local_pool_capacity",  # the connector's key
}
MOONCAKE_FIELDS = {
    "mooncake_master": "master",
    "mooncake_metadata": "metadata",
    "mooncake_protocol": "protocol",
    "mooncake_devices": "devices",
    "mooncake_hostname": "hostname",
    "mooncake_buffer": "buffer_bytes",
    "mooncake_segment": "segment_bytes",
}

# Every key of the vLLM connector's kv_connector_extra_config but the EmsConfig pool settings (one row for those):
# its meaning, and how its default is written where `ConnectorConfig`'s own is not what a user sees.
CONNECTOR_KEYS: dict[str, tuple[str, str | None]] = {
    "pool_nodes": (
        '`["host:port", ...]` (or `"a:1,b:2"`): the pool nodes. Every engine lists the same nodes',
        "`EMS_POOL_NODES`, else none",
    ),
    "local_pool": ('with no nodes: `"auto"` shares the host\'s local node; `"off"`: an embedded pool per process', None),
    "local_pool_dir": (
        "where the local node is recorded (engines that share blocks use the same)",
        "`$EMS_LOCAL_POOL_DIR`, else `/tmp/ems-local-pool-<uid>`",
    ),
    "local_pool_capacity": ("capacity of a local node this engine starts", None),
    "model_id": (
        "key namespace ([keys and namespaces](../concepts/namespaces.md)). Set it only when engines load the same model "
        "from different paths and you know every byte-deciding setting agrees",
        "derived",
    ),
    "timeout_ms": ("`CcKvOption.timeout` of every load and save (a slow pool is a miss past it)", None),
    "lookup_timeout_ms": ("a lookup's timeout (on the lookup thread, never on a step): past it the circuit breaker opens", None),
    "breaker_cooldown_s": ("how often a pool that the breaker counts as down is asked again (on a background thread)", None),
    "lookup_cache_s": ("how long the lookup answer of a request vLLM could not admit yet is reused", None),
    "epoch_refresh_s": (
        "how often the scheduler re-reads the namespace epoch, so a reset by another engine reaches this one",
        None,
    ),
    "step_policy": (
        'lookups and loads in the step (a fast pool, measured) or asynchronously: `"auto"`, `"in_step"`, `"async"` '
        "([the step policy](../concepts/vllm-step-policy.md))",
        None,
    ),
    "in_step_ms": (
        "the step policy's bound: a step's in-step lookups together take at most this, and its in-step loads are "
        "planned within it (one that runs late goes on to twice this before its blocks are recomputed; 0: nothing "
        "in the step)",
        None,
    ),
    "load_failure_policy": (
        "vLLM's `kv_load_failure_policy` where the top-level one says vLLM's default "
        "([load failures](../concepts/failure-semantics.md#load-failures-and-recomputation))",
        '`"recompute"`',
    ),
    "save_wait_ms": (
        "how long a request waits for blocks on their way: to the pool (a producer's, or this engine's own saves) "
        "before it computes them, or into vLLM's prefix cache (another request's load of its prefix) before it loads "
        "its own copy; one bound for every wait of a request (0: never waits; at most 60000)",
        None,
    ),
    "producer_response": (
        'when a producer\'s (`kv_role` `kv_producer`) step, and so its response, ends: `"after_save"`, once the pool '
        'has acknowledged the saves the step sent (at most `producer_wait_ms`); `"immediate"`, with its saves still on '
        "their way (the consumer's wait covers them). `kv_both` engines never wait for their saves "
        "([P/D](../guides/pd.md))",
        None,
    ),
    "producer_wait_ms": (
        "the bound of a producer's wait for its saves: the most a slow or hung pool holds its step (then the step goes "
        "on, and later steps do not wait until those saves have ended); 1 to 60000",
        None,
    ),
    "lease_ms": (
        "how long the pool keeps the blocks a lookup reported for the load that follows (0: no lease; at most 60000); "
        "the load's read ends the lease at once ([leases](../concepts/namespaces.md#a-lookup-is-a-promise-leases))",
        None,
    ),
    "access_id": ("tenant id for nodes started with keys", None),
    "access_key": ("its key (`EMS_ACCESS_KEY` may hold it)", None),
    "cross_layer_blocks": (
        "ask vLLM for its block-outermost KV layout (`BLHNC`), where a block's layers are one run: one copy per block "
        "saved or loaded ([what the connector does each step](../concepts/vllm-steps.md))",
        None,
    ),
    "transfer_granularity": (
        "`step`: a step's blocks move whole, the SDK copying straight from the KV cache; `layer`: through a host "
        "mirror, each layer copied out as the forward writes it and copied in before its attention runs (the pool's "
        "values are the same: the two share blocks; [what the connector does each step](../concepts/vllm-steps.md))",
        None,
    ),
    "layer_buffer_mb": (
        "with `transfer_granularity` `layer`: the host mirror the step's values pass through, in MiB (a step's saves "
        "beyond it are dropped, its loads beyond it recomputed or started on a later step); 1 to 1048576",
        None,
    ),
    "max_inflight": (
        "async calls pending at once: given to the client explicitly, and each worker's budget (a save beyond it is "
        "dropped, a load waits a step)",
        "`EMS_MAX_INFLIGHT`, else {DEFAULT_MAX_INFLIGHT}",
    ),
}


def format_size(value: int) -> str:
    """`1073741824` -> `1GiB`: the largest binary unit that divides it exactly."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if value and value % (1 << shift) == 0:
            return f"{value >> shift}{unit}"
    return str(value)


@contextmanager
def _environment_without(prefixes: tuple[str, ...]) -> Iterator[None]:
    saved = {k: v for k, v in os.environ.items() if k.startswith(prefixes)}
    for k in saved:
        del os.environ[k]
    try:
        yield
    finally:
        os.environ.update(saved)


def setting_names() -> list[str]:
    """Every setting of `Settings`, in its order (UCX's as `ucx.x`, Mooncake's as their `mooncake_x` keywords)."""
    from ems.config import POOL_SETTINGS
    from ems.settings import Settings
    from ems.transport.ucx.config import UcxSettings

    names: list[str] = []
    for f in dataclasses.fields(Settings):
        if f.name == "ucx":
            names += [f"ucx.{u.name}" for u in dataclasses.fields(UcxSettings)]
        elif f.name == "mooncake":
            names += [n for n in POOL_SETTINGS if n.startswith("mooncake_")]
        else:
            names.append(f.name)
    return names


def _annotation(owner: type, name: str) -> Any:
    return typing.get_type_hints(owner)[name]


def _type_text(annotation: Any, setting: str) -> str:
    if setting in SIZE_SETTINGS:
        return "size"
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if args and (typing.get_origin(annotation) in (typing.Union, types.UnionType)):
        annotation = args[0]
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " \\| ".join(f"`{m.value}`" for m in annotation)
    if typing.get_origin(annotation) is tuple:
        return "list of str"
    return getattr(annotation, "__name__", str(annotation))


def _default_text(setting: str, value: object, entry: Entry) -> str:
    if value is None or setting == "cache_dir":  # cache_dir's resolved default is this machine's home
        return entry.none
    if setting in BOOL_WORDS:
        on, off = BOOL_WORDS[setting]
        return on if value else off
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"  # a JSON key's value
    if isinstance(value, enum.Enum):
        value = value.value
    if setting in SIZE_SETTINGS and isinstance(value, int):
        return f"`{format_size(value)}`"
    if isinstance(value, tuple):
        return ", ".join(value) or entry.none
    return '`""`' if value == "" else f"`{value}`"


def settings_rows() -> list[tuple[str, str, str, str, str]]:
    """(setting, type, environment variable, default, meaning) of every setting, then of the variables read outside
    `Settings`. Raises ValueError when the code and `SETTINGS` disagree."""
    from ems import settings as config  # (the readers of the variables outside Settings)
    from ems.config import EmsConfig
    from ems.settings import MooncakeSettings, Settings, resolve_settings
    from ems.transport.ucx.config import UcxSettings

    names = setting_names()
    missing = [n for n in names if n not in SETTINGS]
    extra = [n for n in SETTINGS if n not in names and n not in OTHER_READERS]
    if missing or extra:
        raise ValueError(f"docs/gen_pages.py SETTINGS: settings without an entry {missing}, entries without a setting {extra}")
    with _environment_without(("EMS_", "ENABLE_CC_PROFILING")):
        plain = resolve_settings(EmsConfig())
        os.environ["EMS_POOL_BACKEND"], os.environ["EMS_MOONCAKE_MASTER"] = "mooncake", "127.0.0.1:50051"
        with_mooncake = resolve_settings(EmsConfig())
        del os.environ["EMS_POOL_BACKEND"], os.environ["EMS_MOONCAKE_MASTER"]
    rows = []
    for name in names:
        entry = SETTINGS[name]
        if name.startswith("ucx."):
            field_name = name[4:]
            owner: type = UcxSettings
            value = getattr(plain.ucx, field_name)
        elif name in MOONCAKE_FIELDS:
            field_name, owner = MOONCAKE_FIELDS[name], MooncakeSettings
            value = None if name == "mooncake_master" else getattr(with_mooncake.mooncake, field_name)
        else:
            field_name, owner = name, Settings
            value = getattr(plain, name)
        type_text = _type_text(_annotation(owner, field_name), name)
        rows.append((name, type_text, entry.variable, _default_text(name, value, entry), entry.meaning))
    for reader in OTHER_READERS:
        entry = SETTINGS[reader]
        getattr(config, reader)  # the reader exists
        rows.append((f"`{reader}()`", "str", entry.variable, entry.none, entry.meaning))
    return rows


def settings_table() -> str:
    lines = ["| setting | type | environment variable | default | meaning |", "|---|---|---|---|---|"]
    for name, type_text, variable, default, meaning in settings_rows():
        shown = name if name.startswith("`") else f"`{name}`"
        lines.append(f"| {shown} | {type_text} | {variable} | {default} | {meaning} |")
    return "\n".join(lines)


def connector_rows() -> list[tuple[str, str, str, str]]:
    """(key, type, default, meaning) of every `kv_connector_extra_config` key; the EmsConfig pool settings as one
    row. Raises ValueError when the code and `CONNECTOR_KEYS` disagree."""
    from ems.integrations import connector_config as cc
    from ems.settings import DEFAULT_MAX_INFLIGHT

    own = [k for k in cc.KEYS if k not in cc.EMS_SETTINGS]
    documented = set(CONNECTOR_KEYS)
    missing = [k for k in own if k not in documented]
    extra = [k for k in documented if k not in cc.KEYS]
    if missing or extra:
        raise ValueError(f"docs/gen_pages.py CONNECTOR_KEYS: keys without an entry {missing}, entries without a key {extra}")
    fields = {f.name: f for f in dataclasses.fields(cc.ConnectorConfig)}
    hints = typing.get_type_hints(cc.ConnectorConfig)
    rows = []
    for key in [*own, "max_inflight"]:
        meaning, default = CONNECTOR_KEYS[key]
        value = fields[key].default
        if default is None:
            default = _default_text(key, value, Entry("", ""))
        type_text = _type_text(hints[key], key)
        if key in ("pool_nodes",):
            type_text = "list of str, or str"
        rows.append((key, type_text, default.format(DEFAULT_MAX_INFLIGHT=DEFAULT_MAX_INFLIGHT), meaning))
    others = [k for k in cc.EMS_SETTINGS if k != "max_inflight"]
    rows.append(
        (
            ", ".join(others),
            "as `EmsConfig`",
            "as `EmsConfig`",
            "the `EmsConfig` pool settings ([Configuration](configuration.md)); their `EMS_*` variables work too. "
            'With `pool_etcd` (or `EMS_POOL_ETCD`) the nodes come from etcd membership, and with `pool_backend: "mooncake"` (or '
            "`EMS_POOL_BACKEND`) the pool is a Mooncake Store: no local pool node is started in either case",
        )
    )
    return rows


def connector_table() -> str:
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for key, type_text, default, meaning in connector_rows():
        names = ", ".join(f"`{k.strip()}`" for k in key.split(","))
        lines.append(f"| {names} | {type_text} | {default} | {meaning} |")
    return "\n".join(lines)


def _perf_results() -> Any:
    spec = importlib.util.spec_from_file_location("ems_docs_perf_results", ROOT / "perf" / "results.py")
    if spec is None or spec.loader is None:
        raise ImportError("perf/results.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def plots() -> dict[str, Path]:
    """Every plot the benchmarks page shows: site path -> the file under perf/."""
    found: dict[str, Path] = {}
    for run in _perf_results().load_all():
        for path in _run_plots(run):
            found[f"benchmarks/plots/{path.name}"] = path
    return found


def _run_plots(run: Any) -> list[Path]:
    named = [ROOT / f.plot for f in run.figures if f.plot]
    own = ROOT / "perf" / f"{run.bench}.png"
    paths = named or ([own] if own.exists() else [])
    return [p for i, p in enumerate(paths) if p.exists() and p not in paths[:i]]


def results_markdown() -> str:
    """The benchmarks page's body: one row per benchmark's latest recorded run (when, which commit, its goals met),
    linking the page of its figures (`result_page`)."""
    results = _perf_results()
    runs = results.load_all()
    if not runs:
        raise ValueError("perf/results/ holds no results: run a benchmark that records them (perf/bench_goals.py)")
    out = ["| benchmark | measured | commit | figures | goals met |", "|---|---|---|---|---|"]
    for run in runs:
        goals = [f for f in run.figures if f.met is not None]
        met = sum(1 for f in goals if f.met)
        out.append(
            f"| [`{run.bench}`](results/{run.bench}.md) | {run.date} | `{run.commit}` | {len(run.figures)} | "
            f"{f'{met} of {len(goals)}' if goals else '-'} |"
        )
    return "\n".join(out) + "\n"


def result_page(run: Any) -> str:
    """One benchmark's latest run: its command, its figures (ratio and anchor, goal) and its plots."""
    results = _perf_results()
    out = [
        f"# `{run.bench}`",
        "",
        "The latest recorded run (`perf/results/" + run.bench + ".json`); the benchmarks page:",
        "[Benchmarks](../index.md).",
        "",
        results.markdown(run),
        "",
    ]
    for f in run.figures:
        if f.note:
            out.append(f"- {f.name}: {f.note}")
    out.append("")
    for path in _run_plots(run):
        out += [f"![{run.bench}: {path.name}](../plots/{path.name})", ""]
    return "\n".join(out)


def result_pages() -> dict[str, str]:
    """site path -> page text, one per benchmark with recorded results."""
    return {f"benchmarks/results/{run.bench}.md": result_page(run) for run in _perf_results().load_all()}


class ArchivePage(NamedTuple):
    name: str  # benchmarks/archive/NN.md
    title: str
    sections: list[str]  # the `## ` headings it holds
    text: str


def archive_pages(source: Path = ROOT / "perf" / "RESULTS.md") -> list[ArchivePage]:
    """perf/RESULTS.md cut at its `## ` sections into pages of at most ARCHIVE_PAGE_CHARS characters (a longer
    section is a page of its own), in order."""
    text = source.read_text(encoding="utf-8")
    sections = [s for s in re.split(r"(?m)^(?=## )", text) if s.startswith("## ")]
    groups: list[list[str]] = []
    for section in sections:
        if groups and sum(map(len, groups[-1])) + len(section) <= ARCHIVE_PAGE_CHARS:
            groups[-1].append(section)
        else:
            groups.append([section])
    pages = []
    for i, group in enumerate(groups, 1):
        headings = [s.splitlines()[0][3:].strip() for s in group]
        dates = [d for h in headings for d in re.findall(r"20\d\d-\d\d-\d\d", h)]
        span = f" ({dates[0]} to {dates[-1]})" if dates and dates[0] != dates[-1] else f" ({dates[0]})" if dates else ""
        title = f"Benchmark archive, part {i}{span}"
        body = f"# {title}\n\nRuns as they were appended to `perf/RESULTS.md`, each with its command.\n\n" + "".join(group)
        pages.append(ArchivePage(f"benchmarks/archive/{i:02d}.md", title, headings, body))
    return pages


def archive_index(pages: list[ArchivePage]) -> str:
    lines = [
        "# Benchmark archive",
        "",
        "Every run recorded in `perf/RESULTS.md` since the first, in the order they were appended, each with the command",
        "that made it and its reading at the time (older figures describe older code). The current figures are on",
        "[the benchmarks page](../index.md). Generated from `perf/RESULTS.md` at every build.",
        "",
    ]
    for page in pages:
        subjects = "; ".join(dict.fromkeys(_subject(h) for h in page.sections))
        runs = f"{len(page.sections)} run{'s' if len(page.sections) > 1 else ''}"
        lines += [f"## [{page.title}]({Path(page.name).name})", "", f"{runs}: {subjects}.", ""]
    return "\n".join(lines)


def _subject(heading: str) -> str:
    """What an archived run is about, for the archive's index: its heading up to the first colon, without the date
    and machine in brackets (the page's title has the dates; the page itself every heading in full). The index stays
    a few lines per page however long the log grows."""
    return re.sub(r"\s*\(20\d\d-\d\d-\d\d[^)]*\)", "", heading.split(":")[0]).strip()


# ---- the MkDocs hook ----


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    pages = archive_pages()
    files.append(File.generated(config, "benchmarks/archive/index.md", content=archive_index(pages)))
    for page in pages:
        files.append(File.generated(config, page.name, content=page.text))
    for site_path, text in result_pages().items():
        files.append(File.generated(config, site_path, content=text))
    for site_path, path in plots().items():
        files.append(File.generated(config, site_path, abs_src_path=str(path)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    generators = {MARKERS[0]: settings_table, MARKERS[1]: connector_table, MARKERS[2]: results_markdown}
    for marker, make in generators.items():
        if marker in markdown:
            markdown = markdown.replace(marker, make())
    return markdown
