"""What the trainers ask the site agent, over ``site_client.local_ipc`` (JSON lines).

Rank 0 of the site's trainers drives the rounds; every rank says ``hello``.

``hello`` (``attempt``: the launcher's restart count)
    -> ``site``, ``run_dir``, ``shm_dir``, ``job_config`` (TOML text), ``checkpoint_url``,
    ``checkpoint_dir``, ``node`` and ``nodes`` (this host's node rank, and how many hosts the
    site spans: ``site_client.trainer.nodes``).
``wait_round`` (``timeout`` seconds, default the agent's poll)
    -> ``{"ready": false}``, or ``ready`` with the next task not yet done: ``round``,
    ``data_unit`` (``""`` in federated mode), ``site_index`` and ``num_sites`` (this site's place
    among the round's participants), ``version``, ``theta_path``, ``theta_hash``,
    ``inner_steps``, ``total_rounds``, ``finished`` (the job is over: ``theta_path`` is the
    final theta and there is no task). ``theta_path`` is a safetensors file every rank maps.
    On a site of several hosts it also carries ``lease``, for the other nodes' agents.
``progress`` (``round``, ``data_unit``, ``step``, ``loss``)
    -> ``{"cancel": true}`` once that task's unit was committed by another site (stop, do
    not submit), else ``{}``.
``submit`` (``round``, ``data_unit``, ``paths`` (one shard file per rank, or ``path``: one
file of whole tensors), ``weight``, ``durable``)
    -> ``{"accepted": true}``, plus ``duplicate`` or ``cancelled`` when the update is not
    wanted (its files are deleted). A task never handed out is an error. ``durable``: the
    task's site checkpoint is already on disk (a trainer that resumed at the task's end).
    On a site of several hosts also ``layout`` (every node's part) and ``upload_id``: the
    update is this node's part, encoded by ``encode`` before.
``encode`` (``round``, ``data_unit``, ``paths``; a site of several hosts)
    -> ``{"part": ...}``: this node's trainers' shard files encoded as its part
    (``site_client.agent.node_parts``).
``checkpointed`` (``round``, ``data_unit``)
    -> ``{}``; the site checkpoint at the end of that task is complete on disk: its update
    may count now (its push sends its last chunk).
``metrics`` (any numbers)
    -> ``{}``; appended to ``run_dir/metrics.jsonl`` and logged.
``health`` (``round``, ``matmul_gflops``, ``allreduce_gbps``, ``world_size``, ``device``,
``gpu_errors``)
    -> ``{}``; the trainers' newest probe (``site_client.trainer.health_probe``), sent in
    heartbeats.

``wait_round`` answers ``{"ready": true, "drained": true}`` once the coordinator drained the
site and the trainers owe nothing more: every rank then leaves the script with status 0.

A reply ``{"error": ...}`` means the request was refused (``IpcError`` in the trainer).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

from site_client.agent.node_encoding import PartEncoder, lease_json, site_part
from site_client.agent.state import AgentConfig, AgentState
from site_client.agent.tasks import Task, task_of
from site_client.local_ipc import Handler
from wire.codecs.link_rate import measured
from wire.health import Probe
from wire.proto import isthmus_pb2 as pb

log = logging.getLogger("isthmus.site")


class TrainerChannel:
    """The agent's answers to its trainers."""

    def __init__(self, state: AgentState, cfg: AgentConfig) -> None:
        self.state, self.cfg = state, cfg
        self.job_config = ""
        self.streaming = False  # the job has a [streaming] table (set on join)
        self._warned_steps = False
        self._attempt = -1  # the trainers' latest launcher attempt (restart count) seen
        # A multi-node site (set on join): this node's parts, and the lease passed to the
        # other nodes with each task (``site_client.agent.node_agent``).
        self.encoder: PartEncoder | None = None
        self.lease: Callable[[], pb.Lease | None] = lambda: None

    def handlers(self) -> dict[str, Handler]:
        return {
            "hello": self.hello,
            "wait_round": self.wait_round,
            "progress": self.progress,
            "submit": self.submit,
            "checkpointed": self.checkpointed,
            "metrics": self.metrics,
            "health": self.health,
            "encode": self.encode,
        }

    def hello(self, req: dict) -> dict:
        attempt = int(req.get("attempt", 0))
        with self.state.cond:
            if attempt > self._attempt >= 0:
                for upload in self.state.book.trainers_restarted():
                    log.warning(
                        "[%s] trainers restarted before round %d's end was checkpointed: "
                        "they train it again",
                        self.cfg.site,
                        upload.task.round,
                    )
                    upload.discard_files()
                self.state.cond.notify_all()
            self._attempt = max(self._attempt, attempt)
        return {
            "site": self.cfg.site,
            "run_dir": str(self.cfg.run_dir),
            "shm_dir": str(self.cfg.shm_dir),
            "job_config": self.job_config,
            "checkpoint_url": self.cfg.checkpoint_url,
            "checkpoint_dir": self.cfg.checkpoint_dir,
            "node": self.cfg.node,
            "nodes": self.cfg.nodes,
        }

    def offer(self) -> dict | None:
        """The task for the trainers now, with its theta (called under ``cond``)."""
        s = self.state
        r, info = s.ready, s.info
        if r is None:
            return None
        place = {"site_index": 0, "num_sites": 0}
        if info is not None:
            place = {"site_index": info.site_index, "num_sites": info.num_sites}
        if r.finished:
            return {**r.as_reply(), "data_unit": "", **place}
        task = task_of(info)
        if task is None or info.version != r.version or s.book.done(task):
            return None
        steps = r.inner_steps
        if self.cfg.inner_steps and self.cfg.inner_steps != steps:
            # A unit is H steps of the shared stream wherever it runs, or copies differ; a
            # streaming round is H/P steps, or the sites' fragment schedules differ.
            fixed = "shared-data mode" if task.unit else "streaming" if self.streaming else None
            if fixed is None:
                steps = self.cfg.inner_steps
            elif not self._warned_steps:
                log.warning(
                    "[%s] --inner-steps %d ignored under %s: rounds are %d steps",
                    self.cfg.site,
                    self.cfg.inner_steps,
                    fixed,
                    steps,
                )
                self._warned_steps = True
        reply = r.as_reply()
        return {
            **reply,
            "round": task.round,
            "data_unit": task.unit,
            "inner_steps": steps,
            **place,
        }

    def wait_round(self, req: dict) -> dict:
        s = self.state
        timeout = float(req.get("timeout", self.cfg.wait_poll_s))
        with s.cond:
            leave = self._drained_out
            if not s.cond.wait_for(
                lambda: s.error or leave() or self.offer() is not None, timeout=timeout
            ):
                return {"ready": False}
            if s.error:
                raise RuntimeError(s.error)
            if leave():  # SiteSession leaves: every rank exits the script with status 0
                return {"ready": True, "drained": True, "finished": False}
            offer = self.offer()
            if not offer["finished"]:
                task = Task(offer["round"], offer["data_unit"])
                s.book.issue(task, offer["version"], offer["theta_hash"])
                s.compute.task_taken(time.monotonic(), int(offer.get("inner_steps", 0)))
            if self.cfg.nodes > 1 and (lease := self.lease()) is not None:
                offer["lease"] = lease_json(lease)  # for the other nodes' agents
            return {"ready": True, **offer}

    def _drained_out(self) -> bool:
        """Drained, and the trainers owe nothing more (called under ``cond``)."""
        s = self.state
        finished = s.ready is not None and s.ready.finished
        return bool(s.drained) and not finished and not s.owes_work()

    def health(self, req: dict) -> dict:
        """The trainers' newest probe (``site_client.trainer.health_probe``): sent in heartbeats.
        One the coordinator would refuse is logged and dropped: a bad reading must not cost the
        site its heartbeats."""
        try:
            probe = Probe(
                round=int(req["round"]),
                matmul_gflops=float(req["matmul_gflops"]),
                allreduce_gbps=float(req["allreduce_gbps"]),
                world_size=int(req["world_size"]),
                device=str(req["device"]),
                gpu_errors=tuple(str(e) for e in req.get("gpu_errors", [])),
            )
            problem = probe.problem()
        except (KeyError, TypeError, ValueError) as exc:
            problem = f"health: malformed report ({exc})"
        if problem:
            log.warning("[%s] health probe dropped: %s", self.cfg.site, problem)
            return {}
        with self.state.cond:
            seq = self.state.health.seq + 1 if self.state.health is not None else 1
            self.state.health = dataclasses.replace(probe, seq=seq).to_report()
        log.info(
            "[%s] health probe before round %d: matmul %.3g GFLOP/s, all-reduce %.3g GB/s "
            "over %d rank(s) on %s%s",
            self.cfg.site,
            probe.round,
            probe.matmul_gflops,
            probe.allreduce_gbps,
            probe.world_size,
            probe.device,
            f"; GPU errors: {'; '.join(probe.gpu_errors)}" if probe.gpu_errors else "",
        )
        return {}

    def progress(self, req: dict) -> dict:
        task = _task(req)
        s = self.state
        with s.cond:
            s.progress.round = task.round
            s.progress.inner_step = int(req["step"])
            s.progress.train_loss = float(req.get("loss", 0.0))
            s.progress.phase = "training"
            return {"cancel": True} if s.book.is_cancelled(task) else {}

    def encode(self, req: dict) -> dict:
        """A multi-node site: this node's part of an update
        (``site_client.agent.node_encoding``)."""
        if self.encoder is None:
            raise ValueError("encode: this agent has not joined the job yet")
        reply = self.encoder.encode(req)
        if (lease := self.lease()) is not None:  # the newest, for the other nodes' pushes
            reply["lease"] = lease_json(lease)
        return reply

    def submit(self, req: dict) -> dict:
        task, s = _task(req), self.state
        paths = [str(p) for p in req.get("paths") or [req["path"]]]
        placed = None
        if req.get("layout") is not None:  # a multi-node site: node 0's part, encoded before
            placed = site_part(self.encoder.take(task), req["layout"], 0)
        with s.cond:
            outcome = s.book.submit(task, paths, float(req.get("weight", 1.0)))
            if outcome == "accepted" and placed is not None:
                upload = s.book.pending[task]
                upload.payload, upload.part = placed
                upload.upload_id = str(req["upload_id"])
            now = time.monotonic()
            s.compute.task_handed_over(now, measured(req.get("compute_s")))
            s.progress.task_compute_s = s.compute.last_task_s or 0.0
            s.progress.steps_per_s = s.compute.last_steps_per_s
            s.progress.compute_utilisation = s.compute.utilisation(now)
            if outcome != "accepted":
                for path in paths:
                    Path(path).unlink(missing_ok=True)
            if req.get("durable"):
                s.book.checkpointed(task)
            s.cond.notify_all()
        return {"accepted": True} if outcome == "accepted" else {"accepted": True, outcome: True}

    def checkpointed(self, req: dict) -> dict:
        task, s = _task(req), self.state
        with s.cond:
            s.book.checkpointed(task)
            s.cond.notify_all()
        return {}

    def metrics(self, req: dict) -> dict:
        record = {k: v for k, v in req.items() if k != "op"}
        record["site"] = self.cfg.site
        with self.state.cond:
            self.state.transfers.reported(record)
            wait = record.get("merge_wait_s")
            if isinstance(wait, int | float) and wait > 0:  # streaming: shown in status
                self.state.progress.merge_wait_s += float(wait)
        with open(self.cfg.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        shown = "  ".join(
            f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
            for k, v in record.items()
            if k != "site"
        )
        log.info("[%s] %s", self.cfg.site, shown)
        return {}


def _task(req: dict) -> Task:
    return Task(int(req["round"]), str(req.get("data_unit", "")))
