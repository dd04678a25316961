"""The floor under ``python -m bench.sync``: the round's bytes over mutual-TLS gRPC, nothing else.

Two client processes (the sites) and one server process (the coordinator), with the job's own
certificates and the product's gRPC settings. In each exchange both clients meet at a barrier,
stream the float32 model up in 1 MiB messages (the coordinator's chunk size), then stream it
back down: no hashing, no files, no checks, no aggregation. The floor of an exchange is the
slower client's up plus down; any coordinator that keeps mutual TLS over gRPC pays at least
that on this machine, so ``sync / floor`` is what the product adds on top of its transport and
``floor / allreduce`` what the transport costs against gloo's raw TCP.

Run by ``bench.sync_run``; also ``python -m bench.sync_floor serve|exchange ...`` (its parts).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc

from wire.identity import Bundle
from wire.net.grpc_options import channel_options, server_options

CHUNK = 1 << 20
SERVICE = "isthmus.bench.Floor"
REPO = Path(__file__).resolve().parent.parent


def _raw(data: bytes) -> bytes:
    return data


def serve(tls_dir: Path, nbytes: int, clients: int) -> None:
    """Serve Meet / Up / Down until stdin closes; print the port first."""
    bundle = Bundle.load(tls_dir)
    blob = bytes(CHUNK)
    barrier = threading.Barrier(clients)

    def meet(_request: bytes, _context) -> bytes:
        barrier.wait()
        return b""

    def up(chunks, _context) -> bytes:
        return sum(len(c) for c in chunks).to_bytes(8, "little")

    def down(_request: bytes, _context):
        for start in range(0, nbytes, CHUNK):
            yield blob[: min(CHUNK, nbytes - start)]

    handlers = {
        "Meet": grpc.unary_unary_rpc_method_handler(meet, _raw, _raw),
        "Up": grpc.stream_unary_rpc_method_handler(up, _raw, _raw),
        "Down": grpc.unary_stream_rpc_method_handler(down, _raw, _raw),
    }
    server, port = raw_server(bundle, SERVICE, handlers, 4 * clients)
    print(port, flush=True)
    sys.stdin.read()
    server.stop(0)


def raw_server(bundle: Bundle, service: str, handlers: dict, workers: int):
    """A started mutual-TLS gRPC server of raw-bytes ``handlers`` with the product's server
    options, on a free loopback port: ``(server, port)``."""
    server = grpc.server(futures.ThreadPoolExecutor(workers), options=server_options())
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(service, handlers)])
    creds = grpc.ssl_server_credentials(
        [(bundle.key, bundle.cert)], root_certificates=bundle.ca, require_client_auth=True
    )
    port = server.add_secure_port("127.0.0.1:0", creds)
    server.start()
    return server, port


def raw_channel(bundle: Bundle, port: int) -> grpc.Channel:
    """A mutual-TLS channel to ``raw_server`` with the product's channel options."""
    creds = grpc.ssl_channel_credentials(bundle.ca, bundle.key, bundle.cert)
    # The coordinator's certificate names the host the sites dial.
    options = [*channel_options(), ("grpc.ssl_target_name_override", "127.0.0.1")]
    return grpc.secure_channel(f"127.0.0.1:{port}", creds, options=options)


def exchange(tls_dir: Path, port: int, nbytes: int, repeats: int) -> list[float]:
    """Up then down, ``repeats`` times after one warm-up; seconds of each."""
    with raw_channel(Bundle.load(tls_dir), port) as channel:
        meet = channel.unary_unary(f"/{SERVICE}/Meet", _raw, _raw)
        up = channel.stream_unary(f"/{SERVICE}/Up", _raw, _raw)
        down = channel.unary_stream(f"/{SERVICE}/Down", _raw, _raw)
        blob = bytes(CHUNK)
        times = []
        for _ in range(repeats + 1):
            meet(b"")
            started = time.perf_counter()
            sent = (blob[: min(CHUNK, nbytes - s)] for s in range(0, nbytes, CHUNK))
            got = int.from_bytes(up(sent), "little")
            got_back = sum(len(c) for c in down(b""))
            times.append(time.perf_counter() - started)
            if got != nbytes or got_back != nbytes:
                raise RuntimeError(f"moved {got} up and {got_back} down of {nbytes} bytes")
    return times[1:]


def floor_seconds(pki: Path, nbytes: int, sites: int = 2, repeats: int = 3) -> float:
    """Median over exchanges of the slowest site's up-and-down of ``nbytes``."""
    me = [sys.executable, "-m", "bench.sync_floor"]
    server = subprocess.Popen(
        [*me, "serve", str(pki / "coord"), str(nbytes), str(sites)],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        port = server.stdout.readline().strip()
        if not port:
            raise RuntimeError("the floor's server did not start")
        clients = [
            subprocess.Popen(
                [*me, "exchange", str(pki / f"site-{i}"), port, str(nbytes), str(repeats)],
                cwd=REPO,
                stdout=subprocess.PIPE,
                text=True,
            )
            for i in range(sites)
        ]
        outs = [c.communicate(timeout=600)[0] for c in clients]
        if any(c.returncode for c in clients):
            raise RuntimeError("a floor client failed")
    finally:
        server.stdin.close()
        server.wait(timeout=30)
    per_site = [json.loads(out) for out in outs]
    return statistics.median(max(times) for times in zip(*per_site, strict=True))


def main(argv: list[str]) -> None:
    what, tls_dir, *rest = argv
    if what == "serve":
        serve(Path(tls_dir), int(rest[0]), int(rest[1]))
    else:
        print(json.dumps(exchange(Path(tls_dir), int(rest[0]), int(rest[1]), int(rest[2]))))


if __name__ == "__main__":
    main(sys.argv[1:])
