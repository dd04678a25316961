"""The demo: one coordinator and three local "datacenters" of two FSDP2 trainers each.

``python -m examples.gpt_diloco.launch`` (what ``make demo`` runs) starts every process on
this machine over loopback, shows progress while the job runs, and ends with the final
validation loss, the bytes that crossed the "WAN", and whether every site's theta hash matched
the coordinator's. Logs and state land in ``runs/gpt_diloco/``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_metrics(run: Path, sites: list[str]) -> list[dict]:
    records = []
    for site in sites:
        path = run / site / "metrics.jsonl"
        if path.exists():
            records += [json.loads(line) for line in path.read_text().splitlines() if line]
    return records


class StatusWatcher:
    """Prints a line when the coordinator's round changes (an operator's Status call)."""

    def __init__(self, address: str, operator_bundle: Path) -> None:
        from wire.channel import open_channel
        from wire.identity import Bundle
        from wire.proto import isthmus_pb2_grpc as pb_grpc

        self.stub = pb_grpc.CoordinatorStub(open_channel(address, Bundle.load(operator_bundle)))
        self.last: tuple | None = None

    def show(self, elapsed: float) -> None:
        from wire.proto import isthmus_pb2 as pb

        try:
            s = self.stub.Status(pb.StatusRequest(), timeout=2)
        except Exception:  # not up yet, or already gone: nothing to show
            return
        key = (s.round.round, s.round.finished)
        if key != self.last:
            self.last = key
            state = "finished" if s.round.finished else f"open, {s.waiting_reason}"
            print(
                f"[{elapsed:6.1f}s] coordinator round {s.round.round}/{s.round.total_rounds} "
                f"{state}; WAN in {s.wan_bytes_in / 1e6:.1f} MB out "
                f"{s.wan_bytes_out / 1e6:.1f} MB",
                flush=True,
            )


def make_pki(pki: Path, sites: list[str]) -> Path:
    """The job's CA and every party's bundle, made with the same commands a user runs."""
    cli = [sys.executable, "-m", "coordinator.cli", "certs"]
    steps = [
        ["init", "--out", str(pki), "--job", "gpt-diloco"],
        ["server", "--ca", str(pki), "--host", "127.0.0.1", "--host", "localhost"],
        ["operator", "--ca", str(pki), "--name", "demo-operator"],
        *(["issue", "--ca", str(pki), "--site", site] for site in sites),
    ]
    for step in steps:
        subprocess.run([*cli, *step], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return pki


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sites", type=int, default=3)
    p.add_argument("--nproc-per-node", type=int, default=2)
    p.add_argument("--config", default=str(HERE / "job.toml"))
    p.add_argument("--run-dir", default=str(ROOT / "runs" / "gpt_diloco"))
    p.add_argument("--timeout", type=float, default=900.0, help="give up after this many seconds")
    args = p.parse_args(argv)

    run = Path(args.run_dir)
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    address = f"127.0.0.1:{free_port()}"
    py = sys.executable
    procs: dict[str, subprocess.Popen] = {}
    logs = []

    def spawn(name: str, cmd: list[str]) -> None:
        log = open(run / f"{name}.log", "w")  # noqa: SIM115 - closed after the job
        logs.append(log)
        procs[name] = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)

    sites = [f"site-{i}" for i in range(args.sites)]
    pki = make_pki(run / "pki", sites)
    print(
        f"isthmus demo: coordinator on {address} (mutual TLS, certificates in {pki}), "
        f"{args.sites} sites x {args.nproc_per_node} FSDP2 trainers; logs in {run}",
        flush=True,
    )
    serve = ["serve", "--config", args.config, "--listen", address]
    serve += ["--state-dir", str(run / "coordinator")]
    serve += ["--tls-dir", str(pki / "coordinator"), "--crl", str(pki / "crl.pem")]
    spawn("coordinator", [py, "-m", "coordinator.cli", *serve])
    for site in sites:
        spawn(
            site,
            [
                py,
                "-m",
                "site_client.cli",
                "start",
                "--coordinator",
                address,
                "--site",
                site,
                "--run-dir",
                str(run / site),
                "--tls-dir",
                str(pki / "sites" / site),
                "--nproc-per-node",
                str(args.nproc_per_node),
                "--",
                str(HERE / "train.py"),
            ],
        )

    started = time.monotonic()
    shown: set[tuple] = set()
    watcher = StatusWatcher(address, pki / "operators" / "demo-operator")
    try:
        while any(procs[s].poll() is None for s in sites):
            if time.monotonic() - started > args.timeout:
                print(f"demo: timed out after {args.timeout:.0f}s", file=sys.stderr)
                return 1
            failed = [n for n, pr in procs.items() if pr.poll() not in (None, 0)]
            if failed:
                print(
                    f"demo: {', '.join(failed)} failed; see {run}/{failed[0]}.log", file=sys.stderr
                )
                return 1
            for rec in read_metrics(run, sites):
                key = (rec["site"], rec.get("round"), tuple(sorted(rec)))
                if key not in shown:
                    shown.add(key)
                    values = "  ".join(
                        f"{k} {v:.4f}" for k, v in rec.items() if isinstance(v, float)
                    )
                    print(
                        f"[{time.monotonic() - started:6.1f}s] {rec['site']:8s} "
                        f"round {rec.get('round')}: {values}",
                        flush=True,
                    )
            watcher.show(time.monotonic() - started)
            time.sleep(0.5)
        procs["coordinator"].wait(timeout=60)
    finally:
        for pr in procs.values():
            if pr.poll() is None:
                pr.terminate()
        for log in logs:
            log.close()
    return summarize(run, sites, time.monotonic() - started)


def plot_losses(run: Path, by_round: dict[int, dict]) -> Path | None:
    """Loss per round as a PNG (skipped when matplotlib is not installed)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rounds = sorted(by_round)
    fig, ax = plt.subplots(figsize=(6, 4))
    train = [(r, sum(v["train"]) / len(v["train"])) for r in rounds if (v := by_round[r])["train"]]
    val = [(r, by_round[r]["val"][0]) for r in rounds if by_round[r]["val"]]
    ax.plot(*zip(*train, strict=True), "o-", label="train loss (mean over sites, during round)")
    ax.plot(*zip(*val, strict=True), "s-", label="validation loss of global theta_r")
    ax.set_xlabel("outer round r")
    ax.set_ylabel("cross-entropy (nats/byte)")
    ax.set_title("isthmus demo: DiLoCo across 3 sites x 2 FSDP2 trainers")
    ax.grid(alpha=0.3)
    ax.legend()
    path = run / "loss.png"
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def summarize(run: Path, sites: list[str], elapsed: float) -> int:
    records = read_metrics(run, sites)
    coord_dir = run / "coordinator" / "checkpoints"
    latest = (coord_dir / "LATEST").read_text().strip()
    coord_hash = json.loads((coord_dir / latest / "meta.json").read_text())["theta_sha256"]
    finals = {s: json.loads((run / s / "final.json").read_text()) for s in sites}
    wan = sum(f["wan_bytes_sent"] + f["wan_bytes_received"] for f in finals.values())
    match = all(f["theta_hash"] == coord_hash for f in finals.values())
    by_round: dict[int, dict] = {}
    for rec in records:
        row = by_round.setdefault(rec["round"], {"val": [], "train": []})
        if "val_loss" in rec:
            row["val"].append(rec["val_loss"])
        if "train_loss" in rec:
            row["train"].append(rec["train_loss"])
    print("\nround  train loss (mean of sites)  val loss of theta_r")
    for r in sorted(by_round):
        row = by_round[r]
        train = f"{sum(row['train']) / len(row['train']):.4f}" if row["train"] else "-"
        val = f"{row['val'][0]:.4f}" if row["val"] else "-"
        print(f"{r:5d}  {train:>26s}  {val:>19s}")
    plot = plot_losses(run, by_round)
    final_val = [r["val_loss"] for r in records if r.get("final")]
    print(f"\nfinal validation loss {final_val[0]:.4f}" if final_val else "no final loss")
    print(f"total WAN bytes {wan / 1e6:.2f} MB (pushes + fetches, all sites)")
    print(
        f"theta hashes: every site {'MATCHES' if match else 'DOES NOT MATCH'} the "
        f"coordinator ({coord_hash[:12]})"
    )
    print(f"elapsed {elapsed:.0f}s" + (f"; loss curves in {plot}" if plot else ""))
    return 0 if match and final_val else 1


if __name__ == "__main__":
    sys.exit(main())
