"""The floor under a byte of the data plane, measured on this machine in the same run.

What any coordinator that keeps mutual TLS over gRPC, a digest of every update and a running
sum must spend per byte, whatever else it does:

* **TLS**: the bytes through the same TLS stack and gRPC settings as the product (the job's
  certificates, ``server_options``/``channel_options``, the coordinator's allocator settings,
  1 MiB chunks framed with their 8-byte offset as ``wire.bulk`` frames them), with a server
  that does nothing with them. One server process and ``clients`` client processes push
  ``nbytes`` each at once, then fetch as much each at once; the server's CPU comes from its
  ``/proc`` counters per phase, each client's from its own ``getrusage``.
* **memcpy, hash, add**: one pass of each over a warm ``nbytes`` buffer on one thread: a copy
  into a preallocated buffer, the payload digest the product takes, a float32 ``add_``.

Also ``python -m bench.dataplane.floor serve|client ...`` (its processes).
"""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

CHUNK = 1 << 20
SERVICE = "isthmus.bench.DataplaneFloor"
REPO = Path(__file__).resolve().parents[2]
GB = 1e9


@dataclass(frozen=True)
class TlsFloor:
    """CPU seconds per GB moved, of each end of each direction."""

    server_recv: float
    server_send: float
    client_send: float
    client_recv: float


@dataclass(frozen=True)
class PassFloor:
    """CPU seconds per GB of one pass on one thread."""

    memcpy: float
    digest: float
    add: float


def _raw(data: bytes) -> bytes:
    return data


def _own_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def serve(tls_dir: Path, nbytes: int) -> None:
    """Serve Up / Down until stdin closes; print the port first."""
    import grpc

    from bench.sync_floor import raw_server
    from coordinator.service import heap
    from wire.bulk import chunk_frame
    from wire.identity import Bundle

    heap.return_freed_memory()  # as ``coordinator serve`` does at start
    bundle = Bundle.load(tls_dir)
    blob = memoryview(bytes(CHUNK))

    def up(frames, _context) -> bytes:
        return sum(len(f) - 8 for f in frames).to_bytes(8, "little")

    def down(_request: bytes, _context):
        for start in range(0, nbytes, CHUNK):
            yield chunk_frame(start, blob[: min(CHUNK, nbytes - start)])

    handlers = {
        "Up": grpc.stream_unary_rpc_method_handler(up, _raw, _raw),
        "Down": grpc.unary_stream_rpc_method_handler(down, _raw, _raw),
    }
    server, port = raw_server(bundle, SERVICE, handlers, 8)
    print(port, flush=True)
    sys.stdin.read()
    server.stop(0)


def client(tls_dir: Path, port: int, nbytes: int) -> None:
    """Wait for a line on stdin, push; wait for another, fetch; print each phase's CPU."""
    import grpc

    from bench.sync_floor import raw_channel
    from wire.bulk import chunk_frame
    from wire.identity import Bundle

    blob = memoryview(bytes(CHUNK))
    with raw_channel(Bundle.load(tls_dir), port) as channel:
        up = channel.stream_unary(f"/{SERVICE}/Up", _raw, _raw)
        down = channel.unary_stream(f"/{SERVICE}/Down", _raw, _raw)
        grpc.channel_ready_future(channel).result(timeout=30)
        out = {}
        for phase in ("send", "recv"):
            sys.stdin.readline()
            before = _own_cpu()
            if phase == "send":
                frames = (
                    chunk_frame(s, blob[: min(CHUNK, nbytes - s)]) for s in range(0, nbytes, CHUNK)
                )
                moved = int.from_bytes(up(frames), "little")
            else:
                moved = sum(len(f) - 8 for f in down(b""))
            if moved != nbytes:
                raise RuntimeError(f"{phase}: moved {moved} of {nbytes} bytes")
            out[phase] = _own_cpu() - before
            print(json.dumps(out), flush=True)


def tls_floor(pki: Path, nbytes: int, clients: int, sampler) -> TlsFloor:
    """Both directions between one server and ``clients`` clients (``pki/site-i``)."""
    me = [sys.executable, "-m", "bench.dataplane.floor"]
    env = _env()
    server = subprocess.Popen(
        [*me, "serve", str(pki / "coord"), str(nbytes)],
        cwd=REPO,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    procs = []
    try:
        port = server.stdout.readline().strip()
        if not port:
            raise RuntimeError("the floor's server did not start")
        sampler.watch("floor server", server.pid)
        procs = [
            subprocess.Popen(
                [*me, "client", str(pki / f"site-{i}"), port, str(nbytes)],
                cwd=REPO,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for i in range(clients)
        ]
        windows, reports = {}, []
        for phase in ("send", "recv"):
            time.sleep(3 * sampler.period_s)
            started = time.time()
            for p in procs:
                p.stdin.write("go\n")
                p.stdin.flush()
            reports = [json.loads(p.stdout.readline()) for p in procs]
            time.sleep(3 * sampler.period_s)
            windows[phase] = (started, time.time())
    finally:
        for p in procs:
            p.stdin.close()
            p.wait(timeout=60)
        server.stdin.close()
        server.wait(timeout=30)
    moved = nbytes * clients / GB
    return TlsFloor(
        server_recv=sampler.cpu("floor server", *windows["send"]) / moved,
        server_send=sampler.cpu("floor server", *windows["recv"]) / moved,
        client_send=sum(r["send"] for r in reports) / moved,
        client_recv=sum(r["recv"] for r in reports) / moved,
    )


def pass_floor(nbytes: int, repeats: int = 3) -> PassFloor:
    """One warm pass of memcpy, the payload digest and a float32 add, on this thread."""
    import torch

    from wire.digest import payload_digest

    torch.set_num_threads(1)
    a = torch.ones(nbytes // 4, dtype=torch.float32)
    b = torch.ones(nbytes // 4, dtype=torch.float32)
    raw = memoryview(a.numpy()).cast("B")

    def timed(op) -> float:
        op()  # warm: every page touched before the clock starts
        spent = []
        for _ in range(repeats):
            before = time.thread_time()
            op()
            spent.append(time.thread_time() - before)
        return statistics.median(spent) / (nbytes / GB)

    return PassFloor(
        memcpy=timed(lambda: b.copy_(a)),
        digest=timed(lambda: payload_digest(raw)),
        add=timed(lambda: b.add_(a)),
    )


def _env() -> dict:
    import os

    return dict(os.environ, PYTHONPATH=f"{REPO / 'bench' / 'dataplane' / 'inject'}:{REPO}")


def main(argv: list[str]) -> None:
    what, tls_dir, *rest = argv
    if what == "serve":
        serve(Path(tls_dir), int(rest[0]))
    else:
        client(Path(tls_dir), int(rest[0]), int(rest[1]))


if __name__ == "__main__":
    main(sys.argv[1:])
