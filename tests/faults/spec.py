"""The job a fault run trains: a small GPT (examples/gpt_diloco) with DiLoCo, two sites by
default, short rounds and timeouts scaled so a run takes seconds.

With ``fragments > 1`` or ``delay_steps > 0`` it is a streaming job (``[streaming]``,
``wire.fragments``): each of the ``rounds`` outer rounds is ``fragments`` coordinator rounds of
``inner_steps / fragments`` inner steps each (``coordinator_rounds``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from coord_harness import job_config

MODEL_FIELDS = (
    "sites",
    "rounds",
    "inner_steps",
    "nproc",
    "checkpoint_every",
    "min_sites",
    "fragments",
    "delay_steps",
    "merge_alpha",
)


@dataclass(frozen=True)
class JobSpec:
    """What a fault run trains; equal specs give the same model in a crash-free run."""

    sites: int = 2
    rounds: int = 3
    inner_steps: int = 8
    nproc: int = 1
    tls: bool = True
    lease_ttl_s: float = 20.0
    heartbeat_s: float = 0.25
    deadline_s: float = 120.0
    checkpoint_every: int = 2
    close_delay_s: float = 0.0  # see faults.slow_strategy: they do not change the model
    delay_round: int = -1
    ballast_mib: int = 0
    outage_timeout_s: float = 300.0
    min_sites: int | None = None  # None: every site (a round never closes without one)
    fragments: int = 1  # [streaming] P; with delay_steps 0 and merge_alpha 0: plain DiLoCo
    delay_steps: int = 0  # [streaming] tau
    merge_alpha: float = 0.0  # [streaming] alpha
    # Asynchronous rounds (``docs/howto/streaming.md``): with min_sites below sites.
    merge: str = "blocking"  # [streaming] merge
    grace_s: float | None = None  # [rounds] grace_s
    max_staleness: int = 1  # [rounds] max_staleness
    late_discount: float = 0.0  # [strategy] late_discount
    # [shards] count: not a model field (theta is the same bits for every K), so a sharded
    # run is judged against the crash-free one-process run.
    shards: int = 1

    @property
    def streaming(self) -> bool:
        return (self.fragments, self.delay_steps, self.merge_alpha) != (1, 0, 0.0)

    @property
    def coordinator_rounds(self) -> int:
        """The rounds the coordinator runs: one per fragment of each outer round."""
        return self.rounds * self.fragments

    @property
    def round_steps(self) -> int:
        """Inner steps of one coordinator round (H / P)."""
        return self.inner_steps // self.fragments

    def config(self, marker_dir: Path) -> dict:
        strategy = {"name": "faults.slow_strategy:SlowDiLoCo", "lr": 0.7, "momentum": 0.9}
        strategy.update(
            close_delay_s=self.close_delay_s,
            delay_round=self.delay_round,
            ballast_mib=self.ballast_mib,
            marker_dir=str(marker_dir),
        )
        rounds = {}  # beyond the plain specs' (absent: their jobs are as they were)
        if self.late_discount:
            strategy["late_discount"] = self.late_discount
        if self.grace_s is not None:
            rounds.update(grace_s=self.grace_s, max_staleness=self.max_staleness)
        tables = {}
        if self.streaming:  # absent otherwise: the plain specs' jobs are as they were
            tables["streaming"] = {
                "fragments": self.fragments,
                "delay_steps": self.delay_steps,
                "merge_alpha": self.merge_alpha,
                **({"merge": self.merge} if self.merge != "blocking" else {}),
            }
        if self.shards > 1:
            tables["shards"] = {"count": self.shards}
        return job_config(
            name="faults",
            strategy=strategy,
            model={
                "factory": "examples.gpt_diloco.model:build_model",
                "kwargs": {"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64, "seq_len": 32},
            },
            rounds={
                "total": self.rounds,
                "inner_steps": self.inner_steps,
                "min_sites": self.min_sites or self.sites,
                "max_sites": self.sites,
                "join_window_s": 30.0,
                "deadline_s": self.deadline_s,
                **rounds,
            },
            timeouts={"heartbeat_interval_s": self.heartbeat_s, "lease_ttl_s": self.lease_ttl_s},
            **tables,
        )

    def model_key(self) -> tuple:
        """The fields that decide the final model (timing knobs left out)."""
        return tuple(getattr(self, f) for f in MODEL_FIELDS)

    def crash_free(self) -> JobSpec:
        """The plain job that trains the same model."""
        return JobSpec(**{f: getattr(self, f) for f in MODEL_FIELDS})
