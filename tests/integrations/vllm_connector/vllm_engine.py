"""Run one vLLM engine in this process and print its results as JSON (used by the tests and perf/bench_vllm.py).

    python tests/integrations/vllm_connector/vllm_engine.py SPEC.json OUT.json

SPEC: {"model": dir, "prompts": [[token ids], ...], "max_tokens": int, "connector": bool,
       "extra": {kv_connector_extra_config}, "kv_load_failure_policy": str (top level; default: vLLM's),
       "kv_role": "kv_both" (default) | "kv_producer" | "kv_consumer",
       "kv_transfer_params": {"<prompt index>": {...}} (a P/D proxy's, handed to that prompt's request),
       "hf_overrides": {...}, "dtype": str (default bfloat16), "tensor_parallel_size": int, "num_blocks": int,
       "max_model_len": int,
       "rounds": [[prompt indexes], ...] (default: one round with every prompt),
       "before_round": {"<round index>": {"reset_prefix_cache": bool, "reset_connector": bool, "kill_pid": pid,
                                          "kill_pid_at_next_load": pid}}}
  reset_connector: `llm.reset_prefix_cache(reset_connector=True)` (vLLM's and the connector's caches).
  wait_saves: wait until the earlier rounds' saves are in the pool (single-process mode).
  "batch": true: each round's prompts go to vLLM at once (concurrent requests; `n`, `temperature`, `seed` set the
  sampling, `top_k`), and the round records every engine step's seconds ("step_s", "max_step_s"), the
  round's wall time ("wall_s"), the CPU seconds of this process's threads by name and of the local pool node in
  `extra.local_pool_dir` ("cpu_s") and the most KV cache blocks in use at once ("max_used_blocks", single-process
  mode); with "log_stats": true each request's "ttft_s" and mean "itl_s" (vLLM's
  per-request timestamps); "sigstop_pid" in before_round stops a
  process (a hung pool node) for that round and resumes it after the round. "copy_delay_s": in that round every
  save's copy-out starts that late; "hold_copy_outs": in that round copy-outs first wait for the next preemption
  (at most 30 s); "preempt_running_at_step": before that step of the round every running request
  is preempted (out: "held_preemptions", preemptions that found a preempted request's copy-out still pending;
  single-process mode).
  kill_pid kills a process (a pool node) before the round; kill_pid_at_next_load kills it inside the worker's
  start_load_kv just before the connector's next load (after the scheduler's lookup promised the blocks), so the
  load fails and vLLM must recompute (single-process mode only).
  "progress_file": each finished request appends its prompt index to this file (with "batch": a round's, once
  the round has finished), for another engine to follow. "follow": {"file": path, "lag": n, "total": t}: before
  prompt i (a batch round: its largest i) this engine waits until the followed file has min(i + 1 + n, t) lines
  (n may be negative). Two engines that follow each other with lags n and -(n + 2) run in step: this one reads
  prompt i while the other computes prompt i + n + 1 (the pool-pressure test).
  "turns_file": a file engines share to take turns (perf/bench_vllm.py --fair): a batch round whose before_round has
  "turn": t waits until the file has t lines and the engines that wrote them are quiet (`wait_quiet`: a vLLM engine's
  workers spin for a second after its last step), and appends one line once it has finished (so turn t + 1 may
  start).
OUT: {"rounds": [[{"tokens": [...], "num_cached_tokens": n, "ttft_s": s, "finish_reason": str,
                  "kv_transfer_params": {...} (what the connector returned for the request)}, ...], ...],
     "stats": {...}, "kv_cache_groups": [spec kind per group] (single-process mode), "preemptions": n,
     "events": [[type, blocks, medium], ...] (single-process mode),
     "layout": {"vllm": vLLM's resolved KV cache layout, "cross_layer": [per registered group],
                "copy_ops": the copy backend's device operations over the rounds} (single-process mode),
     "step_records": {"<batch round>": {"scheduler": [...], "worker": [...]}} (the connector's per-step record of
                     each batch round, `EmsConnector.step_records`; single-process mode)}
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: proc_cpu, for this script run on its own too
from proc_cpu import process_cpu_seconds, threads_cpu_seconds, tree_cpu_seconds


def make_tiny_llama(
    path: str,
    hidden: int = 128,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 512,
    intermediate: int = 256,
    max_pos: int = 4096,
    seed: int = 0,
) -> str:
    """A random Llama written with transformers (no download)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        intermediate_size=intermediate,
        max_position_embeddings=max_pos,
        torch_dtype="bfloat16",
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    return path


def make_tiny_gemma2(
    path: str, hidden: int = 128, layers: int = 4, sliding_window: int = 64, vocab: int = 512, seed: int = 0
) -> str:
    """A random Gemma2 (a hybrid model: sliding-window and full-attention layers alternate) written with transformers."""
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(seed)
    config = Gemma2Config(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=vocab,
        intermediate_size=256,
        max_position_embeddings=4096,
        sliding_window=sliding_window,
        torch_dtype="bfloat16",
    )
    model = Gemma2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    return path


def make_tiny_deepseek(
    path: str,
    hidden: int = 128,
    layers: int = 2,
    heads: int = 4,
    vocab: int = 512,
    kv_lora_rank: int = 512,
    rope_dim: int = 64,
    nope_dim: int = 64,
    v_dim: int = 64,
    max_pos: int = 4096,
    seed: int = 0,
) -> str:
    """A random DeepSeek-V2-style model (MLA attention, dense MLPs only) written with transformers."""
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    torch.manual_seed(seed)
    config = DeepseekV2Config(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        vocab_size=vocab,
        intermediate_size=256,
        moe_intermediate_size=64,
        max_position_embeddings=max_pos,
        kv_lora_rank=kv_lora_rank,
        q_lora_rank=None,
        qk_rope_head_dim=rope_dim,
        qk_nope_head_dim=nope_dim,
        v_head_dim=v_dim,
        first_k_dense_replace=layers,
        n_routed_experts=4,
        num_experts_per_tok=2,
        torch_dtype="bfloat16",
        tie_word_embeddings=False,
    )
    model = DeepseekV2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    return path


def token_times(out) -> dict:
    """A request's first-token latency and mean inter-token latency from vLLM's per-request stats ("log_stats")."""
    m = getattr(out, "metrics", None)
    if m is None or not getattr(m, "first_token_ts", 0.0):
        return {}
    itl = (m.last_token_ts - m.first_token_ts) / (m.num_generation_tokens - 1) if m.num_generation_tokens > 1 else 0.0
    return {"ttft_s": m.first_token_ts - m.queued_ts, "itl_s": itl}


def wait_for_lines(path: str, count: int, timeout_s: float = 300.0) -> None:
    """Wait until the file at `path` has at least `count` lines (another engine's progress)."""
    deadline = time.monotonic() + timeout_s
    while count > 0:
        try:
            with open(path) as f:
                if sum(1 for _ in f) >= count:
                    return
        except FileNotFoundError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not reach {count} lines in {timeout_s} s")
        time.sleep(0.01)


def turn_takers(path: str) -> list[int]:
    """The other engines that wrote a line to the turns file at `path` ("PID round R"; none before the first turn)."""
    try:
        with open(path) as f:
            pids = {int(line.split()[0]) for line in f if line.strip()}
    except FileNotFoundError:
        return []
    return sorted(pids - {os.getpid()})


def wait_quiet(pids: list[int], share: float = 0.05, window_s: float = 0.1, max_s: float = 5.0) -> float:
    """Wait until the process trees of `pids` together use less than `share` of one core over a `window_s` window
    (at most `max_s`); returns the seconds waited. Between two servers' runs: vLLM's multi-process workers spin
    (`sched_yield`) for `MessageQueue.busy_loop_s` (1 s) after their last step, and a run that starts inside that
    second shares the cores with the previous server's spin."""
    start = time.monotonic()
    before = sum(tree_cpu_seconds(p) for p in pids)
    while time.monotonic() - start < max_s:
        time.sleep(window_s)
        now = sum(tree_cpu_seconds(p) for p in pids)
        if now - before < share * window_s:
            break
        before = now
    return time.monotonic() - start


def kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    for _ in range(200):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.01)


def stop_processes(procs: Iterable[subprocess.Popen], grace_s: float = 30.0) -> None:
    """End `procs` (servers, pool nodes, a benchmark's CPU competitor): each still running is asked to end (SIGTERM),
    killed when still running `grace_s` later, and reaped."""
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def stop_servers(procs: Iterable[subprocess.Popen], pool_dir: str, grace_s: float = 60.0) -> None:
    """Stop vLLM API servers started on one local pool node (test_pd_servers.py, perf/bench_vllm.py --pd):
    `stop_processes`, then the pool node in `pool_dir` is stopped."""
    from ems.integrations.local_pool import stop_local_pool

    stop_processes(procs, grace_s)
    stop_local_pool(pool_dir)


def kill_at_next_load(pid: int) -> None:
    """Fault injection: kill `pid` inside the worker connector's next start_load_kv that has loads to do."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group()
    original = worker.start_load_kv

    def start_load_kv(forward_context, **kwargs):
        meta = worker._connector_metadata
        if meta is not None and getattr(meta, "loads", None):
            kill(pid)
            worker.start_load_kv = original
        return original(forward_context, **kwargs)

    worker.start_load_kv = start_load_kv


def delay_copy_outs(control: dict, held_preemptions: list[int]) -> None:
    """Fault injection through the hook an accelerator's "kernels done" event uses: every save's copy-out waits, with
    `control["hold"]`, for the next preemption (at most 30 s), then `control["delay_s"]`, so copy-outs lag the steps
    and vLLM must keep blocks for them; counts the preemptions that found a preempted request's copy-out still
    pending (single-process mode only)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group()

    def ready():
        hold, released, delay = control["hold"], control["released"], control["delay_s"]

        def wait() -> None:
            if hold:
                released.wait(30)
            time.sleep(delay)

        return wait

    saves = worker.connector_worker.saves  # the worker half's saves (ems.integrations.vllm.worker_saves)
    saves._ready_event = ready
    original = worker.handle_preemptions

    def handle_preemptions(meta):
        if any(saves.copying(rid) for rid in getattr(meta, "preempted", ())):
            held_preemptions[0] += 1
        if getattr(meta, "preempted", None):
            control["released"].set()  # the held copy-outs run now; the real hook waits for them
        return original(meta)

    worker.handle_preemptions = handle_preemptions


def preempt_running(llm) -> None:
    """Preempt every running request, as vLLM's `reset_prefix_cache(reset_running_requests=True)` does (a weight
    update): their blocks go back to the pool and the next step may hand them to other requests."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    timestamp = time.monotonic()
    while scheduler.running:
        scheduler._preempt_request(scheduler.running.pop(), timestamp, drop_stale_output=True)
    scheduler.prev_step_scheduled_req_ids.clear()


def job_totals() -> dict:
    """This process's job records (`ContextCaching.jobs`): per kind, jobs, blocks, bytes and seconds (each job from
    its call to its end), and the seconds of each stage summed over the jobs."""
    from ems import Ems
    from ems.records import JobKind

    cc = Ems.get_cc()
    if cc is None:
        return {}
    out = {}
    for kind in JobKind:
        t = cc.jobs.totals(kind)
        stages = {stage.value: [r.nbytes, r.seconds, r.runs] for stage, r in t.stages.items()}
        out[kind.value] = {
            "jobs": t.jobs,
            "blocks_ok": t.blocks_ok,
            "nbytes": t.nbytes,
            "seconds": t.seconds,
            "stages": stages,  # stage → [bytes, seconds, runs], summed over the jobs
        }
    return out


def connector_steps(llm, since: float) -> dict:
    """The connector's per-step record (`EmsConnector.step_records`) since `since` (time.monotonic()): the
    scheduler's and the worker's (single-process mode only; {} otherwise)."""
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        return {}
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    scheduler = llm.llm_engine.engine_core.engine_core.scheduler.connector
    if scheduler is None:
        return {}
    worker = get_kv_transfer_group()
    return {
        "scheduler": [r for r in scheduler.step_records() if r["at_s"] >= since],
        "worker": [r for r in worker.step_records() if r["at_s"] >= since],
    }


def copy_backend(spec: dict):
    """The copy backend of this process's registered cache (the worker's, in single-process mode), or None."""
    from ems import Ems
    from ems.kernels.base import KernelBackend
    from ems.kernels.select import get_backend

    cc = Ems.get_cc()
    if cc is None or cc.layout is None:
        return None
    return get_backend(cc.layout.device, KernelBackend(spec.get("extra", {}).get("kernel_backend", "auto")))


def cpu_seconds(pool_dir: str | None) -> dict:
    """CPU seconds so far (user + system) of each of this process's threads, summed by thread name, and of the local
    pool node recorded in `pool_dir` ("pool node"): where a round's CPU went."""
    out: dict = threads_cpu_seconds("self")
    if pool_dir:
        try:
            with open(os.path.join(pool_dir, "pool.json")) as f:
                pid = int(json.load(f)["pid"])
        except (OSError, ValueError, KeyError):
            return out
        out["pool node"] = process_cpu_seconds(pid)
    return out


def settle(llm) -> None:
    """Step an in-process engine until no finished request holds blocks (the connector keeps a finished request's
    blocks until its saves are copied out, and `generate` returns before the step that releases them): vLLM
    resets its prefix cache only when every block is free. A multi-process engine core steps on by itself."""
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        return
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    deadline = time.monotonic() + 30
    while scheduler.has_finished_requests() and time.monotonic() < deadline:
        llm.llm_engine.step()


def run(spec: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kwargs: dict = {}
    if spec.get("connector", True):
        policy = {"kv_load_failure_policy": spec["kv_load_failure_policy"]} if "kv_load_failure_policy" in spec else {}
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="EmsConnector",
            kv_connector_module_path="ems.integrations.vllm",
            kv_role=spec.get("kv_role", "kv_both"),
            kv_connector_extra_config=spec.get("extra", {}),
            **policy,
        )
    if spec.get("torch_threads"):
        import torch

        torch.set_num_threads(int(spec["torch_threads"]))
    if spec.get("hf_overrides"):
        kwargs["hf_overrides"] = spec["hf_overrides"]
    llm = LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        dtype=spec.get("dtype", "bfloat16"),
        block_size=32,
        max_model_len=spec.get("max_model_len", 1024),
        num_gpu_blocks_override=spec.get("num_blocks", 64),
        max_num_batched_tokens=spec.get("max_num_batched_tokens", 4096),
        enable_prefix_caching=True,
        seed=0,
        enforce_eager=True,
        disable_log_stats=not spec.get("log_stats", False),
        tensor_parallel_size=spec.get("tensor_parallel_size", 1),  # per-request token timestamps (RequestOutput.metrics)
        gpu_memory_utilization=spec.get("gpu_memory_utilization", 0.15),
        **kwargs,
    )
    params = SamplingParams(
        temperature=spec.get("temperature", 0.0),
        max_tokens=spec.get("max_tokens", 4),
        ignore_eos=True,
        n=spec.get("n", 1),
        seed=spec.get("seed"),
        top_k=spec.get("top_k", 0),
    )
    step_seconds: list[float] = []
    engine_step = llm.llm_engine.step
    preempt_at = [-1]  # this round's step at which every running request is preempted (-1: none)

    used_blocks = [0]  # this round's most KV cache blocks in use at once (single-process mode)
    block_pool = (
        llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
        else None
    )

    def timed_step(*args, **kwargs):
        if len(step_seconds) == preempt_at[0]:
            preempt_running(llm)
        start = time.perf_counter()
        try:
            return engine_step(*args, **kwargs)
        finally:
            step_seconds.append(time.perf_counter() - start)
            if block_pool is not None:
                used_blocks[0] = max(used_blocks[0], block_pool.num_gpu_blocks - block_pool.get_num_free_blocks())

    llm.llm_engine.step = timed_step
    preemptions = [0]
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":  # count the scheduler's preemptions
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        preempt = scheduler._preempt_request

        def counted_preempt(*args, **kwargs):
            preemptions[0] += 1
            return preempt(*args, **kwargs)

        scheduler._preempt_request = counted_preempt
    events: list[list] = []  # the connector's KV events as vLLM's scheduler collects them: [type, blocks, medium]
    if spec.get("connector", True) and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
        connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
        take_events = connector.take_events

        def recorded_events():
            taken = list(take_events())
            events.extend([type(e).__name__, len(getattr(e, "block_hashes", ())), getattr(e, "medium", None)] for e in taken)
            return taken

        connector.take_events = recorded_events
    held_preemptions = [0]
    copy_control = {"delay_s": 0.0, "hold": False, "released": threading.Event()}
    if spec.get("connector", True) and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
        delay_copy_outs(copy_control, held_preemptions)
    step_records: dict[str, dict] = {}  # batch round -> the connector's per-step record of that round
    single_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
    backend = copy_backend(spec) if spec.get("connector", True) and single_process else None
    ops_before = backend.ops_issued if backend is not None else 0
    prompts = spec["prompts"]
    rounds = spec.get("rounds") or [list(range(len(prompts)))]
    progress_file, follow = spec.get("progress_file"), spec.get("follow")
    out_rounds = []
    for r, indexes in enumerate(rounds):
        before = spec.get("before_round", {}).get(str(r), {})
        if before.get("reset_prefix_cache") or before.get("reset_connector"):
            settle(llm)
        if before.get("wait_saves") and single_process:  # the earlier rounds' saves are in the pool
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            if not get_kv_transfer_group().wait_saves(120.0):
                raise RuntimeError("saves still pending after 120 s")
        copy_control["delay_s"] = float(before.get("copy_delay_s", 0.0))
        copy_control["hold"] = bool(before.get("hold_copy_outs", False))
        copy_control["released"] = threading.Event()
        preempt_at[0] = int(before.get("preempt_running_at_step", -1))
        if before.get("reset_prefix_cache") and not llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache")
        if before.get("reset_connector") and not llm.reset_prefix_cache(reset_connector=True):
            raise RuntimeError("vLLM (or the connector) refused to reset its caches")
        if before.get("kill_pid"):
            kill(int(before["kill_pid"]))
        if before.get("kill_pid_at_next_load"):
            kill_at_next_load(int(before["kill_pid_at_next_load"]))
        if before.get("sigstop_pid"):
            os.kill(int(before["sigstop_pid"]), signal.SIGSTOP)
        turn = before.get("turn")
        if spec.get("batch"):
            if follow:
                wait_for_lines(follow["file"], min(max(indexes) + 1 + int(follow.get("lag", 0)), int(follow["total"])))
            if turn is not None:  # (the other engine may still be starting: minutes on a busy host)
                wait_for_lines(spec["turns_file"], int(turn), timeout_s=1800.0)
                wait_quiet(turn_takers(spec["turns_file"]))  # the turn before's engine core and workers idle first
            step_seconds.clear()
            used_blocks[0] = 0
            cpu_before = cpu_seconds(spec.get("extra", {}).get("local_pool_dir"))
            round_start = time.monotonic()
            start = time.perf_counter()
            try:
                outs = llm.generate([{"prompt_token_ids": prompts[i]} for i in indexes], params, use_tqdm=False)
            finally:
                if before.get("sigstop_pid"):
                    os.kill(int(before["sigstop_pid"]), signal.SIGCONT)
            wall = time.perf_counter() - start
            cpu_after = cpu_seconds(spec.get("extra", {}).get("local_pool_dir"))
            round_cpu = {k: round(v - cpu_before.get(k, 0.0), 3) for k, v in cpu_after.items()}
            step_records[str(r)] = connector_steps(llm, round_start)
            if turn is not None:
                with open(spec["turns_file"], "a") as f:
                    f.write(f"{os.getpid()} round {r}\n")
            if progress_file:
                with open(progress_file, "a") as f:
                    f.write("".join(f"{i}\n" for i in indexes))
            out_rounds.append(
                [
                    {
                        "prompt": i,
                        "samples": sorted(list(o.token_ids) for o in out.outputs),
                        "finish_reason": out.outputs[0].finish_reason,
                        "num_cached_tokens": out.num_cached_tokens,
                        "max_step_s": max(step_seconds, default=0.0),
                        "step_s": list(step_seconds),
                        "wall_s": wall,
                        "cpu_s": round_cpu,
                        "max_used_blocks": used_blocks[0],
                        **token_times(out),
                    }
                    for i, out in zip(indexes, outs)
                ]
            )
            continue
        results = []
        for i in indexes:  # one request at a time: TTFT and num_cached_tokens per prompt
            if follow:
                wait_for_lines(follow["file"], min(i + 1 + int(follow.get("lag", 0)), int(follow["total"])))
            loads_before = job_totals().get("load", {})
            start = time.perf_counter()
            transfer = spec.get("kv_transfer_params", {}).get(str(i))
            request_params = params
            if transfer is not None:
                request_params = params.clone()
                request_params.extra_args = {"kv_transfer_params": transfer}
            out = llm.generate([{"prompt_token_ids": prompts[i]}], request_params, use_tqdm=False)[0]
            seconds = time.perf_counter() - start
            loads_after = job_totals().get("load", {})
            results.append(
                {
                    "prompt": i,
                    "tokens": list(out.outputs[0].token_ids),
                    "num_cached_tokens": out.num_cached_tokens,
                    "finish_reason": out.outputs[0].finish_reason,
                    "kv_transfer_params": out.kv_transfer_params,
                    "seconds": seconds,
                    # this request's load jobs (the connector's, in this process): bytes and seconds
                    "load_bytes": loads_after.get("nbytes", 0) - loads_before.get("nbytes", 0),
                    "load_seconds": loads_after.get("seconds", 0.0) - loads_before.get("seconds", 0.0),
                }
            )
            if progress_file:
                with open(progress_file, "a") as f:
                    f.write(f"{i}\n")
        out_rounds.append(results)
    stats: dict = {}
    if spec.get("connector", True) and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        worker = get_kv_transfer_group()
        if not worker.wait_saves(30.0):
            raise RuntimeError("saves still pending after 30 s")
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler.connector
        stats = {"worker": worker.totals().to_dict(), "scheduler": scheduler.totals().to_dict(), "jobs": job_totals()}
    layout: dict = {"vllm": llm.llm_engine.vllm_config.cache_config.kv_cache_layout}
    if backend is not None:
        from ems import Ems

        registered = Ems.get_cc().layout
        layout["cross_layer"] = [g.cross_layer for g in registered.groups]
        layout["copy_ops"] = backend.ops_issued - ops_before
    block_size = int(llm.llm_engine.vllm_config.cache_config.block_size)  # what the attention backend settled on
    kv_groups: list[str] = []  # the engine's KV cache groups (single-process mode): their spec kinds
    if single_process:
        config = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
        kv_groups = [type(g.kv_cache_spec).__name__ for g in config.kv_cache_groups]
    llm.llm_engine.engine_core.shutdown()  # workers' connectors finish their pending saves
    return {
        "block_size": block_size,
        "kv_cache_groups": kv_groups,
        "rounds": out_rounds,
        "stats": stats,
        "preemptions": preemptions[0],
        "held_preemptions": held_preemptions[0],
        "events": events,
        "step_records": step_records,
        "layout": layout,
    }


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    result = run(spec)
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    os._exit(0)
