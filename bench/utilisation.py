"""Compute utilisation of sites on a slow WAN: blocking DiLoCo against streaming outer steps.

::

    python -m bench.utilisation [--quick] [--modes blocking,streaming] [--codecs fp32,int8,int4]
                                [--out DIR] [--link-mbit 4] [--sweep-mbit 8] [--delay-ms 50] ...

Each run is a real job: a ``coordinator serve`` and two ``siteclient start`` sites (one FSDP2
trainer each, ``examples/gpt_diloco/train.py``) over mutual TLS, every site dialling the
coordinator through its own ``bench.relay.Relay`` (the harness of ``tests/faults/cluster.py``):
a one-way delay and a rate cap per direction shared by the site's connections, an emulated
WAN link. The model is the example GPT sized in ``[model] kwargs`` so that one blocking sync
costs many inner steps here (by default 0.87 M parameters, 3.5 MB in float32, over 4 Mbit/s
and 50 ms each way: a blocking sync of about 15 s, against 50 to 60 ms per inner step on one of
two busy cores).

Runs, all on the same link and for the same inner steps (``--rounds`` outer rounds of H):

- blocking: today's DiLoCo; a coordinator round is H inner steps, then the site pushes its
  pseudo-gradient, waits for theta_{r+1}, loads it and trains on.
- streaming: ``[streaming] fragments = P, delay_steps = tau, merge_alpha = 0`` (see
  ``wire/fragments.py``); a coordinator round is one fragment's sync after H/P inner steps; the
  site trains on while it travels and merges the result tau steps later (waiting there if it is
  late).

each with the codecs of ``--codecs`` on both links (``[compression] default`` and
``[compression.downlink] default``: fp32 sends raw float32, int8 and int4 quantise).

What is measured
----------------
Rank 0 of each site's trainer writes one ``"steps"`` record per task (coordinator round) to
``RUN_DIR/trainer_timings.jsonl`` (``site_client.timings.record``): ``compute_s``, the seconds
spent inside the training script's step bodies; ``first_step_at`` and ``last_step_at``, the
wall-clock start of its first step and end of its last; ``merge_wait_s``, the seconds blocked
waiting for a late fragment's result (0 in blocking mode). A site's *compute utilisation* is
``sum(compute_s) / (max(last_step_at) - min(first_step_at))`` over its tasks: the share of the
training phase (start-up, the theta_0 download and the final fetch left out) its trainer spent
computing. The phase ends with the last step, so the last round's sync is outside it: with R
outer rounds blocking DiLoCo's phase holds R - 1 syncs (4 rounds by default).

*Blocked s/round* is the mean time between one task's last step and the next one's first
(blocking DiLoCo's push, close, fetch and load, and the example trainer's validation of theta_r
at the start of each round) plus the mean ``merge_wait_s``. WAN bytes are what crossed the sites'
relays, both sites summed, theta_0 and the final theta included; the validation loss is what
the sites' trainers report for the final theta.

Two cores are shared by both trainers, both agents, the coordinator and the relays, so what
an agent spends encoding and sending while its trainer computes slows the steps down (as it
would on a busy host); the utilisation still counts those steps as compute.

Defaults: H 320, P 2, tau = H/P - 1 = 159 (the most time a fragment may travel), 4 rounds; fp32
on the main link (``--link-mbit``) and on each rate of ``--sweep-mbit``, int8 and int4 on the
main link: 8 runs, about 15 minutes here. ``--quick``: a 0.2 M-parameter GPT, H 16, 2 rounds,
fp32 on the main link only.

Output: a line per run as it finishes, the table, the plot (``utilisation.png`` in ``--out``,
its path printed: utilisation against link rate for both modes, and each codec on the main
link), the line ``util_<mode>_<codec>_<rate>mbit=...`` per run and, last, ``blocking_cu=...
streaming_cu=... link_mbit=... rtt_ms=... model_mb=... fragments=... tau=...
streaming_over_blocking=...`` (fp32 on the main link).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))  # the cluster harness lives with the fault tests

from faults.cluster import Cluster  # noqa: E402
from faults.spec import JobSpec  # noqa: E402

from bench.utilisation_report import (  # noqa: E402
    Result,
    figures,
    final_val_loss,
    headline,
    plot,
    site_use,
    table,
)

MODES = ("blocking", "streaming")
CODECS = ("fp32", "int8", "int4")
# 0.87 M parameters: 3.5 MB of float32 per transfer, ~30 ms per inner step on one core.
MODEL = {"d_model": 128, "n_layers": 4, "n_heads": 4, "d_ff": 512, "seq_len": 64}
QUICK_MODEL = {"d_model": 64, "n_layers": 4, "n_heads": 4, "d_ff": 256, "seq_len": 32}


@dataclass(frozen=True)
class UtilisationSpec(JobSpec):
    """The fault harness's job with the example GPT, plain DiLoCo, and the run's codec (its
    ``fragments``/``delay_steps`` give the ``[streaming]`` table; 1 and 0: blocking DiLoCo)."""

    model: tuple = tuple(MODEL.items())
    codec: str = "fp32"
    checkpoint_every: int = 0  # a site checkpoint per task only
    heartbeat_s: float = 1.0
    lease_ttl_s: float = 60.0
    deadline_s: float = 600.0

    def config(self, marker_dir: Path) -> dict:
        cfg = super().config(marker_dir)
        cfg["job"]["name"] = f"utilisation-{self.codec}-p{self.fragments}"
        cfg["strategy"] = {"name": "diloco", "lr": 0.7, "momentum": 0.9}
        cfg["model"]["kwargs"] = dict(self.model)
        if self.codec != "fp32":
            cfg["compression"] = {"default": self.codec}
            cfg["compression.downlink"] = {"default": self.codec}
        return cfg


@dataclass(frozen=True)
class Setting:
    mode: str
    codec: str
    link_mbit: float
    fragments: int = 1
    delay_steps: int = 0

    @property
    def slug(self) -> str:
        return f"{self.mode}-{self.codec}-{self.link_mbit:g}mbit"


@dataclass
class Plan:
    """What every run of an invocation shares."""

    model: dict
    rounds: int
    inner_steps: int
    link_mbit: float  # the main link: every codec runs on it
    delay_s: float
    timeout_s: float
    settings: list[Setting] = field(default_factory=list)


def model_params(kwargs: dict) -> int:
    from examples.gpt_diloco.model import build_model

    return sum(p.numel() for p in build_model(**kwargs).parameters())


def streaming_supported() -> bool:
    """Whether this tree's coordinator takes a ``[streaming]`` table."""
    from coordinator.config import SECTIONS

    return "streaming" in SECTIONS


def run(folder: Path, setting: Setting, plan: Plan) -> Result:
    """One job to the end; raises with the processes' logs if it did not finish cleanly."""
    shutil.rmtree(folder, ignore_errors=True)
    streaming = setting.mode == "streaming"
    spec = UtilisationSpec(
        rounds=plan.rounds,
        inner_steps=plan.inner_steps,
        model=tuple(plan.model.items()),
        codec=setting.codec,
        fragments=setting.fragments if streaming else 1,
        delay_steps=setting.delay_steps if streaming else 0,
        deadline_s=plan.timeout_s,
    )
    started = time.monotonic()
    rate_bps = setting.link_mbit * 1e6 / 8
    with Cluster(folder, spec, delay_s=plan.delay_s, rate_bps=rate_bps) as cluster:
        cluster.start()
        record = cluster.finish(timeout=plan.timeout_s)
        counters = [relay.counters() for relay in cluster.relays]
        cluster.check_clean(record, setting.slug)
        run_dirs = [site.run_dir for site in cluster.sites]
    losses = [final_val_loss(d) for d in run_dirs]
    result = Result(
        mode=setting.mode,
        codec=setting.codec,
        fragments=setting.fragments if streaming else 1,
        delay_steps=setting.delay_steps if streaming else 0,
        sites=[site_use(d) for d in run_dirs],
        bytes_up=sum(c.bytes_up for c in counters),
        bytes_down=sum(c.bytes_down for c in counters),
        link_mbit=setting.link_mbit,
        val_loss=sum(losses) / len(losses),
        seconds=time.monotonic() - started,
    )
    drop_bulk(folder)
    return result


def drop_bulk(folder: Path) -> None:
    """Checkpoints and spools (megabytes a run); the logs and timings stay."""
    for path in [folder / "state" / "checkpoints", *folder.glob("site-*/checkpoints")]:
        shutil.rmtree(path, ignore_errors=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.utilisation",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="a short smoke run (about a minute)")
    p.add_argument("--modes", default=",".join(MODES), help="of blocking, streaming")
    p.add_argument("--codecs", help=f"of {', '.join(CODECS)} (default all; quick: fp32)")
    p.add_argument("--rounds", type=int, help="outer rounds (default 4; quick 2)")
    p.add_argument("--inner-steps", type=int, help="H (default 320; quick 16)")
    p.add_argument("--fragments", type=int, default=2, help="streaming's P")
    p.add_argument("--delay-steps", type=int, help="streaming's tau (default H/P - 1)")
    p.add_argument("--link-mbit", type=float, default=4.0, help="the main link: Mbit/s per "
                   "direction per site (every codec runs there)")  # fmt: skip
    p.add_argument("--sweep-mbit", default="8", help="other link rates, fp32 only ('' none)")
    p.add_argument("--delay-ms", type=float, default=50.0, help="one-way delay")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    p.add_argument("--out", type=Path, help="runs' folders and the plot (default: a temp dir)")
    return p.parse_args(argv)


def make_plan(args: argparse.Namespace) -> Plan:
    modes = args.modes.split(",")
    codecs = (args.codecs or ("fp32" if args.quick else ",".join(CODECS))).split(",")
    for name, chosen, known in (("--modes", modes, MODES), ("--codecs", codecs, CODECS)):
        if unknown := sorted(set(chosen) - set(known)):
            raise SystemExit(f"{name}: unknown {unknown[0]!r}; choose from {', '.join(known)}")
    h = args.inner_steps or (16 if args.quick else 320)
    p = args.fragments
    tau = args.delay_steps if args.delay_steps is not None else max(0, h // p - 1)
    if p < 1 or h % p or tau >= h // p:
        raise SystemExit(f"need H % P == 0 and tau < H/P; got H={h}, P={p}, tau={tau}")
    if "streaming" in modes and not streaming_supported():
        print("note: this tree's coordinator has no [streaming] table yet: streaming runs skipped")
        modes = [m for m in modes if m != "streaming"]
    plan = Plan(
        model=QUICK_MODEL if args.quick else MODEL,
        rounds=args.rounds or (2 if args.quick else 4),
        inner_steps=h,
        link_mbit=args.link_mbit,
        delay_s=args.delay_ms / 1000,
        timeout_s=args.timeout,
    )
    sweep = [] if args.quick else [float(x) for x in args.sweep_mbit.split(",") if x.strip()]
    rates = sorted({args.link_mbit, *sweep})
    plan.settings = [
        Setting(m, c, rate, p, tau)
        for c in codecs
        for rate in (rates if c == "fp32" else [args.link_mbit])
        for m in modes
    ]
    return plan


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = make_plan(args)
    if not plan.settings:
        raise SystemExit("nothing to run")
    root = args.out or Path(tempfile.mkdtemp(prefix="isthmus-utilisation-"))
    root.mkdir(parents=True, exist_ok=True)
    model = ", ".join(f"{k} {v}" for k, v in plan.model.items())
    params = model_params(plan.model)
    short = f"GPT {params / 1e6:.2f} M params ({params * 4 / 1e6:.1f} MB fp32)"
    link = f"{plan.link_mbit:g} Mbit/s and {plan.delay_s * 1000:g} ms each way per site"
    print(
        f"{len(plan.settings)} runs of 2 sites x {plan.rounds} rounds x H {plan.inner_steps}; "
        f"{short}: {model}; link {link}; folders in {root}",
        flush=True,
    )
    started = time.monotonic()
    results = []
    for i, setting in enumerate(plan.settings, 1):
        try:
            result = run(root / setting.slug, setting, plan)
        except ValueError as e:  # a trainer without the "steps" records
            raise SystemExit(f"{setting.slug}: {e}") from None
        results.append(result)
        sites = " ".join(f"{s.utilisation:.3f}" for s in result.sites)
        print(
            f"[{time.monotonic() - started:6.1f}s] {i}/{len(plan.settings)} {result.label:<16} "
            f"util {result.utilisation:.3f} (sites {sites}), training {result.wall_s:.1f}s, "
            f"run {result.seconds:.0f}s",
            flush=True,
        )
    print()
    table(results)
    print(
        "\nutil: time inside inner steps / training phase wall time; blocked s/round: per "
        "coordinator round\n(H steps blocking, H/P streaming), waiting between rounds or for "
        "a fragment's merge;\nbytes: both sites' relays, theta_0 and the final theta included."
    )
    png = root / "utilisation.png"
    title = f"2 sites, {plan.rounds} rounds of H {plan.inner_steps}, {short}, {link}"
    plot(results, png, title, plan.link_mbit)
    print(f"\nplot: {png}; total {time.monotonic() - started:.0f}s")
    print(" ".join(f"{k}={v}" for k, v in figures(results).items()))
    last = headline(results, plan.link_mbit, 2 * plan.delay_s * 1000, params * 4 / 1e6)
    print(" ".join(f"{k}={v}" for k, v in last.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
