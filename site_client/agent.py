"""The site agent: all WAN work for one site, while torch's elastic launcher runs its trainers.

Threads, each with one job:

* heartbeats: renew the lease every ``heartbeat_interval_s`` whatever the trainers are doing,
  report their progress, and learn of new rounds;
* WAN: fetch theta_r when a round opens (into a safetensors file in shared memory), and push the
  pseudo-gradient a trainer hands over;
* local IPC: answer the trainers (``site_client.trainer``) on a Unix socket.

The main thread runs the launcher (it installs signal handlers, so it must be the main thread).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from safetensors.torch import load_file, save_file

from site_client.compression import (
    CODEC_STATE_FILE,
    compression_of,
    load_codec_state,
    save_codec_state,
)
from site_client.coordinator_client import CoordinatorClient, CoordinatorError, GlobalState
from site_client.local_ipc import IpcServer
from wire.backoff import DeadlineExceeded
from wire.proto import isthmus_pb2 as pb

log = logging.getLogger("isthmus.site")


@dataclass(frozen=True)
class AgentConfig:
    site: str
    run_dir: Path
    shm_dir: Path
    inner_steps: int | None = None  # None: the job's H
    wait_poll_s: float = 1.0


def default_shm_dir(site: str) -> Path:
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    return base / f"isthmus-{site}-{os.getpid()}"


class SiteAgent:
    def __init__(self, cfg: AgentConfig, client: CoordinatorClient) -> None:
        self.cfg = cfg
        self.client = client
        self.cond = threading.Condition()
        self.info: pb.RoundInfo | None = None
        self.ready: dict | None = None  # theta published to the trainers
        self.held: GlobalState | None = None  # theta as fetched: the base of the next delta
        self.pending: dict | None = None  # an update handed over, not yet pushed
        self.pushed: set[int] = set()
        self.progress = pb.Progress(phase="idle")
        self.error: str | None = None
        self.stopping = False
        self.heartbeat_interval_s = 5.0
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        cfg.shm_dir.mkdir(parents=True, exist_ok=True)
        self.ipc = IpcServer(
            cfg.shm_dir / "agent.sock",
            {
                "hello": self._hello,
                "wait_round": self._wait_round,
                "progress": self._progress,
                "submit": self._submit,
                "metrics": self._metrics,
            },
        )
        self._threads: list[threading.Thread] = []

    # ---- life cycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Join the job (with backoff) and start the agent's threads."""
        reply = self.client.join()
        self.heartbeat_interval_s = reply.heartbeat_interval_s or 5.0
        self.job_name = reply.job_name
        self.job_config = reply.job_config.decode("utf-8", "replace")
        self.compression = compression_of(self.job_config)
        self.codec_state = load_codec_state(self.cfg.run_dir / CODEC_STATE_FILE)
        with self.cond:
            self.info = reply.round
        self.ipc.start()
        for name, target in (("heartbeat", self._heartbeat_loop), ("wan", self._wan_loop)):
            t = threading.Thread(target=target, name=f"agent-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        log.info("[%s] joined job %r at round %d", self.cfg.site, self.job_name, reply.round.round)

    def stop(self, leave: bool = True) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        for t in self._threads:
            t.join(timeout=5)
        self.ipc.close()
        if leave:
            self.client.leave("site stopping")
        shutil.rmtree(self.cfg.shm_dir, ignore_errors=True)

    def fail(self, message: str) -> None:
        log.error("[%s] %s", self.cfg.site, message)
        with self.cond:
            self.error = message
            self.cond.notify_all()

    # ---- threads --------------------------------------------------------------------------

    def _heartbeat_loop(self) -> None:
        while True:
            with self.cond:
                if self.cond.wait_for(lambda: self.stopping, timeout=self.heartbeat_interval_s):
                    return
                progress = pb.Progress()
                progress.CopyFrom(self.progress)
            try:
                info = self.client.heartbeat(progress).round
            except (CoordinatorError, DeadlineExceeded) as exc:
                self.fail(f"lost the coordinator: {exc}")
                return
            with self.cond:
                self.info = info
                self.cond.notify_all()

    def _wan_loop(self) -> None:
        try:
            while True:
                with self.cond:
                    self.cond.wait_for(
                        lambda: self.stopping or self.error or self._work() is not None,
                        timeout=self.heartbeat_interval_s,
                    )
                    if self.stopping or self.error:
                        return
                    work = self._work()
                if work == "fetch":
                    self._fetch()
                elif work == "push":
                    self._push()
        except (CoordinatorError, DeadlineExceeded, OSError) as exc:
            self.fail(f"WAN transfer failed: {exc}")

    def _work(self) -> str | None:
        """What the WAN thread should do next (called under ``cond``)."""
        info = self.info
        if info is None:
            return None
        if self.pending is not None:
            return "push"
        wanted = info.finished or (info.participant and info.round not in self.pushed)
        if wanted and (self.ready is None or self.ready["version"] != info.version):
            return "fetch"
        return None

    def _fetch(self) -> None:
        with self.cond:
            info = self.info
            self.progress.phase = "fetching"
        started = time.monotonic()
        try:
            state = self.client.fetch(info.version, held=self.held)
        except CoordinatorError as exc:
            if exc.code != grpc.StatusCode.NOT_FOUND:
                raise
            # The coordinator moved on since the last heartbeat; the next one says where to.
            log.info("[%s] %s; waiting for the next heartbeat", self.cfg.site, exc)
            with self.cond:
                self.info = self.client.heartbeat().round
            return
        self.held = state
        path = self.cfg.shm_dir / f"theta-v{state.version}.safetensors"
        tmp = path.with_suffix(".tmp")
        save_file(state.theta, str(tmp))
        os.replace(tmp, path)
        with self.cond:
            previous = self.ready
            self.ready = {
                "round": info.round,
                "version": state.version,
                "theta_path": str(path),
                "theta_hash": state.theta_hash.hex(),
                "finished": bool(info.finished),
                "inner_steps": self.cfg.inner_steps or info.inner_steps,
                "total_rounds": info.total_rounds,
            }
            self.progress.phase = "training"
            self.cond.notify_all()
        if previous is not None and previous["theta_path"] != str(path):
            Path(previous["theta_path"]).unlink(missing_ok=True)
        log.info(
            "[%s] %s theta_%d (%s) in %.2fs",
            self.cfg.site,
            "final" if info.finished else f"round {info.round}:",
            state.version,
            state.theta_hash.hex()[:12],
            time.monotonic() - started,
        )
        if info.finished:
            self._write_final(state.version, state.theta_hash.hex())

    def _push(self) -> None:
        with self.cond:
            job = self.pending
            self.progress.phase = "pushing"
        started = time.monotonic()
        delta = load_file(job["path"])
        sent_before = self.client.bytes_sent
        residuals = {k: v.clone() for k, v in self.codec_state.state_dict().items()}
        try:
            reply = self.client.push(
                job["round"],
                delta,
                weight=job["weight"],
                base_version=job["version"],
                compression=self.compression,
                codec_state=self.codec_state,
            )
            outcome = reply.message
            # Delivered: the residuals the encoding left are what the next round adds back.
            save_codec_state(self.cfg.run_dir / CODEC_STATE_FILE, self.codec_state)
        except CoordinatorError as exc:
            if exc.code != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            # The round closed without this site (deadline): the strategy's rule for late
            # updates applies, and the trainers go on with the next round.
            outcome = f"dropped: {exc}"
            self.codec_state.load_state_dict(residuals)
            log.warning("[%s] round %d update not counted: %s", self.cfg.site, job["round"], exc)
        Path(job["path"]).unlink(missing_ok=True)
        with self.cond:
            self.pushed.add(job["round"])
            self.pending = None
            self.progress.phase = "idle"
            self.cond.notify_all()
        log.info(
            "[%s] round %d: pushed %.2f MB in %.2fs (%s)",
            self.cfg.site,
            job["round"],
            (self.client.bytes_sent - sent_before) / 1e6,
            time.monotonic() - started,
            outcome,
        )

    def _write_final(self, version: int, theta_hash: str) -> None:
        final = {
            "site": self.cfg.site,
            "version": version,
            "theta_hash": theta_hash,
            "wan_bytes_sent": self.client.bytes_sent,
            "wan_bytes_received": self.client.bytes_received,
        }
        (self.cfg.run_dir / "final.json").write_text(json.dumps(final))

    # ---- trainer requests (IPC threads) -----------------------------------------------------

    def _hello(self, req: dict) -> dict:
        return {
            "site": self.cfg.site,
            "run_dir": str(self.cfg.run_dir),
            "shm_dir": str(self.cfg.shm_dir),
            "job_config": self.job_config,
        }

    def _wait_round(self, req: dict) -> dict:
        after = int(req.get("after", -1))
        timeout = float(req.get("timeout", self.cfg.wait_poll_s))

        def ready() -> bool:
            r = self.ready
            return bool(self.error) or (
                r is not None
                and (r["finished"] or r["round"] > after and r["round"] not in self.pushed)
            )

        with self.cond:
            if not self.cond.wait_for(ready, timeout=timeout):
                return {"ready": False}
            if self.error:
                raise RuntimeError(self.error)
            return {"ready": True, **self.ready}

    def _progress(self, req: dict) -> dict:
        with self.cond:
            self.progress.round = int(req["round"])
            self.progress.inner_step = int(req["step"])
            self.progress.train_loss = float(req.get("loss", 0.0))
            self.progress.phase = "training"
        return {}

    def _submit(self, req: dict) -> dict:
        round_number = int(req["round"])
        with self.cond:
            same = self.pending is not None and self.pending["round"] == round_number
            if round_number in self.pushed or same:
                Path(req["path"]).unlink(missing_ok=True)
                return {"accepted": True, "duplicate": True}
            if self.ready is None or self.ready["round"] != round_number:
                raise ValueError(f"round {round_number} is not the site's current round")
            self.pending = {
                "round": round_number,
                "path": req["path"],
                "weight": float(req.get("weight", 1.0)),
                "version": self.ready["version"],
            }
            self.cond.notify_all()
        return {"accepted": True}

    def _metrics(self, req: dict) -> dict:
        record = {k: v for k, v in req.items() if k != "op"}
        record["site"] = self.cfg.site
        with open(self.cfg.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        shown = "  ".join(
            f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
            for k, v in record.items()
            if k != "site"
        )
        log.info("[%s] %s", self.cfg.site, shown)
        return {}
