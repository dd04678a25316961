"""The site's CPU per GB moved: theta fetched and updates pushed, over mutual-TLS gRPC.

::

    python -m bench.transfer_cpu [--mb 128] [--streams 1,4] [--repeats 3]

A real ``coordinator serve`` (its own process) serves a model of about ``--mb`` MB; this
process is the site: it fetches theta whole into a file in shared memory, as the agent does,
and pushes an update of the same size, ``--repeats`` times for each number of streams. The
site's CPU seconds over each call (user + system, every thread: ``time.process_time``) per GB
moved are the figure; on a shared machine they hold much steadier than wall time. The floor to
compare them with is what TLS and one SHA-256 pass cost per GB on this machine (measured here
too). Last line::

    fetch_cpu_s_per_gb_k1=... push_cpu_s_per_gb_k1=... fetch_cpu_s_per_gb_k4=... ...
    sha256_s_per_gb=...
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def sha256_seconds_per_gb(size: int = 256 << 20) -> float:
    data = bytearray(size)
    started = time.process_time()
    hashlib.sha256(data).digest()
    return (time.process_time() - started) / (size / 1e9)


def _start(folder: Path, mb: int):
    sys.path.insert(0, str(REPO / "tests"))
    from coord_harness import CoordinatorProcess, job_config, write_config

    from wire.identity import init_ca, issue

    ca = init_ca(folder / "ca", "xfer-cpu")
    issue(ca, "coordinator", "coordinator", folder / "server", hosts=("127.0.0.1",))
    issue(ca, "site", "site-a", folder / "site-a")
    d = max(8, int((mb << 20) / 4 / 4096))
    cfg = job_config(
        name="xfer-cpu",
        model={"factory": "coord_harness:tiny_model", "kwargs": {"d_in": d, "d_out": 4096}},
        rounds={"total": 1000, "min_sites": 1, "max_sites": 1, "join_window_s": 0.2},
        transfer={"streams": 1},
    )
    path = write_config(folder, cfg)
    proc = CoordinatorProcess(path, folder / "state", folder / "coord.log", folder / "server")
    proc.start()
    return proc


def _measure(client, streams: int, repeats: int, shm: Path) -> tuple[float, float]:
    """Median CPU s/GB of a whole fetch and of a push over ``streams`` streams."""
    import torch

    from site_client.agent.update_payload import payload_of
    from wire.tensors import pack
    from wire.transfer import TransferConfig

    client.transfer = TransferConfig(streams=streams)
    client.connect_streams(streams)
    fetches, pushes = [], []
    for i in range(repeats):
        dest = shm / f"theta-{streams}-{i}.safetensors"
        before, cpu = client.bytes_received, time.process_time()
        theta = client.fetch(dest=dest)
        fetches.append((time.process_time() - cpu) / ((client.bytes_received - before) / 1e9))
        delta = {n: torch.full_like(theta.theta[n], 1e-6) for n in ("lin.weight", "lin.bias")}
        payload = payload_of(*pack(delta))
        r = client.wait_for_round(theta.version - 1, poll_s=0.05).round
        before, cpu = client.bytes_sent, time.process_time()
        assert client.push(r, payload, base_version=theta.version).complete
        pushes.append((time.process_time() - cpu) / ((client.bytes_sent - before) / 1e9))
        client.wait_for_round(r, poll_s=0.05)
        dest.unlink(missing_ok=True)
    return statistics.median(fetches), statistics.median(pushes)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=int, default=128, help="model size in MB (float32)")
    p.add_argument("--streams", default="1,4", help="numbers of streams, comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    from site_client.transfer.client import CoordinatorClient
    from wire.identity import Bundle

    with tempfile.TemporaryDirectory(prefix="isthmus-xfer-cpu-") as tmp:
        folder, shm = Path(tmp), Path(tempfile.mkdtemp(prefix="xfer-cpu-", dir="/dev/shm"))
        proc = _start(folder, args.mb)
        figures: dict[str, float] = {}
        try:
            c = CoordinatorClient(proc.address, "site-a", tls=Bundle.load(folder / "site-a"))
            c.join()
            for k in (int(s) for s in args.streams.split(",")):
                fetch, push = _measure(c, k, args.repeats, shm)
                figures[f"fetch_cpu_s_per_gb_k{k}"] = round(fetch, 3)
                figures[f"push_cpu_s_per_gb_k{k}"] = round(push, 3)
                print(f"K={k}: fetch {fetch:.3f} CPU s/GB, push {push:.3f} CPU s/GB", flush=True)
            c.leave("done")
            c.close()
        finally:
            proc.stop()
            for f in shm.iterdir():
                f.unlink()
            shm.rmdir()
    figures["sha256_s_per_gb"] = round(sha256_seconds_per_gb(), 3)
    print(" ".join(f"{k}={v}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
