"""The round's fold on one or several cores: spooled updates summed by 1, 2, ... fold lanes.

::

    python -m bench.fold [--params 50m] [--updates 4] [--lanes 1,2] [--torch-threads 1,0]
                         [--repeats 3]

The coordinator folds each counted update into the round's running sum
(``coordinator.round.accumulate``); fold lanes (``[server] fold_lanes``,
``coordinator.round.fold_lanes``) split that work by tensor over several threads. Here the
same code folds ``--updates`` updates of a GPT-shaped model (embedding, then blocks of
attention and MLP weights and their norms), spooled to files as the coordinator spools them,
with each number of lanes in turn, raw float32 and int8-encoded, and each setting of torch's
own intra-op threads (``--torch-threads``: 1, as the benches' coordinators run, and 0 for
torch's default, one per core, as a coordinator runs by default). Figures per run: the wall
time of the whole fold (first offer to the mean), GB of float32 update folded per wall second,
and the process's CPU seconds (user + system, every thread) per GB. Each figure is the median
of ``--repeats`` runs; the sum's buffer is kept and zeroed in place between runs as the
coordinator keeps it (``round.spare_buffer``). Every run's sum is checked bit for bit against
the one lane's.

Last line::

    fold_gb_per_s_fp32_t1_l1=... fold_cpu_s_per_gb_fp32_t1_l1=... fold_speedup_fp32_t1_l2=...
    ... (for each codec, torch threads tN and lanes lK) cores=...
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from bench.progress import steps
from coordinator.intake.spool import UpdateSpool
from coordinator.records import UpdateKey
from coordinator.round.accumulate import start_sum
from coordinator.round.fold_lanes import FoldLanes
from coordinator.round.spare_buffer import SpareBuffer
from wire.codecs import CodecState
from wire.codecs.rules import CompressionConfig
from wire.tensors import pack, pack_encoded
from wire.theta import ThetaBuffer

SIZES = {"5m": (256, 6, 4096), "50m": (512, 16, 8192), "200m": (1024, 16, 16384)}


def gpt_shapes(d: int, layers: int, vocab: int) -> dict[str, tuple[int, ...]]:
    """Tensor shapes of a GPT of width ``d``: about ``12 d^2`` per block plus the embedding."""
    shapes: dict[str, tuple[int, ...]] = {"emb.weight": (vocab, d), "ln_f.weight": (d,)}
    for i in range(layers):
        p = f"blocks.{i:02d}."
        shapes |= {
            p + "ln1.weight": (d,),
            p + "attn.qkv.weight": (3 * d, d),
            p + "attn.proj.weight": (d, d),
            p + "ln2.weight": (d,),
            p + "mlp.up.weight": (4 * d, d),
            p + "mlp.down.weight": (d, 4 * d),
        }
    return shapes


def spool_updates(folder: Path, shapes, count: int, codec: str):
    """``count`` updates of ``shapes`` spooled as the coordinator spools a received one."""
    spool, out = UpdateSpool(folder), []
    g = torch.Generator().manual_seed(7)
    cfg = CompressionConfig.from_dict({"default": codec})
    for i in range(count):
        delta = {n: torch.randn(s, generator=g) * 1e-3 for n, s in shapes.items()}
        manifest, payload = (
            pack(delta) if codec == "none" else pack_encoded(delta, cfg, CodecState())
        )
        site = f"site-{i}"
        with spool.open_part(0, site, "u") as f:
            f.write(bytes(payload))
        out.append(spool.commit(0, site, "u", manifest, 1.0 + i, key=UpdateKey(site)))
    return out


def fold_once(theta, updates, worker, lanes: FoldLanes, spare: SpareBuffer):
    """One round's fold; (wall s, CPU s, the mean's bits)."""
    slots = [u.key.site for u in updates]
    wall, cpu = time.perf_counter(), time.process_time()
    running = start_sum(theta, list(theta.tensors), worker, slots, spare, lanes)
    for u in updates:
        running.offer(u.key.site, u.key, u, u.weight)
    folded = running.finish([u.key for u in updates]).result()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    bits = {n: t.view(torch.int32).clone() for n, t in folded.mean.items()}
    buffer = running.buffer.buffer
    del folded, running
    spare.keep(buffer)  # as theta's file does once written: the next sum zeroes it in place
    return wall, cpu, bits


def measure(theta, updates, lane_counts, repeats: int, label: str) -> dict[int, dict]:
    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fold")
    gb = len(updates) * theta.manifest.total_bytes / 1e9
    results, reference = {}, None
    for k in steps(lane_counts, lambda k: f"{label}: {k} lane(s)"):
        lanes, spare = FoldLanes(k), SpareBuffer()
        try:
            fold_once(theta, updates, worker, lanes, spare)  # warm-up: the spare, the caches
            runs = [fold_once(theta, updates, worker, lanes, spare) for _ in range(repeats)]
        finally:
            lanes.shutdown()
        if reference is None:
            reference = runs[0][2]
        same = all(torch.equal(r[2][n], reference[n]) for r in runs for n in reference)
        wall = statistics.median(r[0] for r in runs)
        cpu = statistics.median(r[1] for r in runs)
        results[k] = {"wall": wall, "gbps": gb / wall, "cpu_per_gb": cpu / gb, "same": same}
    worker.shutdown()
    return results


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", choices=sorted(SIZES), default="50m")
    ap.add_argument("--updates", type=int, default=4)
    ap.add_argument("--lanes", default="1,2", help="comma-separated lane counts")
    ap.add_argument(
        "--torch-threads", default="1,0", help="torch intra-op threads to try (0: its default)"
    )
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    lane_counts = sorted({int(x) for x in args.lanes.split(",")})
    shapes = gpt_shapes(*SIZES[args.params])
    torch.manual_seed(0)
    theta = ThetaBuffer.copy_of({n: torch.randn(s) for n, s in shapes.items()})
    params = theta.manifest.total_bytes // 4
    cores = len(os.sched_getaffinity(0))
    print(
        f"fold of {args.updates} updates, {params / 1e6:.1f} M parameters in {len(shapes)} "
        f"tensors ({theta.manifest.total_bytes / 1e6:.0f} MB fp32 each), {cores} cores"
    )
    default_threads = torch.get_num_threads()
    table, figures = [], []
    with tempfile.TemporaryDirectory(prefix="bench-fold-") as tmp:
        for codec, label in (("none", "fp32"), ("int8", "int8")):
            updates = spool_updates(Path(tmp) / label, shapes, args.updates, codec)
            for asked in [int(x) for x in args.torch_threads.split(",")]:
                threads = asked or default_threads
                torch.set_num_threads(threads)
                name = f"{label} t{threads}"
                res = measure(theta, updates, lane_counts, args.repeats, name)
                base = res[lane_counts[0]]
                for k, r in res.items():
                    speedup = base["wall"] / r["wall"]
                    table.append((name, k, r, speedup))
                    tag = f"{label}_t{threads}_l{k}"
                    figures += [
                        f"fold_gb_per_s_{tag}={r['gbps']:.3f}",
                        f"fold_cpu_s_per_gb_{tag}={r['cpu_per_gb']:.3f}",
                    ]
                    if k != lane_counts[0]:
                        figures.append(f"fold_speedup_{tag}={speedup:.2f}")
    torch.set_num_threads(default_threads)
    print("\ncodec, torch threads   lanes   wall s    GB/s  CPU s/GB  speedup  same bits")
    for name, k, r, speedup in table:
        print(
            f"{name:21} {k:>6} {r['wall']:>8.3f} {r['gbps']:>7.2f} {r['cpu_per_gb']:>9.3f} "
            f"{speedup:>8.2f} {'yes' if r['same'] else 'NO':>10}"
        )
    print(" ".join(figures + [f"cores={cores}"]))


if __name__ == "__main__":
    main()
