"""Codec throughput, compression ratio and error on one large pseudo-gradient-like tensor.

Run ``python -m bench.codec [--numel N] [--repeat R]``. The input is ``N(0, 1e-3)`` float32
(default 64M elements, 256 MiB). Speeds are reported relative to a ``copy_`` of the same bytes
into a preallocated buffer, measured in the same run, because absolute speeds on a shared machine
swing by +-30 %. Each time is the best of ``--repeat`` runs. Encoding of ``int4`` and ``topk``
includes their error feedback (the residual is updated in place); decoding is ``decode_into`` a
preallocated float32 accumulator. The ratio counts data and meta; the relative error is
``||x - dec(enc(x))|| / ||x||`` for one encode from a zero residual.

The last line holds the figures as ``key=value`` pairs (``<codec>_ratio``, ``<codec>_relerr``,
``<codec>_encode_vs_memcpy``, ``<codec>_decode_vs_memcpy``, ``memcpy_gbps``, and
``topk_speedup_vs_torch_topk``: a full ``torch.topk`` of the same k, timed once, over the top-k
encode).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from wire.codecs import (
    Bf16Codec,
    Codec,
    Fp16Codec,
    Int4Codec,
    Int8Codec,
    NoneCodec,
    TensorState,
    TopKCodec,
    decode_into,
)

CODECS: list[tuple[str, Codec]] = [
    ("none", NoneCodec()),
    ("bf16", Bf16Codec()),
    ("fp16", Fp16Codec()),
    ("int8", Int8Codec(block=256, scale_dtype="fp16")),
    ("int4", Int4Codec(block=64, scale_dtype="fp16")),
    ("topk", TopKCodec(fraction=0.01, values="fp16", indices="varint")),
    ("topk_i32", TopKCodec(fraction=0.01, values="fp32", indices="int32")),
]


def best_time(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure(label: str, codec: Codec, x: torch.Tensor, repeat: int) -> dict[str, float]:
    state = TensorState() if codec.error_feedback else None
    enc = codec.encode(x, state, name=label)  # zero residual: the one-shot error
    acc = torch.zeros_like(x)
    decode_into(acc, enc.data, enc.meta, codec=enc.codec)
    relerr = float((x - acc).norm() / x.norm())
    t_enc = best_time(lambda: codec.encode(x, state, name=label), repeat)
    t_dec = best_time(lambda: decode_into(acc, enc.data, enc.meta, 1e-3), repeat)
    if isinstance(codec, TopKCodec) and codec.indices == "varint":
        # The reference the sampled threshold replaces: one full torch.topk (slow, once).
        k = codec.k_for(x.numel())
        t_full = best_time(lambda: torch.topk(x.abs(), k, sorted=False), 1)
        extra = {"t_torch_topk": t_full}
    else:
        extra = {}
    return {
        **extra,
        "ratio": x.numel() * 4 / enc.nbytes,
        "relerr": relerr,
        "t_enc": t_enc,
        "t_dec": t_dec,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.codec", description=__doc__)
    parser.add_argument("--numel", type=int, default=64 << 20, help="elements (default 64M)")
    parser.add_argument("--repeat", type=int, default=7, help="runs per timing (best is kept)")
    parser.add_argument("--only", nargs="*", help="codec labels to run (default: all)")
    args = parser.parse_args(argv)
    if args.numel < 1 or args.repeat < 1:
        parser.error("--numel and --repeat must be >= 1")

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.numel, generator=gen).mul_(1e-3)
    buf = torch.empty_like(x)
    nbytes = x.numel() * 4
    t_copy = best_time(lambda: buf.copy_(x), args.repeat + 2)
    results = {}
    for label, codec in CODECS:
        if args.only and label not in args.only:
            continue
        results[label] = measure(label, codec, x, args.repeat)
    # Again at the end: the reference must see the same machine load as the codecs did.
    t_copy = min(t_copy, best_time(lambda: buf.copy_(x), args.repeat + 2))

    print(
        f"{args.numel} float32 elements ({nbytes / 2**20:.0f} MiB), N(0, 1e-3); best of "
        f"{args.repeat}; memcpy {nbytes / t_copy / 1e9:.1f} GB/s"
    )
    head = (
        f"{'codec':<9} {'ratio':>7} {'rel.err':>9} {'enc GB/s':>9} {'enc/memcpy':>11} "
        f"{'dec GB/s':>9} {'dec/memcpy':>11}"
    )
    print(head)
    print("-" * len(head))
    figures = {"memcpy_gbps": f"{nbytes / t_copy / 1e9:.2f}"}
    notes = []
    for label, r in results.items():
        enc_rel, dec_rel = t_copy / r["t_enc"], t_copy / r["t_dec"]
        print(
            f"{label:<9} {r['ratio']:>7.2f} {r['relerr']:>9.2e} {nbytes / r['t_enc'] / 1e9:>9.2f}"
            f" {enc_rel:>11.3f} {nbytes / r['t_dec'] / 1e9:>9.2f} {dec_rel:>11.3f}"
        )
        figures[f"{label}_ratio"] = f"{r['ratio']:.2f}"
        figures[f"{label}_relerr"] = f"{r['relerr']:.3g}"
        figures[f"{label}_encode_vs_memcpy"] = f"{enc_rel:.3f}"
        figures[f"{label}_decode_vs_memcpy"] = f"{dec_rel:.3f}"
        if "t_torch_topk" in r:
            speedup = r["t_torch_topk"] / r["t_enc"]
            notes.append(
                f"{label}: a full torch.topk of the same k takes {r['t_torch_topk']:.2f} s, "
                f"{speedup:.1f}x the encode"
            )
            figures[f"{label}_speedup_vs_torch_topk"] = f"{speedup:.1f}"
    for note in notes:
        print(note)
    print(" ".join(f"{k}={v}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
