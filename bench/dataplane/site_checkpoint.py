"""A site's checkpoint of a task's end, written over the spare files or into new ones.

::

    python -m bench.dataplane.site_checkpoint [--size 50m] [--writes 7] [--pause 3]

The optimiser state of the benchmarks' residual stack after an AdamW step (twice the model:
403 MB at 50 M parameters) is written as the trainer writes it at each task's end
(``write_staged`` without the model, fsynced, BLAKE3 manifest) and pruned to two, ``--writes``
times in each of two ways, alternated: **spare**, as the product does, where pruning keeps the
newest pruned checkpoint's files and the next write goes over them in place
(``site_client.checkpoint.spare``), and **new files**, where the spare is removed before each
write, so every byte goes into new page-cache pages, as before. ``--pause`` seconds pass before
each write, as a round's training would, in which memory freed by the pruning can go back to
the host. The first three writes of each way are a warm-up (a spare exists from the fourth).
Wall and CPU seconds (user + system, this process's own counters) per write; last line::

    spare_wall_s=... spare_cpu_s=... new_files_wall_s=... new_files_cpu_s=...
    new_files_over_spare_cpu=...

(one line).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.sync import SIZES, residual_stack
from site_client.checkpoint.local import prune_site_checkpoints, stage_state, write_staged
from site_client.checkpoint.spare import SPARE

WAYS = ("spare", "new files")
WARM_UP = 3  # two checkpoints kept: the third write's pruning makes the first spare


def _state(size: str):
    width, depth = SIZES[size]
    model = residual_stack(width, depth)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()
    return stage_state(model, optimizer, copy=False, with_model=False)


def _write(folder: Path, way: str, n: int, staged, pause_s: float) -> tuple[float, float]:
    if way == "new files":
        shutil.rmtree(folder / SPARE, ignore_errors=True)
    time.sleep(pause_s)
    started, before = time.perf_counter(), os.times()
    write_staged(folder / f"ckpt-{n:04d}", staged, {"round": n, "step": 4})
    after = os.times()
    prune_site_checkpoints(folder, keep_last=2)
    cpu = after.user - before.user + after.system - before.system
    return time.perf_counter() - started, cpu


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.dataplane.site_checkpoint")
    p.add_argument("--size", default="50m", choices=sorted(SIZES))
    p.add_argument("--writes", type=int, default=7, help="per way, the first three a warm-up")
    p.add_argument("--pause", type=float, default=3.0, help="seconds before each write")
    args = p.parse_args(argv)
    staged = _state(args.size)
    slots = staged.state["optim"]["state"].values()  # per parameter: step, exp_avg, exp_avg_sq
    nbytes = sum(t.numel() * t.element_size() for slot in slots for t in slot.values())
    results: dict[str, list[tuple[float, float]]] = {way: [] for way in WAYS}
    root = Path(tempfile.mkdtemp(prefix="isthmus-site-ckpt-", dir=os.getcwd()))
    try:
        folders = {way: root / way.replace(" ", "-") for way in WAYS}
        for n in range(args.writes):
            for way in WAYS:  # alternated, so both see the same machine
                results[way].append(_write(folders[way], way, n, staged, args.pause))
                print(f"[{n + 1}/{args.writes}] {way}: {results[way][-1][0]:.3f} s", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\n{args.size}: optimiser state {nbytes / 1e6:.0f} MB per checkpoint, fsynced")
    print(f"{'way':<10} {'wall s (median)':>16} {'CPU s (median)':>15}  each write's CPU s")
    figures = {}
    for way in WAYS:
        measured = results[way][WARM_UP:] or results[way]
        wall = statistics.median(w for w, _ in measured)
        cpu = statistics.median(c for _, c in measured)
        figures[way.replace(" ", "_")] = (wall, cpu)
        each = " ".join(f"{c:.2f}" for _, c in results[way])
        print(f"{way:<10} {wall:>16.3f} {cpu:>15.3f}  {each}")
    (sw, sc), (nw, nc) = figures["spare"], figures["new_files"]
    print(
        f"spare_wall_s={sw:.3f} spare_cpu_s={sc:.3f} new_files_wall_s={nw:.3f} "
        f"new_files_cpu_s={nc:.3f} new_files_over_spare_cpu={nc / max(sc, 1e-9):.2f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
