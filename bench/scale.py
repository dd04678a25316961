"""The coordinator's memory over the number of sites: flat, and a small multiple of the model.

::

    python -m bench.scale [--sites 2,4,8,16] [--sizes 64,256] [--rounds 2] [--uploads auto,8]
        [--keep DIR]
    python -m bench.scale --shards 1,2,4 [--sites 4] [--sizes 256]

For each model size (MiB of float32 parameters: a residual Linear stack) and number of sites, a
real ``coordinator serve`` runs a DiLoCo job (outer momentum: one more model of state) whose
sites are lightweight clients in this process speaking the real protocol (join, fetch theta
once, then push a model-sized float32 pseudo-gradient every round, all at once). The
coordinator's peak RSS (``VmHWM``) above what a process importing it holds is divided by the
model's float32 size. Plaintext on loopback: TLS changes the CPU cost, not the memory that
matters here. ``--uploads`` lists ``server.concurrent_uploads`` settings to run side by side
(``auto``, the job default, leaves it unset: sized from the model; 0 is no limit). Last line
(the first setting unsuffixed)::

    coord_rss_over_model_max=... rss_growth_2_to_16=... coord_rss_over_model_max_u8=... ...

With ``--shards`` the same job runs with ``[shards] count = K`` for each K (the coordinator
starts K - 1 shard processes itself), and every process's peak RSS is measured: the lead's and
each shard's, over the model's size. Last line::

    shard_rss_over_model_max_k1=... shard_rss_over_model_max_k2=... ... k4_over_k1=...
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import threading
import time
from pathlib import Path

from bench.progress import steps
from bench.sync_run import _wait_address, import_baseline_rss, job_config, watch_peak_rss

# MiB -> (width, depth): depth * width^2 * 4 bytes
WIDTHS = {64: (2048, 4), 256: (4096, 4), 1024: (8192, 4)}


def _client_loop(address: str, name: str, rounds: int, payload, errors: list) -> None:
    from site_client.transfer.client import CoordinatorClient

    client = CoordinatorClient(address, name)
    try:
        client.join()
        client.fetch()  # theta_0, whole, once
        for r in range(rounds):
            client.wait_for_round(r - 1, poll_s=0.2)
            client.push(r, payload, base_version=r)
        client.wait_for_round(rounds - 1, poll_s=0.2)
        client.leave("done")
    except Exception as exc:  # reported by the caller
        errors.append(f"{name}: {type(exc).__name__}: {exc}")
    finally:
        client.close()


def run(
    folder: Path, mib: int, sites: int, rounds: int, uploads: str = "auto", shards: int = 0
) -> dict[str, int]:
    """The job's processes' peak RSS, by name (``coordinator``, ``shard-1``, ...); ``shards``
    K >= 1: ``[shards] count = K`` and theta_0 from a file (0: from the model's factory)."""
    import subprocess
    import sys

    import torch

    from bench.sync import residual_stack
    from bench.sync_run import REPO, _env
    from site_client.agent.update_payload import payload_of
    from wire.tensors import pack

    shutil.rmtree(folder, ignore_errors=True)  # a new job every time
    folder.mkdir(parents=True)
    width, depth = WIDTHS[mib]
    timeouts = {"heartbeat_interval_s": 2.0, "lease_ttl_s": 120.0}
    text = job_config(width, depth, rounds, 1, "fp32", timeouts, sites)
    if uploads != "auto":
        text = text.replace(
            'listen = "127.0.0.1:0"', f'listen = "127.0.0.1:0"\nconcurrent_uploads = {uploads}'
        )
    if shards > 1:
        text += f"\n[shards]\ncount = {shards}\n"
    if shards:  # theta_0 from a file: each process reads only its tensors of it
        text = _from_file(text, folder / "theta0.safetensors", width, depth)
    (folder / "job.toml").write_text(text)
    log = open(folder / "coordinator.log", "w")  # noqa: SIM115 - the child's
    cmd = [
        sys.executable,
        "-m",
        "coordinator.cli",
        "serve",
        "--config",
        str(folder / "job.toml"),
    ]
    coord = subprocess.Popen([*cmd, "--insecure"], cwd=REPO, env=_env(), stdout=log, stderr=log)
    peak, done = watch_peak_rss(coord)
    peaks = {"coordinator": peak}
    try:
        address = _wait_address(folder / "state" / "address", coord)
        for i in range(1, shards):  # started by the coordinator before it listens
            lock = folder / "state" / "shards" / str(i) / "lock"
            peaks[f"shard-{i}"] = _watch_pid(int(lock.read_text().split()[1]), done)
        like = residual_stack(width, depth).state_dict()
        delta = {n: torch.full_like(t, 1e-3) for n, t in like.items()}
        payload = payload_of(*pack(delta))  # one buffer, pushed by every client
        errors: list[str] = []
        threads = [
            threading.Thread(target=_client_loop, args=(address, f"s{i}", rounds, payload, errors))
            for i in range(sites)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(1800)
        if errors:
            raise RuntimeError("; ".join(errors))
        coord.wait(timeout=300)
    finally:
        done.set()
        if coord.poll() is None:
            coord.kill()
        log.close()
    return {name: p[0] for name, p in peaks.items()}


def _from_file(text: str, path: Path, width: int, depth: int) -> str:
    """The job's ``[model]`` read from a safetensors file of the same model (what a job of a
    pretrained model does), so that no process builds the whole model to take its part."""
    from bench.sync import residual_stack
    from wire.safetensors_io import write_tensors

    write_tensors(path, residual_stack(width, depth).state_dict())
    factory = (
        f'factory = "bench.sync:residual_stack"\nkwargs = {{ width = {width}, depth = {depth} }}'
    )
    assert factory in text
    return text.replace(factory, f'path = "{path}"')


def _watch_pid(pid: int, stop: threading.Event) -> list[int]:
    """Track the peak RSS (``VmHWM``) of process ``pid`` (not our child) while it lives."""
    from bench.sync_run import _peak_rss

    peak = [0]

    def watch() -> None:
        while not stop.is_set() and Path(f"/proc/{pid}").exists():
            peak[0] = max(peak[0], _peak_rss(pid))
            time.sleep(0.1)

    threading.Thread(target=watch, daemon=True).start()
    return peak


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.split("\n")[0])
    p.add_argument("--sites", default="2,4,8,16")
    p.add_argument("--sizes", default="64,256", help="model sizes in MiB, of 64, 256, 1024")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument(
        "--uploads", default="auto,8", help="server.concurrent_uploads settings (auto: unset)"
    )
    p.add_argument("--keep", type=Path, help="keep the runs' folders here")
    p.add_argument("--shards", help="coordinator shard counts to compare, e.g. 1,2,4")
    args = p.parse_args(argv)
    root = args.keep or Path(tempfile.mkdtemp(prefix="isthmus-scale-"))
    baseline = import_baseline_rss()
    if args.shards:
        return _by_shards(args, root, baseline)
    counts = [int(x) for x in args.sites.split(",")]
    settings = args.uploads.split(",")
    table: dict[tuple[str, int], dict[int, float]] = {}
    runs = [(u, int(x), n) for u in settings for x in args.sizes.split(",") for n in counts]
    for u, mib, n in steps(runs, lambda r: f"concurrent_uploads {r[0]}: {r[1]} MiB, {r[2]} sites"):
        width, depth = WIDTHS[mib]
        model_bytes = depth * (width * width + width) * 4
        peak = run(root / f"u{u}-{mib}mib-{n}", mib, n, args.rounds, u)["coordinator"]
        if not args.keep:  # its state and spool: gigabytes at 256 MiB and 16 sites
            shutil.rmtree(root / f"u{u}-{mib}mib-{n}", ignore_errors=True)
        table.setdefault((u, mib), {})[n] = (peak - baseline) / model_bytes
    print(f"\ncoordinator peak RSS above its import baseline ({baseline / 1e6:.0f} MB), over the")
    print("float32 model size (server.concurrent_uploads: auto = sized from the model, 0 = none):")
    print("uploads  model     " + "".join(f"{n:>8} sites" for n in counts))
    for (u, mib), row in table.items():
        print(f"{u:>7}  {mib:>3} MiB   " + "".join(f"{row[n]:>13.2f}x" for n in counts))
    figures = []
    for u in settings:
        rows = [row for (uu, _), row in table.items() if uu == u]
        worst = max(v for row in rows for v in row.values())
        growth = max(row[counts[-1]] / row[counts[0]] for row in rows)
        tag = "" if u == settings[0] else f"_u{u}"
        figures += [
            f"coord_rss_over_model_max{tag}={worst:.2f}",
            f"rss_growth_{counts[0]}_to_{counts[-1]}{tag}={growth:.2f}",
        ]
    print(" ".join(figures))
    return 0


def _by_shards(args, root: Path, baseline: int) -> int:
    """Each process's peak RSS over the model's size, for each shard count."""
    counts = [int(k) for k in args.shards.split(",")]
    sites = int(args.sites.split(",")[0])
    runs = [(int(x), k) for x in args.sizes.split(",") for k in counts]
    worst: dict[int, float] = {}
    print(f"peak RSS above the import baseline ({baseline / 1e6:.0f} MB) over the float32 model")
    print(f"size, {sites} sites, {args.rounds} rounds; coordinator = the lead (holds shard 0):")
    for mib, k in steps(runs, lambda r: f"{r[0]} MiB, {r[1]} shard(s)"):
        width, depth = WIDTHS[mib]
        model_bytes = depth * (width * width + width) * 4
        folder = root / f"{mib}mib-k{k}"
        started = time.monotonic()
        peaks = run(folder, mib, sites, args.rounds, "auto", k)
        seconds = time.monotonic() - started
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
        ratios = {name: (p - baseline) / model_bytes for name, p in peaks.items()}
        worst[k] = max(worst.get(k, 0.0), max(ratios.values()))
        row = "  ".join(f"{name} {r:.2f}x" for name, r in ratios.items())
        print(f"{mib:>4} MiB  K = {k}:  {row}  (job {seconds:.1f} s)")
    figures = [f"shard_rss_over_model_max_k{k}={v:.2f}" for k, v in worst.items()]
    if len(counts) > 1:
        figures.append(
            f"k{counts[-1]}_over_k{counts[0]}={worst[counts[-1]] / worst[counts[0]]:.2f}"
        )
    print(" ".join(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
