"""``python -m bench.hetero`` (see the package docstring)."""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from bench.hetero.plan import SITES, SLOW_SITE, make_plan, parse_args
from bench.hetero.report import compare, headline, last_line, plot, site_lines, table
from bench.hetero.run import run
from bench.progress import steps
from bench.utilisation import model_params


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = make_plan(args)
    root = args.out or Path(tempfile.mkdtemp(prefix="isthmus-hetero-"))
    root.mkdir(parents=True, exist_ok=True)
    params = model_params(plan.model)
    job = (
        f"{SITES} sites (site-{SLOW_SITE} {plan.slowdown:g}x slower), {plan.rounds} outer rounds "
        f"of H {plan.inner_steps}, GPT {params / 1e6:.2f} M params, 50 Mbit/s 20 ms links"
    )
    print(f"{len(plan.runs)} runs of {job}; folders in {root}", flush=True)
    started = time.monotonic()
    results = []
    for name in steps(plan.runs, name=lambda n: f"{n} run"):
        result = run(root / name, name, plan)
        results.append(result)
        cus = ", ".join(f"{s} {u.utilisation:.3f}" for s, u in result.sites.items())
        print(
            f"[{time.monotonic() - started:6.1f}s] {name}: CU {cus}; {result.span_s:.0f}s, "
            f"final loss {result.points[-1].loss:.4f}",
            flush=True,
        )
    compared = compare(results)
    print()
    table(results, compared)
    print(
        "\nCU: time inside inner steps / wall time from first step to last (site-2 is the slow "
        "one); wait: the longest mean wait per task of a site (between tasks and at merges). "
        "trained: every\nsite's inner steps x batch x seq; counted: the updates folded into theta "
        "(late ones at their discount). loss @: the newest theta checkpointed by then.\n* the "
        "site killed halfway: its downtime counts against its CU, which is left out of CU min."
    )
    print("\neach site's tokens counted into theta / trained (thousands):")
    print("\n".join(site_lines(results)))
    png = args.png or root / "hetero.png"
    plot(results, png, job)
    print(f"\nplot: {png}; total {time.monotonic() - started:.0f}s")
    print(last_line(headline(results, compared)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
