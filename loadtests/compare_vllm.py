"""Our Serve app with the vLLM engine versus plain ``vllm serve``, same engine options.

    python -m loadtests.compare_vllm [--rounds 2] [--concurrency 1,8,32] [--out FILE.json]
    python -m loadtests.compare_vllm --paired 8 [--concurrency 1,8,32] [--settle-s 1]

On the tiny checkpoint (``models/tiny``, built if missing) it alternates, in each round:

* (a) ``ours``: a local Ray and our application with ``engine.name: vllm`` in its default
  layout (one Server replica: ingress, router and ComputeWorker in one process;
  ``--apart`` for the ingress and worker as two deployments; data plane off, as plain
  vLLM has none), then ``ray.shutdown()``;
* (b) ``vllm``: ``python -m vllm.entrypoints.openai.api_server`` in its own process group
  (the ``vllm`` CLI trips over this package's name), then the whole group is stopped.

Never both at once. ``--paired N`` instead starts both once (plain vLLM on the next
port) and keeps the one not being measured frozen (SIGSTOP of its processes, see
``loadtests.paired``); then N pairs of back-to-back slices, one level of each system at
each concurrency, the order flipped from one slice pair to the next, the load sent from a
spawned process (not this one, a Ray driver), and a ratio per pair: the median ratio with
a bootstrap 90% interval per concurrency. A round of the
default mode puts a start-up (a minute or more) between its two systems, and this
machine's speed drifts that much between minutes; the two slices of a pair are seconds
apart. The report also says how much CPU a frozen system used during the other's slices
(0 when the freeze held). The vLLM engine options are the ones our config produces
(``engine_args_kwargs``: enforce_eager, max_num_seqs, KV cache bytes, dtype, prefix
caching, seed...), turned into the server's command-line flags, so both run the same
engine. Each system is measured with ``loadtests.benchmark.run_level`` (completions
endpoint, token-id prompts, ignore_eos, streaming) at each concurrency. The table, the
ratios ours/vllm of output-token throughput and of TTFT p50 (median over rounds), the
machine's load average around each phase, and where the CPU went (seconds per process
role over each level, and per 1000 output tokens: vLLM's forward and scheduler, its API
server or our ingress, worker and Serve proxy) go to stdout and to the JSON file. Loopback
only. Every process is stopped at the end, also on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from loadtests.benchmark import add_ingress_option, format_table, run_level, write_report

MODEL_NAME = "bench"


def _say(msg: str) -> None:
    print(f"[compare_vllm] {msg}", file=sys.stderr, flush=True)


def app_args(model_path: Path, args) -> dict:
    return {
        "model": {"id": MODEL_NAME, "path": str(model_path)},
        "engine": {
            "name": "vllm",
            "max_num_seqs": args.max_num_seqs,
            "vllm": {"enforce_eager": True, "cpu_kv_cache_space_gib": args.kv_gib},
        }
        | (
            {"stream_max_messages_per_s": args.stream_max_messages_per_s}
            if getattr(args, "stream_max_messages_per_s", None) is not None
            else {}
        )
        | (
            {"stream_interval_ms": args.stream_interval_ms}
            if getattr(args, "stream_interval_ms", None) is not None
            else {}
        ),
        # Ray sets OMP_NUM_THREADS to an actor's num_cpus (the EngineCore inherits it):
        # all cores, as plain vLLM's torch uses by default.
        "compute": {"num_replicas": 1, "num_cpus": os.cpu_count() or 1},
        "router": {"max_queue_depth": 1024},
        # None: the config's default (the ingress and its worker in one process, for one
        # vLLM replica); --with-worker / --apart say it outright.
        "ingress": {} if getattr(args, "with_worker", None) is None else {"with_worker": args.with_worker},
        "limits": {"default_max_tokens": args.output_len},
        "dataplane": {"enabled": False},
    }


def vllm_flags(model_path: Path, args) -> list[str]:
    """``api_server`` flags for exactly the engine arguments our config gives vLLM."""
    from app.config import AppConfig
    from deployments.compute.engines.vllm_engine import _on_cpu, engine_args_kwargs

    cfg = AppConfig.model_validate(app_args(model_path, args))
    kwargs = engine_args_kwargs(
        model_path=str(model_path),
        served_model_name=MODEL_NAME,
        dtype=cfg.model.dtype,
        max_model_len=cfg.model.max_model_len,
        max_num_seqs=cfg.engine.max_num_seqs,
        options=cfg.engine.vllm,
        on_cpu=_on_cpu(),
    )
    flags: list[str] = []
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, (dict, list)):
            flags += [flag, json.dumps(value)]  # vLLM parses a config flag's value as JSON
        else:
            flags += [flag, str(value)]
    return flags


def _loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def wait_http(url: str, timeout_s: float, proc: Optional[subprocess.Popen] = None) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} not ready after {timeout_s}s")


class VLLMServer:
    """``python -m vllm.entrypoints.openai.api_server`` in its own process group."""

    def __init__(self, flags: list[str], port: int, log_path: Path):
        self.cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            *flags, "--host", "127.0.0.1", "--port", str(port),
        ]
        self.port = port
        self.log_path = log_path
        self.proc: Optional[subprocess.Popen] = None

    def start(self, timeout_s: float) -> float:
        started = time.monotonic()
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            self.cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            wait_http(f"http://127.0.0.1:{self.port}/v1/models", timeout_s, self.proc)
        except BaseException:
            self.stop()
            raise
        return time.monotonic() - started

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        pgid = proc.pid  # start_new_session: the leader's pid is the group's id
        try:
            os.killpg(pgid, signal.SIGTERM)  # the server, its EngineCore and workers
            proc.wait(30)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            _say("vLLM server ignored SIGTERM for 30 s")
        # The EngineCore and its workers may outlive the leader for a moment.
        deadline = time.monotonic() + 10
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.5)
        if _group_alive(pgid):
            os.killpg(pgid, signal.SIGKILL)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            _say(f"vLLM server {proc.pid} still there after SIGKILL")
        self._log.close()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


class OurApp:
    """A local Ray with our application; ``stop`` shuts Ray down (its processes too)."""

    def __init__(self, model_path: Path, args, port: int):
        self.app_args = app_args(model_path, args)
        self.ingress = getattr(args, "ingress", "auto")
        self.port = port
        self.running = False

    def application(self):
        """The Serve application to run (a subclass may run another)."""
        from app.builder import build_app

        return build_app(self.app_args)

    def start(self, timeout_s: float) -> float:
        import ray
        from ray import serve

        from app.builder import use_serve_process_env

        started = time.monotonic()
        self.running = True
        self.ingress = use_serve_process_env(self.ingress)  # as app.cli does ("auto" resolved)
        _say(f"our app's ingress: {self.ingress}")
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": self.port})
        serve.run(self.application(), name="bench", route_prefix="/", blocking=False)
        wait_http(f"http://127.0.0.1:{self.port}/ready", timeout_s)
        return time.monotonic() - started

    def stop(self) -> None:
        if not self.running:
            return
        self.running = False
        import ray
        from ray import serve

        try:
            serve.shutdown()
        finally:
            ray.shutdown()


# The role of the load generator when it runs in a child process (its own CPU time, which
# the child reports: it starts and ends within the level, so the snapshots miss it).
LOAD_CHILD_ROLE = "load generator (child process)"


# Process titles (or command-line pieces) -> the role shown in the CPU breakdown.
_ROLES = (
    ("VLLM::Worker", "vllm forward (VLLM::Worker)"),
    ("VLLM::EngineCore", "vllm scheduler (VLLM::EngineCore)"),
    ("vllm.entrypoints.openai.api_server", "vllm API server"),
    ("ServeReplica:bench:Ingress", "our ingress + router"),
    ("ServeReplica:bench:ComputeWorker", "our worker (vLLM frontend)"),
    ("ServeReplica:bench:Server", "our server (ingress + router + worker, vLLM frontend)"),
    ("ServeReplica:bench:Direct", "direct replica (vLLM frontend + HTTP)"),
    ("ProxyActor", "Serve HTTP proxy"),
    ("ServeController", "Serve controller"),
    ("loadtests load generator", LOAD_CHILD_ROLE),
    ("loadtests.", "load generator (this process)"),
    # The rest of Ray, split so that "other" is only what is not ours.
    ("raylet", "Ray raylet"),
    ("gcs_server", "Ray GCS"),
    ("haproxy", "HAProxy"),
    ("HAProxyManager", "HAProxy"),
    ("DashboardAgent", "Ray agents and monitors"),
    ("RuntimeEnvAgent", "Ray agents and monitors"),
    ("dashboard", "Ray agents and monitors"),
    ("log_monitor", "Ray agents and monitors"),
    ("autoscaler", "Ray agents and monitors"),
    ("ray::IDLE", "Ray idle workers"),
    ("ray::", "Ray, other actors"),
)


# In --paired runs, where both servers run at once (each frozen while the other is
# measured), the roles of plain vLLM's processes (its own process group) carry this
# prefix: our worker's engine processes have the same titles.
PLAIN_VLLM_PREFIX = "plain vllm: "


def is_ray_side_role(role: str) -> bool:
    """Whether ``role`` (a key of :func:`_cpu_by_role` with plain vLLM's group split off) is
    one of our app's or Ray's processes: not plain vLLM's, not the load generator's, not
    "other"."""
    return not role.startswith(PLAIN_VLLM_PREFIX) and role not in (
        "other", "load generator (this process)", LOAD_CHILD_ROLE
    )


def _cpu_by_role(vllm_pgid: Optional[int] = None) -> dict[str, float]:
    """CPU seconds (user + system) consumed so far by each role's processes; the rest of
    the machine under "other". ``vllm_pgid``: plain vLLM's process group, whose roles get
    :data:`PLAIN_VLLM_PREFIX`."""
    import psutil

    out: dict[str, float] = {}
    for p in psutil.process_iter(["cmdline", "name", "cpu_times"]):
        try:
            title = " ".join(p.info["cmdline"] or []) or (p.info["name"] or "")
            times = p.info["cpu_times"]
            plain = vllm_pgid is not None and os.getpgid(p.pid) == vllm_pgid
        except (psutil.Error, TypeError, ProcessLookupError):
            continue
        if times is None:
            continue
        role = next((r for pat, r in _ROLES if pat in title), "other")
        if plain:
            role = PLAIN_VLLM_PREFIX + role
        out[role] = out.get(role, 0.0) + times.user + times.system
    return out


def _level_child_main() -> None:
    """The child of :func:`run_level_in_child`: reads the level's arguments (JSON) from
    stdin, runs it, writes ``{"level": ..., "cpu_s": ...}`` or ``{"error": ...}`` (JSON) to
    stdout."""
    try:
        import setproctitle

        setproctitle.setproctitle("loadtests load generator")
    except ImportError:
        pass
    load = json.load(sys.stdin)
    started = time.process_time()
    try:
        out = {"level": asyncio.run(run_level(**load)), "cpu_s": time.process_time() - started}
    except Exception as e:  # noqa: BLE001 - reported to the parent
        out = {"error": repr(e)}
    json.dump(out, sys.stdout)


def run_level_in_child(load: dict, timeout_s: float) -> tuple[dict, float]:
    """``run_level(**load)`` in a fresh Python process (in its own session: no Ray in it,
    and never frozen), and the CPU seconds it used. The ``--paired`` modes use it so that
    the client is not this process, a Ray driver whose cluster is frozen under it half the
    time. (Some of plain vLLM's slices had every stream arrive whole at its end, TTFT ≈
    E2E and TPOT 0, with the load in this process; they still did from a child, with Ray
    frozen and running: that is not the cause, and a probe of this process's event loop
    with Ray frozen found no stall.)"""
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run(
        [sys.executable, "-c", "from loadtests.compare_vllm import _level_child_main; _level_child_main()"],
        input=json.dumps(load), capture_output=True, text=True, timeout=timeout_s, cwd=root, env=env,
        start_new_session=True,
    )
    try:
        out = json.loads(proc.stdout)
    except ValueError:
        raise RuntimeError(f"the load generator exited with {proc.returncode}: {proc.stderr[-2000:]}") from None
    if "error" in out:
        raise RuntimeError(f"the load generator failed: {out['error']}")
    return out["level"], out["cpu_s"]


def measure_level(
    base_url: str, system: str, rnd: int, c: int, args, label: str = "", vllm_pgid: Optional[int] = None
) -> dict:
    """One closed-loop level at concurrency ``c`` (``args``' load), with the machine's load
    average around it and where the CPU went over it, per process role (``vllm_pgid``:
    see :func:`_cpu_by_role`)."""
    n = max(args.min_prompts, args.prompts_per_slot * c)
    _say(f"{label or f'round {rnd}'}: {system} concurrency {c}, {n} requests")
    before = _loadavg()
    # Per role: CPU seconds over the level, and per 1000 output tokens: where the two
    # cores go, ours against plain vLLM (processes that started or ended during the
    # level are not counted).
    load = dict(
        base_url=base_url, model=MODEL_NAME, concurrency=c, num_prompts=n, input_len=args.input_len,
        output_len=args.output_len, vocab_size=args.vocab_size, warmup=min(c, 8), seed=args.seed + c,
        label=f"{system} c={c} r{rnd}", progress=False,
    )
    in_child = getattr(args, "load_in_child", False)
    cpu_before = _cpu_by_role(vllm_pgid)
    if in_child:
        level, load_cpu_s = run_level_in_child(load, args.level_timeout_s)
    else:
        level = asyncio.run(run_level(**load))
    cpu_after = _cpu_by_role(vllm_pgid)
    tokens = level.get("total_output_tokens") or 0
    cpu = {
        role: round(cpu_after[role] - cpu_before.get(role, 0.0), 3)
        for role in cpu_after
        if cpu_after[role] - cpu_before.get(role, 0.0) > 0.005
    }
    if in_child:
        cpu[LOAD_CHILD_ROLE] = round(load_cpu_s, 3)
    level.update(
        system=system, round=rnd, loadavg_before=before, loadavg_after=_loadavg(),
        cpu_seconds_by_role=cpu,
        cpu_ms_per_1k_output_tokens={r: round(1e6 * v / tokens, 1) for r, v in cpu.items()} if tokens else {},
    )
    return level


def measure(base_url: str, system: str, rnd: int, args) -> list[dict]:
    return [measure_level(base_url, system, rnd, c, args) for c in args.concurrency]


def ratios(levels: list[dict], concurrencies: list[int], a: str = "ours", b: str = "vllm") -> dict:
    """Per concurrency, the medians over rounds of systems ``a`` and ``b`` (output tokens/s,
    TTFT p50) and their ratios a/b."""

    def med(system: str, c: int, key: str) -> Optional[float]:
        vals = [l[key] for l in levels if l["system"] == system and l["concurrency"] == c and l.get(key)]
        return statistics.median(vals) if vals else None

    out = {}
    for c in concurrencies:
        row = {}
        for key, name in (("output_throughput", "output_tput"), ("p50_ttft_ms", "ttft_p50")):
            ours, theirs = med(a, c, key), med(b, c, key)
            row[f"{a}_{name}"] = ours
            row[f"{b}_{name}"] = theirs
            row[f"{name}_{a}_over_{b}"] = ours / theirs if ours and theirs else None
        out[f"c{c}"] = row
    return out


def interrupt_on_sigterm() -> None:
    """From now on SIGTERM ends this process's run as Ctrl-C does (KeyboardInterrupt), so
    the benchmarks' ``finally`` blocks stop every server they started."""

    def on_sigterm(*_):
        raise KeyboardInterrupt()

    signal.signal(signal.SIGTERM, on_sigterm)


def alternate(
    systems: list[tuple[str, Any]], base_url: str, args, say, measure_fn=None
) -> tuple[list[dict], list[dict]]:
    """``args.rounds`` rounds; in each, every system (``(name, obj)`` with ``start`` and
    ``stop``) is started, measured at every level (``measure_fn(base_url, name, round,
    args)``, default :func:`measure`) and stopped, one at a time. The order reverses
    every other round, so drift on a shared machine hits all alike. Returns the levels
    and each start's seconds. SIGTERM ends it like Ctrl-C (KeyboardInterrupt);
    every system is stopped either way."""

    interrupt_on_sigterm()
    levels: list[dict] = []
    startups: list[dict] = []
    try:
        for rnd in range(1, args.rounds + 1):
            order = systems if rnd % 2 else systems[::-1]
            for name, system in order:
                say(f"round {rnd}/{args.rounds}: starting {name}")
                try:
                    startup_s = system.start(args.start_timeout_s)
                    startups.append({"system": name, "round": rnd, "startup_s": round(startup_s, 1)})
                    levels += (measure_fn or measure)(base_url, name, rnd, args)
                finally:
                    say(f"round {rnd}/{args.rounds}: stopping {name}")
                    system.stop()
    finally:
        for _, system in systems:
            system.stop()
    return levels, startups


def paired(
    ours: "OurApp", vllm_server: "VLLMServer", args, say, measure_fn=None, ours_pids=None
) -> tuple[list[dict], list[dict], dict]:
    """``--paired N``: both systems started once (plain vLLM first, on ``args.port + 1``;
    ours on ``args.port``), each frozen (``loadtests.paired.Freezer``) except while it is
    measured; then ``N`` pairs, each one level of each system at every concurrency, back
    to back, the order flipped from one slice pair to the next. Returns the slices (levels
    with ``pair``, and ``frozen_cpu_s``: what the frozen system's processes used meanwhile,
    ~0 when the freeze held), the start-ups, and the freezes' process counts.
    ``measure_fn``: :func:`measure_level` by default; ``ours_pids``: what to freeze of
    ours, every process this one started but plain vLLM's by default (a test's stand-ins)."""
    from loadtests.paired import Freezer, descendants, process_group, slice_schedule

    interrupt_on_sigterm()
    urls = {"ours": f"http://127.0.0.1:{ours.port}", "vllm": f"http://127.0.0.1:{vllm_server.port}"}
    freezers: dict[str, Freezer] = {}
    startups: list[dict] = []
    slices: list[dict] = []
    frozen_counts: dict[str, list[int]] = {"ours": [], "vllm": []}
    try:
        say("starting vllm")
        startups.append({"system": "vllm", "round": 0, "startup_s": round(vllm_server.start(args.start_timeout_s), 1)})
        pgid = vllm_server.proc.pid  # its own session: the leader's pid is the group's id
        freezers["vllm"] = Freezer("vllm", lambda: process_group(pgid))
        frozen_counts["vllm"].append(freezers["vllm"].freeze())
        say("starting ours (plain vLLM frozen meanwhile)")
        startups.append({"system": "ours", "round": 0, "startup_s": round(ours.start(args.start_timeout_s), 1)})
        # Everything this process started (Ray's processes, Serve's replicas, their
        # engines, HAProxy) but plain vLLM's group.
        freezers["ours"] = Freezer("ours", ours_pids or (lambda: descendants([pgid])))
        frozen_counts["ours"].append(freezers["ours"].freeze())

        def frozen_role(frozen: str, role: str) -> bool:
            """Whether ``role`` is one of the ``frozen`` system's processes."""
            return role.startswith(PLAIN_VLLM_PREFIX) if frozen == "vllm" else is_ray_side_role(role)

        for pair, c, name in slice_schedule(args.paired, args.concurrency, "ours", "vllm"):
            other = "vllm" if name == "ours" else "ours"
            freezers[name].thaw()
            try:
                time.sleep(args.settle_s)  # timers that came due while it was frozen
                level = (measure_fn or measure_level)(
                    urls[name], name, pair, c, args, label=f"pair {pair}/{args.paired}", vllm_pgid=pgid
                )
            finally:
                frozen_counts[name].append(freezers[name].freeze())
            cpu = level.get("cpu_seconds_by_role", {})
            level["pair"] = pair
            level["frozen_cpu_s"] = round(sum(v for r, v in cpu.items() if frozen_role(other, r)), 3)
            # The measured system's share (the frozen one's is frozen_cpu_s).
            level["cpu_ms_per_1k_output_tokens"] = {
                r: v for r, v in level.get("cpu_ms_per_1k_output_tokens", {}).items() if not frozen_role(other, r)
            }
            slices.append(level)
    finally:
        for f in freezers.values():
            f.thaw()
        for system in (vllm_server, ours):
            try:
                system.stop()
            except Exception as e:  # noqa: BLE001 - stop the other one too
                say(f"stopping {type(system).__name__} failed: {e!r}")
    return slices, startups, {n: sorted(set(v)) for n, v in frozen_counts.items()}


def print_pairs(
    stats: dict, slices: list[dict], concurrencies: list[int], a: str = "ours", b: str = "vllm",
    title: str = "output tok/s, ours / plain vLLM per pair (each pair back to back, the other system frozen):",
) -> None:
    """``loadtests.paired.pair_stats``' table (systems ``a`` over ``b``), and the freeze's
    check."""
    print(title)
    print(f"{'c':>4}  {'pairs':>5}  {a + ' med':>12}  {b + ' med':>12}  {'ratio med':>9}  {'90% interval':>14}  "
          f"{'>1':>5}  per pair")
    for c in concurrencies:
        r = stats.get(f"c{c}", {})
        if not r.get("pairs"):
            print(f"{c:>4}  {0:>5}  (no complete pair)")
            continue
        lo, hi = r["interval"]
        print(
            f"{c:>4}  {r['pairs']:>5}  {r[a + '_median']:>12.1f}  {r[b + '_median']:>12.1f}  "
            f"{r['median_ratio']:>9.2f}  {f'{lo:.2f}-{hi:.2f}':>14}  {r['share_above_1']:>5.2f}  "
            + " ".join(f"{x:.2f}" for x in r["ratios"])
        )
    if any("frozen_cpu_s" in s for s in slices):
        worst = max(s.get("frozen_cpu_s", 0.0) for s in slices)
        print(f"most CPU a frozen system used during one of the other's slices: {worst:.3f} s")


def median_ratios(stats: dict, concurrencies: list[int]) -> str:
    """``loadtests.paired.pair_stats``' median ratio per concurrency with a complete pair,
    on one line ("c=1 0.90, c=8 0.99")."""
    return ", ".join(
        f"c={c} {stats[f'c{c}']['median_ratio']:.2f}" for c in concurrencies if stats.get(f"c{c}", {}).get("pairs")
    )


def print_ratios(table: dict, concurrencies: list[int], a: str, b: str) -> None:
    """:func:`ratios`' table, a line per concurrency: output tokens/s and TTFT p50 of ``a``
    and ``b`` and a/b."""
    print(
        f"{'c':>4}  {'out tok/s ' + a:>20}  {b:>10}  {'ratio':>6}  "
        f"{'TTFT p50 ms ' + a:>22}  {b:>10}  {'ratio':>6}"
    )
    for c in concurrencies:
        r = table[f"c{c}"]
        f = lambda v, d=1: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
        print(
            f"{c:>4}  {f(r[f'{a}_output_tput']):>20}  {f(r[f'{b}_output_tput']):>10}  "
            f"{f(r[f'output_tput_{a}_over_{b}'], 2):>6}  {f(r[f'{a}_ttft_p50']):>22}  "
            f"{f(r[f'{b}_ttft_p50']):>10}  {f(r[f'ttft_p50_{a}_over_{b}'], 2):>6}"
        )


def print_cpu_by_role(levels: list[dict]) -> None:
    """Where the CPU went in the last round of each system and level, per 1000 output
    tokens, by process role, largest first."""
    print("CPU ms per 1000 output tokens, by process role (last round of each system and level):")
    last = {(lv["system"], lv["concurrency"]): lv for lv in levels}
    for (name, c), lv in sorted(last.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        per = sorted(lv.get("cpu_ms_per_1k_output_tokens", {}).items(), key=lambda kv: -kv[1])
        print(f"  {name} c={c}: " + ", ".join(f"{r} {v:.0f}" for r, v in per))


def add_load_options(p: argparse.ArgumentParser) -> None:
    """The model, engine and load options every vLLM comparison shares."""
    p.add_argument("--model-dir", default="models/tiny")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated levels")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--prompts-per-slot", type=int, default=4, help="requests per level = this x c")
    p.add_argument("--min-prompts", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--kv-gib", type=float, default=1.0, help="CPU KV cache space of each engine")
    p.add_argument("--port", type=int, default=8124)
    p.add_argument("--start-timeout-s", type=float, default=600)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--level-timeout-s", type=float, default=600, help="--paired: the most one slice may take")


def prepare(args) -> Path:
    """Parse ``--concurrency``; the tiny model (built if missing), whose vocabulary size the
    load's random prompts take."""
    from app.model_builder import ensure_model

    args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    model_path = ensure_model(Path(args.model_dir), "tiny")
    args.vocab_size = json.loads((model_path / "config.json").read_text())["vocab_size"]
    return model_path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.compare_vllm")
    add_load_options(p)
    p.add_argument(
        "--stream-max-messages-per-s", type=float, default=None,
        help="our engine.stream_max_messages_per_s (default: the config's)",
    )
    p.add_argument(
        "--stream-interval-ms", type=float, default=None,
        help="our engine.stream_interval_ms (default: the config's)",
    )
    add_ingress_option(p)
    layout = p.add_mutually_exclusive_group()
    layout.add_argument(
        "--with-worker", dest="with_worker", action="store_const", const=True, default=None,
        help="our app with ingress.with_worker: true (the ingress and its worker in one "
        "process; the default for one vLLM replica)",
    )
    layout.add_argument(
        "--apart", dest="with_worker", action="store_const", const=False,
        help="our app with ingress.with_worker: false (the ingress and its worker apart)",
    )
    p.add_argument(
        "--paired", type=int, default=0, metavar="N",
        help="both systems up at once, the one not measured frozen (SIGSTOP); N pairs of "
        "back-to-back slices per concurrency, a ratio per pair (instead of --rounds)",
    )
    p.add_argument(
        "--settle-s", type=float, default=1.0,
        help="--paired: seconds between thawing a system and measuring it",
    )
    p.add_argument("--out", default="loadtests/results/compare_vllm.json")
    args = p.parse_args(argv)
    model_path = prepare(args)
    base_url = f"http://127.0.0.1:{args.port}"
    log_path = Path(tempfile.gettempdir()) / f"compare_vllm_server_{os.getpid()}.log"
    flags = vllm_flags(model_path, args)
    # --paired: both up at once, plain vLLM on the next port.
    vllm_server = VLLMServer(flags, args.port + 1 if args.paired else args.port, log_path)
    ours = OurApp(model_path, args, args.port)
    _say(f"vllm flags: {' '.join(flags)} (server log: {log_path})")

    if args.paired:
        args.load_in_child = True  # see run_level_in_child
        try:
            slices, startups, frozen = paired(ours, vllm_server, args, _say)
        except KeyboardInterrupt:
            _say("interrupted: everything stopped")
            return 130
        from loadtests.paired import pair_stats

        stats = pair_stats(slices, a="ours", b="vllm", key="output_throughput")
        ttft = pair_stats(slices, a="ours", b="vllm", key="p50_ttft_ms")
        result = {
            "args": vars(args), "vllm_command": vllm_server.cmd, "cpu_count": os.cpu_count(),
            "startups": startups, "frozen_process_counts": frozen, "levels": slices,
            "pairs_output_tput": stats, "pairs_ttft_p50": ttft,
        }
        print(format_table(slices))
        print_pairs(stats, slices, args.concurrency)
        print("TTFT p50, ours / plain vLLM, median of pairs: " + median_ratios(ttft, args.concurrency))
        print(f"processes frozen per freeze: ours {frozen['ours']}, vllm {frozen['vllm']}")
        print_cpu_by_role(slices)
        _say(f"stored {write_report(args.out, result)}")
        return 0

    try:
        levels, startups = alternate([("ours", ours), ("vllm", vllm_server)], base_url, args, _say)
    except KeyboardInterrupt:
        _say("interrupted: everything stopped")
        return 130

    result = {
        "args": vars(args),
        "vllm_command": vllm_server.cmd,
        "cpu_count": os.cpu_count(),
        "startups": startups,
        "levels": levels,
        "ratios": ratios(levels, args.concurrency),
    }
    print(format_table(levels))
    print_ratios(result["ratios"], args.concurrency, "ours", "vllm")
    print("startup s:", ", ".join(f"{s['system']} r{s['round']} {s['startup_s']}" for s in startups))
    print_cpu_by_role(levels)
    _say(f"stored {write_report(args.out, result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
