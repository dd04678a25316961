"""The runs behind ``python -m bench.sync`` (see its docstring): one real job per model size
and codec, a gloo all-reduce beside it, the coordinator's memory, and the table."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.dataplane.machine import MachineBusy

REPO = Path(__file__).resolve().parent.parent
TRAINER = REPO / "bench" / "sync_trainer.py"
INT8 = {"default": "int8"}


@dataclass
class JobResult:
    size: str
    codec: str
    params: int
    syncs: list[float]
    round_period_s: float
    peak_rss: int
    phases: dict[str, float] = field(default_factory=dict)
    busy: float = float("nan")  # the machine's busy share of CPU time during the syncs


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    env.update(FLWR_TELEMETRY_ENABLED="0", OMP_NUM_THREADS="1")
    return env


def _toml(cfg: dict) -> str:
    def value(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, dict):
            return "{ " + ", ".join(f"{k} = {value(x)}" for k, x in v.items()) + " }"
        return repr(v)

    lines = []
    for table, values in cfg.items():
        lines.append(f"[{table}]")
        lines += [f"{k} = {value(v)}" for k, v in values.items()]
        lines.append("")
    return "\n".join(lines)


def job_config(
    width: int, depth: int, rounds: int, h: int, codec: str, timeouts: dict, sites: int = 2
) -> str:
    cfg = {
        "job": {"name": f"sync-{width}x{depth}-{codec}", "state_dir": "state"},
        "model": {
            "factory": "bench.sync:residual_stack",
            "kwargs": {"width": width, "depth": depth},
        },
        "strategy": {"name": "diloco"},
        "rounds": {
            "total": rounds,
            "inner_steps": h,
            "min_sites": sites,
            "max_sites": sites,
            "join_window_s": 0.5,
            "deadline_s": 900.0,
        },
        "timeouts": timeouts,
        "server": {"listen": "127.0.0.1:0"},
    }
    text = _toml(cfg)
    if codec == "int8":
        text += '[compression]\ndefault = "int8"\n\n[compression.downlink]\ndefault = "int8"\n'
    return text


def _pki(folder: Path) -> None:
    from wire.identity import init_ca, issue

    init_ca(folder / "ca", "sync-bench")
    issue(folder / "ca", "coordinator", "coordinator", folder / "coord", hosts=("127.0.0.1",))
    for i in range(2):
        issue(folder / "ca", "site", f"site-{i}", folder / f"site-{i}")


def _peak_rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_job(folder: Path, size: str, width: int, depth: int, codec: str, args) -> JobResult:
    shutil.rmtree(folder, ignore_errors=True)  # a new job every time
    folder.mkdir(parents=True)
    _pki(folder)
    timeouts = {} if size == "1m" else {"heartbeat_interval_s": 5.0, "lease_ttl_s": 60.0}
    rounds = args.rounds if size != "1m" else 8
    h = args.inner_steps if size != "1m" else 1
    (folder / "job.toml").write_text(job_config(width, depth, rounds, h, codec, timeouts))
    env = _env()
    coord_log = open(folder / "coordinator.log", "w")  # noqa: SIM115 - the child's
    cmd = [
        sys.executable,
        "-m",
        "coordinator.cli",
        "serve",
        "--config",
        str(folder / "job.toml"),
    ]
    coord = subprocess.Popen(
        [*cmd, "--tls-dir", str(folder / "coord")],
        cwd=REPO,
        env=env,
        stdout=coord_log,
        stderr=subprocess.STDOUT,
    )
    peak, watching = watch_peak_rss(coord)
    machine = MachineBusy().start()
    address = _wait_address(folder / "state" / "address", coord)
    sites = [_start_site(folder, i, address, env) for i in range(2)]
    try:
        for s in sites:
            if s.wait(timeout=args.timeout) != 0:
                raise RuntimeError(f"a site failed; see {folder}")
        coord.wait(timeout=60)
    finally:
        watching.set()
        machine.stop()
        for p in [*sites, coord]:
            if p.poll() is None:
                p.kill()
        coord_log.close()
    params = depth * (width * width + width)
    return JobResult(
        size,
        codec,
        params,
        _syncs(folder, args.warm_up),
        _round_period(folder),
        peak[0],
        _phases(folder, args.warm_up),
        _busy(folder, args.warm_up, machine),
    )


def shed(folder: Path) -> None:
    """Delete what a finished job left in ``folder`` but its logs, timing records and
    certificates (its state, checkpoints and theta files: gigabytes at 50 M parameters)."""
    for path in sorted(folder.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        if path.is_file() and path.suffix not in (".log", ".jsonl", ".pem"):
            path.unlink(missing_ok=True)
        elif path.is_dir() and not any(path.iterdir()):
            path.rmdir()


def watch_peak_rss(proc: subprocess.Popen) -> tuple[list[int], threading.Event]:
    """Track ``proc``'s peak RSS (``VmHWM``) until it exits or the event is set."""
    peak, stop = [0], threading.Event()

    def watch() -> None:
        while not stop.is_set() and proc.poll() is None:
            peak[0] = max(peak[0], _peak_rss(proc.pid))
            time.sleep(0.1)

    threading.Thread(target=watch, daemon=True).start()
    return peak, stop


def _wait_address(path: Path, proc: subprocess.Popen) -> str:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text().strip()
        if proc.poll() is not None:
            raise RuntimeError(f"the coordinator exited with {proc.returncode}")
        time.sleep(0.05)
    raise TimeoutError("the coordinator did not start")


def _start_site(folder: Path, i: int, address: str, env: dict) -> subprocess.Popen:
    log = open(folder / f"site-{i}.log", "w")  # noqa: SIM115 - the child's
    cmd = [sys.executable, "-m", "site_client.cli", "start", "--coordinator", address]
    cmd += ["--site", f"site-{i}", "--tls-dir", str(folder / f"site-{i}")]
    cmd += ["--run-dir", str(folder / f"run-{i}"), "--nproc-per-node", "1", "--", str(TRAINER)]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _events(folder: Path) -> list[dict]:
    """The coordinator's event log, its rotated segments included."""
    from coordinator.events.log import read_events

    path = folder / "state" / "events.jsonl"
    return read_events(path) if path.exists() else []


def _windows(folder: Path, warm_up: int) -> list[tuple[float, float]]:
    """(end of the last inner step of round r, theta_{r+1} loaded) in wall time, per site and
    round, from round ``warm_up`` on."""
    out = []
    for i in range(2):
        rows = {r["round"]: r for r in _lines(folder / f"run-{i}" / "sync_times.jsonl")}
        for r, row in rows.items():
            nxt = rows.get(r + 1)
            if r >= warm_up and "steps_end_wall" in row and nxt is not None:
                out.append((row["steps_end_wall"], nxt["loaded_wall"]))
    return out


def _syncs(folder: Path, warm_up: int) -> list[float]:
    """Each sync's seconds (``_windows``)."""
    return [end - start for start, end in _windows(folder, warm_up)]


def _busy(folder: Path, warm_up: int, machine: MachineBusy) -> float:
    """The median over the syncs of the machine's busy share of CPU time."""
    shares = [machine.busy(a, b) for a, b in _windows(folder, warm_up)]
    shares = [x for x in shares if x is not None]
    return statistics.median(shares) if shares else float("nan")


def _round_period(folder: Path) -> float:
    events = _events(folder)
    closes = [e["wall"] for e in events if e["kind"] == "round_closed"]
    gaps = [b - a for a, b in zip(closes[1:], closes[2:], strict=False)]
    return statistics.median(gaps) if gaps else float("nan")


def _phases(folder: Path, warm_up: int) -> dict[str, float]:
    """Median seconds per phase over the sites' rounds after the first ``warm_up`` (the
    coordinator's: after its first ``warm_up`` closes)."""
    buckets: dict[str, list[float]] = {}
    site_buckets: dict[str, list[float]] = {}

    def add(name: str, value: float) -> None:
        site_buckets.setdefault(name, []).append(value)

    for i in range(2):
        site_buckets = {}
        run = folder / f"run-{i}"
        for t in _lines(run / "trainer_timings.jsonl"):
            if "s" in t:  # a phase's duration (``steps`` records count steps instead)
                add(f"trainer {t['kind']}", t["s"])
        for t in _lines(run / "timings.jsonl"):
            add(f"agent {t['kind']}", t["s"])
            if t["kind"] == "push":
                add("agent push: waiting for the checkpoint", t.get("held_s", 0.0))
            if t.get("cpu_s") is not None and t.get("bytes"):
                # The agent's own CPU over the transfer call, per GB moved (not seconds).
                add(f"agent {t['kind']}: CPU s/GB", t["cpu_s"] / (t["bytes"] / 1e9))
        _pool(buckets, site_buckets, warm_up)
    site_buckets = {}
    for e in _events(folder):
        for name, value in (e.get("phases") or {}).items():
            add(f"coordinator {name.removesuffix('_s').replace('_', ' ')}", value)
    _pool(buckets, site_buckets, warm_up)
    return {k: statistics.median(v) for k, v in buckets.items()}


def _pool(into: dict[str, list[float]], one_party: dict[str, list[float]], warm_up: int) -> None:
    """One party's values of each phase, in order, less the first ``warm_up`` (all of them
    when there are no more)."""
    for name, values in one_party.items():
        into.setdefault(name, []).extend(values[warm_up:] or values)


def _allreduce_worker(rank: int, numel: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    x = torch.randn(numel)
    times = []
    for _ in range(4):
        dist.barrier()
        started = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - started)
    if rank == 0:
        Path(out).write_text(json.dumps(times[1:]))
    dist.destroy_process_group()


def allreduce_seconds(numel: int, folder: Path) -> float:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = folder / f"allreduce-{numel}.json"
    mp.start_processes(
        _allreduce_worker, args=(numel, port, str(out)), nprocs=2, start_method="spawn"
    )
    return statistics.median(json.loads(out.read_text()))


def import_baseline_rss() -> int:
    """RSS of a process that imported what the coordinator imports, and nothing more."""
    code = (
        "import coordinator.cli, coordinator.service.server, pathlib;"
        "print([l for l in pathlib.Path('/proc/self/status').read_text().splitlines()"
        " if l.startswith('VmRSS')][0].split()[1])"
    )
    got = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=_env(), capture_output=True, text=True
    )
    return int(got.stdout.strip()) * 1024


def main(argv: list[str] | None = None) -> int:
    from bench.progress import steps
    from bench.sync import SIZES

    p = argparse.ArgumentParser(prog="python -m bench.sync")
    p.add_argument("--sizes", default="5m,50m", help=f"of {', '.join(SIZES)}")
    p.add_argument("--codecs", default="fp32,int8")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument(
        "--warm-up",
        type=int,
        default=3,
        help="rounds left out of the medians (the third's pruning makes the first spare "
        "site checkpoint files)",
    )
    p.add_argument("--inner-steps", type=int, default=4)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--keep", type=Path, help="keep the runs' folders (logs, state) here")
    args = p.parse_args(argv)
    root = args.keep or Path(tempfile.mkdtemp(prefix="isthmus-sync-"))
    jobs = [(size, codec) for size in args.sizes.split(",") for codec in args.codecs.split(",")]
    jobs.append(("1m", "fp32"))  # the last: the fixed cost, with the default timeouts

    def label(job: tuple[str, str]) -> str:
        last = job is jobs[-1]
        return f"{job[0]} {job[1]}" + (" with the default timeouts" if last else "")

    results = []
    for size, codec in steps(jobs, label):
        width, depth = SIZES[size]
        results.append(run_job(root / f"{size}-{codec}", size, width, depth, codec, args))
        if not args.keep:
            shed(root / f"{size}-{codec}")
    tiny = results.pop()
    baseline = import_baseline_rss()
    from bench.sync_floor import floor_seconds
    from bench.sync_report import References, report

    pki = root / f"{results[0].size}-{results[0].codec}"  # any job's certificates will do
    references = References(
        allreduce=lambda n: allreduce_seconds(n, root),
        floor=lambda n: floor_seconds(pki, n * 4),
    )
    report(results, tiny, baseline, references)
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 0
