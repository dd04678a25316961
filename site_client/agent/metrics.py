"""A site agent's Prometheus metrics (``siteclient start --metrics [HOST:]PORT``).

What the agent knows that the coordinator does not: how long its trainers spend training
against waiting on the WAN (``compute_utilisation``), its transfers' times and bytes, and the
numbers its trainers report (train loss each step, validation loss and whatever else they send
as ``metrics``). Everything is read off the agent's state at each scrape.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "isthmus_agent_"
PHASES = ("idle", "fetching", "training", "pushing")


@dataclass
class ComputeClock:
    """The trainers' time inside tasks (from taking a task to handing its update over)
    against the wall time since they took their first; the rest is time spent waiting for
    the WAN (theta, the next round). Updated under the agent's condition."""

    started: float | None = None
    training_since: float | None = None
    trained_s: float = 0.0
    # The last task's compute: the seconds its trainers report in step bodies (from taking
    # it to handing it over where they report none; a streaming task is taken at its merge,
    # after most of its steps, so that would say too little).
    last_task_s: float | None = None
    task_steps: int = 0  # the inner steps of the task being trained
    last_steps_per_s: float = 0.0  # the last task's inner steps over its compute
    computed_s: float = 0.0  # the reported compute of every task so far

    def task_taken(self, now: float, steps: int = 0) -> None:
        self.started = now if self.started is None else self.started
        if self.training_since is None:
            self.training_since, self.task_steps = now, steps

    def task_handed_over(self, now: float, compute_s: float = 0.0) -> None:
        if self.training_since is not None:
            held = now - self.training_since
            self.trained_s += held
            self.training_since = None
            self.last_task_s = compute_s if compute_s > 0 else held
            self.computed_s += compute_s
            if self.last_task_s > 0 and self.task_steps:
                self.last_steps_per_s = self.task_steps / self.last_task_s

    def utilisation(self, now: float) -> float:
        """The trainers' compute (reported, else time in tasks) over the wall time since the
        first task (0 before any)."""
        trained, wall = self.seconds(now)
        busy = self.computed_s if self.computed_s > 0 else trained
        return min(busy / wall, 1.0) if wall > 0 else 0.0

    def seconds(self, now: float) -> tuple[float, float]:
        """(training, wall) seconds so far."""
        if self.started is None:
            return 0.0, 0.0
        open_task = now - self.training_since if self.training_since is not None else 0.0
        return self.trained_s + open_task, now - self.started


@dataclass
class TransferStats:
    """Counts and seconds of the agent's fetches and pushes (under the agent's condition)."""

    counts: dict[str, int] = field(default_factory=lambda: {"fetch": 0, "push": 0})
    seconds: dict[str, float] = field(default_factory=lambda: {"fetch": 0.0, "push": 0.0})
    held_s: float = 0.0  # pushes' last chunks waiting for the site checkpoint
    trainer_metrics: dict[str, float] = field(default_factory=dict)

    def add(self, kind: str, seconds: float, held_s: float = 0.0) -> None:
        self.counts[kind] += 1
        self.seconds[kind] += seconds
        self.held_s += held_s

    def reported(self, record: dict) -> None:
        for name, value in record.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                self.trainer_metrics[name] = float(value)


class AgentCollector:
    """Reads the agent (its state and its coordinator client) at each scrape."""

    def __init__(self, agent) -> None:
        self.agent = agent

    def describe(self):
        return []

    def collect(self):
        a, s = self.agent, self.agent.state
        with s.cond:
            progress = s.progress
            phase, rnd = progress.phase, progress.round
            step, loss = progress.inner_step, progress.train_loss
            trained, wall = s.compute.seconds(time.monotonic())
            stats = s.transfers
            counts, seconds = dict(stats.counts), dict(stats.seconds)
            held, reported = stats.held_s, dict(stats.trainer_metrics)
            health, drained = s.health, s.drained
        yield _gauge("round", "The round the trainers work on", rnd)
        yield _gauge("inner_step", "Their last reported inner step", step)
        yield _gauge("train_loss", "Their last reported train loss", loss)
        family = GaugeMetricFamily(
            PREFIX + "phase", "1 for the phase the site is in", labels=["phase"]
        )
        for name in PHASES:
            family.add_metric([name], float(phase == name))
        yield family
        yield _gauge(
            "compute_utilisation",
            "Time the trainers spent in tasks over wall time since their first task",
            trained / wall if wall > 0 else 0.0,
        )
        yield _counter("wan_wait_seconds", "Time the trainers waited on the WAN", wall - trained)
        yield _counter("training_seconds", "Time the trainers spent in tasks", trained)
        yield _counter("bytes_sent", "Update bytes sent", a.client.bytes_sent)
        yield _counter("bytes_received", "theta bytes received", a.client.bytes_received)
        yield _counter("push_held_seconds", "Last chunks waiting for the site checkpoint", held)
        for kind, plural in (("fetch", "fetches"), ("push", "pushes")):
            yield _counter(plural, f"{plural.capitalize()} done", counts[kind])
            yield _counter(f"{kind}_seconds", f"Time in {plural}", seconds[kind])
        family = GaugeMetricFamily(
            PREFIX + "trainer_metric", "The last value the trainers reported", labels=["name"]
        )
        for name, value in sorted(reported.items()):
            family.add_metric([name], value)
        yield family
        yield _gauge("drained", "1 once the coordinator drained this site", float(bool(drained)))
        if health is not None:  # the trainers' newest probe (site_client.trainer.health_probe)
            yield _gauge("matmul_gflops", "Health probe: matmul GFLOP/s", health.matmul_gflops)
            yield _gauge(
                "allreduce_gbps", "Health probe: all-reduce GB/s over the site's ranks",
                health.allreduce_gbps,
            )  # fmt: skip
            yield _gauge("gpu_errors", "Health probe: GPU error counters", len(health.gpu_errors))


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, doc, value=float(value))


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, doc, value=float(value))


def agent_registry(agent) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(AgentCollector(agent))
    return registry
