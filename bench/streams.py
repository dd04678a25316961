"""How much of a long fat link the product's transfers get over K streams, against raw TCP.

::

    python -m bench.streams [--delay-ms 40] [--rate-mbit 200] [--mib 64] [--streams 1,2,4,8]
        [--queue-kib BDP] [--repeats 3] [--mtu 1500] [--congestion cubic]
        [--slow-start-after-idle 0]

On a packet-level emulated WAN (``bench.wan_link``: two network namespaces, a relay with one
tail-drop bottleneck queue per direction and a one-way delay, cubic, the kernel's stock TCP
buffers, and ``net.ipv4.tcp_slow_start_after_idle`` as asked: 0, the usual tuning of a WAN
host, by default), ``--mib`` MiB cross from namespace a to b over K = 1, 2, 4, 8 raw TCP
streams in parallel, each carrying 1/K of the bytes, and over K > 1 streams sharing the bytes
(each takes the next MiB while any is left: what the product's one queue of pieces could reach
on fresh connections); then a real ``coordinator serve`` in b and a site client in a fetch
theta and push an update of that size over each K (``[transfer] streams``, with
``keep_connections``; one round per K and repeat). A K's first round is its connections'
first transfer (a job's first round); the later ones run on the connections as that left
them (every later round of a job). Efficiency is bytes / (time * rate); times run from the
first byte sent (for the product: the call) to the receiver's reply on an open connection, so
even a perfect transfer pays one round trip and the packets' headers (the "ideal" line). Each
row is the median of ``--repeats`` runs (for the product's later rounds, of ``--repeats`` - 1).
The header also says how much of a core the relay used and how late it wrote packets. Last,
the relay's own ceiling: no delay and no rate cap. Last line::

    efficiency_1=... efficiency_2=... efficiency_4=... efficiency_8=... efficiency_best=...
    best_streams=... raw_tcp_efficiency=... raw_tcp_efficiency_1=... raw_tcp_efficiency_2=...
    ... raw_tcp_shared_efficiency_2=... ... push_efficiency_1=... push_efficiency_2=... ...
    push_efficiency_best=... push_best_streams=... first_efficiency_best=...
    first_push_efficiency_best=... slow_start_after_idle=... relay_ceiling_mbit=...

``efficiency_K`` is the product's fetch over K streams in the rounds after the first,
``efficiency_best`` the best of them at ``best_streams``; ``raw_tcp_efficiency`` is the
single raw TCP stream (the reference), ``raw_tcp_efficiency_K`` raw TCP with K streams in
equal shares and ``raw_tcp_shared_efficiency_K`` sharing the bytes; ``push_efficiency_K`` the
product's push over K streams after the first round; ``first_...`` the best of the first
rounds. Without root or ``/dev/net/tun`` it prints why and ends with ``skipped=...``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from bench import streams_isthmus
from bench.progress import steps
from bench.wan_link import WanLink, WanLinkUnavailable, check_available

PORT = 5201
CEILING_MIB = 512
TCP_IP_HEADERS = 52  # bytes of each packet that are not payload: IPv4, TCP, timestamps


def _delta(after: dict, before: dict, key: str) -> int:
    return after[key] - before[key]


def raw_tcp(link: WanLink, streams: int, total: int, port: int, shared: bool = False) -> dict:
    """``total`` bytes from a to b over ``streams`` connections, in equal shares or (``shared``)
    from one pool: seconds, drops, retransmits, the relay's CPU."""
    before, counters, cpu = link.stats(), link.tcp_counters("a"), link.relay_cpu_s()
    args = (link.addr_b, port, streams, total, shared)
    sink = link.start_call("b", "bench.streams_tcp:sink", *args)
    sent = link.call_in("a", "bench.streams_tcp:send", *args)
    got = link.finish_call(sink)
    cpu = (link.relay_cpu_s() - cpu) / sent["elapsed_s"]
    if got["bytes"] != total or not all(s["receipt"] for s in sent["streams"]):
        raise RuntimeError(f"raw TCP lost bytes: {got['bytes']} of {total} arrived")
    after = link.stats()
    a, b = after["a_to_b"], before["a_to_b"]
    ends = [s["end"] for s in sent["streams"]]
    packets = sum(_delta(after[d], before[d], "packets_out") for d in ("a_to_b", "b_to_a"))
    return {
        "seconds": sent["elapsed_s"],
        "bytes": total,
        "dropped": _delta(a, b, "dropped"),
        "retrans": _delta(link.tcp_counters("a"), counters, "RetransSegs"),
        "rtt_s": sent["connect_s"],
        "congestion": sent["congestion"],
        "packets_per_s": packets / sent["elapsed_s"],
        "relay_cpu": cpu,  # of one core, over the transfer (setup and teardown included)
        # Streams of equal shares that end far apart leave the link to the last one.
        "spread_s": max(ends) - min(ends),
        "streams": streams,
    }


def isthmus(
    link: WanLink, folder: Path, mib: float, rounds: int, streams: list[int]
) -> dict[tuple[str, int], list[dict]]:
    """The product's fetch and push over each of ``streams``, with the job's drops:
    ``{("fetch", K): runs, ("push", K): runs}``."""
    before = link.stats()
    counters = {s: link.tcp_counters(s) for s in "ab"}
    timings = streams_isthmus.run(link, folder, mib, rounds, streams)
    after = link.stats()
    runs = {(kind, int(k)): v for kind in timings for k, v in timings[kind].items()}
    out = {}
    # Fetch data flows b -> a and push data a -> b: each direction's drops belong to one kind
    # (summed over the kind's runs: the counters are read once around the whole job).
    for key, timed in runs.items():
        direction, sender = ("b_to_a", "b") if key[0] == "fetch" else ("a_to_b", "a")
        dropped = _delta(after[direction], before[direction], "dropped")
        retrans = _delta(link.tcp_counters(sender), counters[sender], "RetransSegs")
        timed = [
            {"seconds": s, "bytes": n, "dropped": dropped, "retrans": retrans} for s, n in timed
        ]
        # A job's first round opens its connections; every later one runs on them (kept).
        out[(f"{key[0]}-first", key[1])], out[key] = timed[:1], timed[1:] or timed[:1]
    return out


def summary(runs: list[dict], rate_bps: float) -> dict:
    """Median seconds of ``runs`` and the figures derived from it."""
    seconds = statistics.median(r["seconds"] for r in runs)
    size = runs[0]["bytes"]
    effs = [r["bytes"] * 8 / (r["seconds"] * rate_bps) for r in runs]
    return {
        "seconds": seconds,
        "mib": size / 2**20,
        "mbit": size * 8 / seconds / 1e6,
        "efficiency": size * 8 / (seconds * rate_bps),
        "range": (min(effs), max(effs)),
        "dropped": statistics.median(r["dropped"] for r in runs),
        "retrans": statistics.median(r["retrans"] for r in runs),
        "spread_s": statistics.median(r["spread_s"] for r in runs)
        if "spread_s" in runs[0]
        else None,
    }


def _raw(key) -> bool:
    """Whether a row of ``measure`` is raw TCP's: K (equal shares) or ("shared", K)."""
    return isinstance(key, int) or key[0] == "shared"


def _row(name: str, streams: int, s: dict) -> str:
    lo, hi = s["range"]
    spread = "-" if s["spread_s"] is None else f"{s['spread_s']:.3f}"
    return (
        f"{name:<26}{streams:>7}{s['mib']:>7.1f}{s['seconds']:>9.3f}{s['mbit']:>8.1f}"
        f"{s['efficiency']:>12.3f}   {lo:.3f}-{hi:.3f}{s['dropped']:>9.0f}{s['retrans']:>9.0f}"
        f"{spread:>10}"
    )


def header(args, link: WanLink, raw: list[dict], relay: dict) -> list[str]:
    """What the link was, in a few lines above the table (``raw``: every raw TCP run,
    ``relay``: the relay's counters after them)."""
    rate, rtt = args.rate_mbit * 1e6, 2 * args.delay_ms / 1e3
    rtt_s, congestion = min(r["rtt_s"] for r in raw), raw[0]["congestion"]
    # The rate carries whole IP packets: each holds MTU - 52 bytes of payload (IP, TCP and
    # its timestamp option), so even a perfect transfer gets that share of the rate.
    payload_share = (link.mtu - TCP_IP_HEADERS) / link.mtu
    ideal = args.mib * 2**23 / rate / payload_share
    one = [r["relay_cpu"] for r in raw if r["streams"] == 1]
    late = sum(relay[d]["late_over_1ms"] for d in ("a_to_b", "b_to_a"))
    out = sum(relay[d]["packets_out"] for d in ("a_to_b", "b_to_a"))
    return [
        f"link: {args.delay_ms:g} ms each way (RTT {rtt * 1e3:g} ms; TCP handshake measured "
        f"{rtt_s * 1e3:.1f} ms), {args.rate_mbit:g} Mbit/s each way",
        f"bottleneck: {link.queue_bytes / 1024:.0f} KiB FIFO per direction "
        f"({link.queue_bytes / link.bdp_bytes:.2f} BDP), tail drop; MTU {link.mtu}; "
        f"relay {link.relay_priority}",
        f"TCP in both namespaces: {congestion}, tcp_rmem {link.tcp_rmem}, tcp_wmem {link.tcp_wmem}"
        f", tcp_slow_start_after_idle {int(link.slow_start_after_idle)}",
        f"ideal for {args.mib:g} MiB: packets / rate + 1 RTT = {ideal + rtt:.3f} s, "
        f"efficiency {ideal * payload_share / (ideal + rtt):.3f} ({payload_share:.3f} of "
        f"the rate is payload in {link.mtu}-byte packets)",
        f"relay: {statistics.median(one) if one else 0:.0%} of one core for 1 raw TCP "
        f"stream; {late} of {out} packets written over 1 ms after they were due (latest "
        f"{max(relay[d]['late_max_ms'] for d in ('a_to_b', 'b_to_a')):.1f} ms)",
        f"each row: median of {args.repeats} run(s), min-max of efficiency beside it; "
        "efficiency = bytes / (seconds * rate)",
        "dropped: at the bottleneck; retrans: the sender's TCP; spread: the last stream's end "
        "minus the first's;",
        "for isthmus, dropped and retrans count the whole job's traffic in that direction "
        "(every K)",
    ]


def report(args, lines: list[str], rows: dict, ceiling: dict[int, dict]) -> str:
    """Print the table; return the closing ``key=value`` line."""
    rate = args.rate_mbit * 1e6
    raw = {k: summary(v, rate) for k, v in rows.items() if isinstance(k, int)}
    shared = {k[1]: summary(v, rate) for k, v in rows.items() if not isinstance(k, int) and _raw(k)}
    print("\n" + "\n".join(lines) + "\n")
    print(
        f"{'transfer':<26}{'streams':>7}{'MiB':>7}{'seconds':>9}{'Mbit/s':>8}{'efficiency':>12}"
        f"   {'min-max':<11}{'dropped':>9}{'retrans':>9}{'spread s':>10}"
    )
    for k, s in raw.items():
        print(_row("raw TCP, K streams", k, s))
    for k, s in shared.items():
        print(_row("raw TCP, K sharing bytes", k, s))
    labels = {
        "fetch-first": "isthmus fetch, 1st round",
        "fetch": "isthmus fetch, later",
        "push-first": "isthmus push, 1st round",
        "push": "isthmus push, later",
    }
    product = {
        key: summary(runs, rate)
        for key, runs in rows.items()
        if isinstance(key, tuple) and key[0] in labels
    }
    for (kind, k), s in sorted(product.items()):
        print(_row(labels[kind], k, s))
    print("\nrelay ceiling (0 ms, no rate cap, the same relay and MTU):")
    top = 0.0
    for k, runs in ceiling.items():
        s = summary(runs, rate)
        top = max(top, s["mbit"])
        pps = statistics.median(r["packets_per_s"] for r in runs)
        print(f"  {k} stream(s): {s['mbit']:.0f} Mbit/s, {pps:.0f} packets/s through the relay")
    idle = f"slow_start_after_idle={args.slow_start_after_idle}"
    return " ".join([*closing_keys(raw, shared, product), idle, f"relay_ceiling_mbit={top:.0f}"])


def closing_keys(
    raw: dict[int, dict], shared: dict[int, dict], product: dict[tuple[str, int], dict]
) -> list[str]:
    """The last line's figures: the product's fetch per K and its best, raw TCP per K (equal
    shares, then sharing one pool), the product's push per K and its best, the best of the
    product's first rounds."""
    keys = _per_k(product, "fetch", "efficiency", "")
    keys.append(f"raw_tcp_efficiency={raw[min(raw)]['efficiency']:.3f}")
    keys += [f"raw_tcp_efficiency_{k}={raw[k]['efficiency']:.3f}" for k in sorted(raw)]
    keys += [f"raw_tcp_shared_efficiency_{k}={shared[k]['efficiency']:.3f}" for k in sorted(shared)]
    keys += _per_k(product, "push", "push_efficiency", "push_")
    firsts = {"fetch-first": "first_efficiency_best", "push-first": "first_push_efficiency_best"}
    for kind, name in firsts.items():
        effs = [s["efficiency"] for (what, _), s in product.items() if what == kind]
        keys += [f"{name}={max(effs):.3f}"] if effs else []
    return keys


def _per_k(product: dict, kind: str, name: str, prefix: str) -> list[str]:
    effs = {k: s["efficiency"] for (what, k), s in product.items() if what == kind}
    keys = [f"{name}_{k}={effs[k]:.3f}" for k in sorted(effs)]
    if effs:
        best = max(effs, key=effs.get)
        keys += [f"{name}_best={effs[best]:.3f}", f"{prefix}best_streams={best}"]
    return keys


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.streams", description=__doc__.split("\n")[0])
    p.add_argument("--delay-ms", type=float, default=40.0, help="one-way delay, each direction")
    p.add_argument("--rate-mbit", type=float, default=200.0, help="bottleneck rate")
    p.add_argument("--mib", type=float, default=64.0, help="payload per transfer")
    p.add_argument("--streams", default="1,2,4,8", help="stream counts, raw TCP and fetch")
    p.add_argument("--queue-kib", type=float, help="bottleneck queue (default: 1 BDP)")
    p.add_argument("--repeats", type=int, default=3, help="runs per row (the median is shown)")
    p.add_argument("--mtu", type=int, default=1500)
    p.add_argument("--congestion", default="cubic", help="TCP congestion control on the link")
    p.add_argument(
        "--slow-start-after-idle",
        type=int,
        choices=(0, 1),
        default=0,
        help="net.ipv4.tcp_slow_start_after_idle in both namespaces (0: a tuned WAN host; "
        "1: Linux's default)",
    )
    p.add_argument("--no-isthmus", action="store_true", help="raw TCP only")
    p.add_argument("--keep", type=Path, help="keep the coordinator's folder here")
    return p.parse_args(argv)


def measure(link: WanLink, args, folder: Path) -> tuple[list[str], dict, dict]:
    """Every run of the plan on ``link``: the header lines, the rows and the ceiling runs."""
    total = int(args.mib * 2**20)
    counts = [int(k) for k in args.streams.split(",")]
    plan = [(kind, k) for k in counts for kind in ("tcp", "shared") if kind == "tcp" or k > 1]
    plan *= args.repeats  # interleaved
    plan += [] if args.no_isthmus else [("isthmus", args.repeats)]
    streams = [int(k) for k in args.streams.split(",")]
    plan += [("ceiling", 1), ("ceiling", 4)]
    names = {"tcp": "raw TCP, {} stream(s)", "isthmus": "isthmus: {} fetch + push round(s) a K"}
    names["shared"] = "raw TCP, {} stream(s) sharing the bytes"
    names["ceiling"] = "relay ceiling (no delay, no cap), {} stream(s)"
    rows: dict = {}
    ceiling: dict[int, list[dict]] = {}
    lines: list[str] = []
    for i, (kind, n) in enumerate(steps(plan, lambda r: names[r[0]].format(r[1]))):
        if kind == "tcp":
            rows.setdefault(n, []).append(raw_tcp(link, n, total, PORT + i))
        elif kind == "shared":
            rows.setdefault(("shared", n), []).append(raw_tcp(link, n, total, PORT + i, True))
        elif kind == "isthmus":
            rows.update(isthmus(link, folder / "isthmus", args.mib, n, streams))
        else:
            if not lines:  # the link as it was, before the relay is uncapped
                raw = [r for k, v in rows.items() if _raw(k) for r in v]
                lines = header(args, link, raw, link.stats())
                link.configure(0.0, None)
            ceiling[n] = [raw_tcp(link, n, CEILING_MIB << 20, PORT + i)]
    return lines, rows, ceiling


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    try:
        check_available()
    except WanLinkUnavailable as exc:
        print(f"bench.streams skipped: {exc}")
        print(f"skipped={exc.code}")
        return 0
    queue = int(args.queue_kib * 1024) if args.queue_kib else None
    delay = args.delay_ms / 1e3
    idle = bool(args.slow_start_after_idle)
    link = WanLink(
        delay,
        args.rate_mbit,
        queue,
        mtu=args.mtu,
        congestion=args.congestion,
        slow_start_after_idle=idle,
    )
    with tempfile.TemporaryDirectory(prefix="isthmus-streams-") as tmp, link:
        lines, rows, ceiling = measure(link, args, args.keep or Path(tmp))
    print(report(args, lines, rows, ceiling))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
