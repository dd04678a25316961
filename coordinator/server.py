"""Running the coordinator: the gRPC server, the round clock thread, shutdown."""

from __future__ import annotations

import logging
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc

from coordinator.config import JobConfig
from coordinator.core import CoordinatorCore, FatalError
from coordinator.servicer import CoordinatorServicer
from coordinator.store import write_atomic
from wire.grpc_options import server_options
from wire.proto import isthmus_pb2_grpc as pb_grpc

log = logging.getLogger("isthmus.coordinator")
TICK_S = 0.2


class CoordinatorServer:
    """A coordinator serving one job until it finishes, fails or is stopped."""

    def __init__(self, cfg: JobConfig, listen: str | None = None) -> None:
        self.cfg = cfg
        self.core = CoordinatorCore(cfg)
        self.stop_event = threading.Event()
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=cfg.server.workers),
            options=server_options(),
        )
        pb_grpc.add_CoordinatorServicer_to_server(CoordinatorServicer(self.core), self.server)
        address = listen or cfg.server.listen
        port = self.server.add_insecure_port(address)
        if port == 0:
            raise OSError(f"cannot listen on {address} (address in use or not local?)")
        self.address = f"{address.rpartition(':')[0]}:{port}"
        self.exit_code = 0

    def run(self) -> int:
        """Serve until the job is done and its sites have left, or until ``stop``."""
        self.server.start()
        write_atomic(Path(self.cfg.state_dir) / "address", f"{self.address}\n".encode())
        log.info("coordinator for job %r listening on %s", self.cfg.name, self.address)
        finished_at: float | None = None
        try:
            while not self.stop_event.is_set():
                with self.core.wake:
                    self.core.wake.wait(timeout=TICK_S)
                try:
                    while self.core.tick():
                        pass
                except FatalError as exc:
                    log.error("stopping: %s", exc)
                    self.exit_code = 3
                    break
                if self.core.finished:
                    finished_at = finished_at or time.monotonic()
                    if self._sites_gone(finished_at):
                        log.info("job %r finished; all sites have left", self.cfg.name)
                        break
        finally:
            self.server.stop(grace=2.0).wait()
        return self.exit_code

    def _sites_gone(self, finished_at: float) -> bool:
        with self.core.lock:
            live = self.core.leases.live(self.core.clock())
        return not live or time.monotonic() - finished_at > self.cfg.timeouts.lease_ttl_s

    def stop(self) -> None:
        self.stop_event.set()
