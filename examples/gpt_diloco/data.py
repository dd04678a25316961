"""A real byte-level text corpus (the Python standard library's own sources) and its data order.

Every ``.py`` file under ``sysconfig.get_paths()["stdlib"]`` is read in sorted order (skipping
``site-packages``, test suites and IDLE) until ``max_bytes`` is reached; each byte is one token.
A file belongs to the validation split when a hash of its relative path falls below
``val_fraction``, so the split never changes with the cap, the seed or the number of sites.

Training batches are a pure function of their coordinates, with no global RNG. Federated mode
(:meth:`Corpus.site_batch`), where each site reads only its own data:

* the training tokens are cut into ``num_sites`` contiguous, disjoint shards, one per site;
* a site's batch for ``(round, inner_step)`` is ``batch_size`` non-overlapping windows of its
  shard, drawn with a ``torch.Generator`` seeded from those numbers.

Shared-data mode (:meth:`Corpus.unit_batch`), where the coordinator hands out units ``u<k>`` of
one data stream and any site may train any unit: unit ``k`` is a fixed stretch of a stream that
runs through the whole training split epoch after epoch (``shared_stream``), so the same unit
gives the same batches at whichever site trains it.

Either way, rank ``r`` of a site's ``world_size`` trainers gets the ``r``-th part of the batch
(``torch.tensor_split``). The batch does not depend on ``world_size``, so a site that restarts
with a different number of trainers keeps reading the same data.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from examples.gpt_diloco.model import lm_loss
from examples.gpt_diloco.shared_stream import SharedStream

_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}
)
# Files are joined with a blank line so no window runs two files' lines together.
_SEPARATOR = b"\n\n"
Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class CorpusConfig:
    """What to read and the defaults for batching.

    Attributes
    ----------
    max_bytes
        Cap on the bytes read (train and validation together); 8 MiB loads in ~0.1 s.
    val_fraction
        Expected fraction of files held out for validation.
    seq_len
        Default window length (inputs and targets are both ``seq_len`` long).
    seed
        Default seed of the training data order.
    root
        Directory to read instead of the standard library (for tests); ``None`` for stdlib.
    """

    max_bytes: int = 8 * 2**20
    val_fraction: float = 0.05
    seq_len: int = 128
    seed: int = 0
    root: str | None = None

    def __post_init__(self) -> None:
        if self.max_bytes <= 0:
            raise ValueError(f"CorpusConfig.max_bytes must be positive, got {self.max_bytes}")
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(
                f"CorpusConfig.val_fraction must be in (0, 1), got {self.val_fraction}"
            )
        if self.seq_len <= 0:
            raise ValueError(f"CorpusConfig.seq_len must be positive, got {self.seq_len}")


def _unit_hash(*parts: object) -> int:
    digest = hashlib.sha256(",".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _is_validation(relpath: str, val_fraction: float) -> bool:
    return _unit_hash("split", relpath) / 2**63 < val_fraction


class Corpus:
    """Byte tokens of the training and validation files (uint8 tensors) and their file lists."""

    def __init__(self, config: CorpusConfig) -> None:
        self.config = config
        root = Path(config.root or sysconfig.get_paths()["stdlib"])
        parts: dict[bool, list[bytes]] = {False: [], True: []}
        files: dict[bool, list[str]] = {False: [], True: []}
        budget = config.max_bytes
        for dirpath, dirnames, filenames in os.walk(root):
            # Sorting in place fixes the walk order; os.walk's own order is the filesystem's.
            dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
            for name in sorted(filenames):
                if budget <= 0:
                    break
                if not name.endswith(".py"):
                    continue
                path = Path(dirpath) / name
                data = path.read_bytes()[:budget]
                rel = path.relative_to(root).as_posix()
                held_out = _is_validation(rel, config.val_fraction)
                parts[held_out].append(data + _SEPARATOR)
                files[held_out].append(rel)
                budget -= len(data)
            if budget <= 0:
                break
        if not parts[False] or not parts[True]:
            raise ValueError(
                f"corpus under {root} has {len(files[False])} training and {len(files[True])} "
                "validation files; raise max_bytes or val_fraction"
            )
        self.train = torch.frombuffer(bytearray(b"".join(parts[False])), dtype=torch.uint8)
        self.val = torch.frombuffer(bytearray(b"".join(parts[True])), dtype=torch.uint8)
        self.train_files: tuple[str, ...] = tuple(files[False])
        self.val_files: tuple[str, ...] = tuple(files[True])
        self.root = root

    @property
    def fingerprint(self) -> str:
        """SHA-256 (12 hex digits) of the corpus bytes: the same on two machines only when
        their Python installations carry the same standard library sources."""
        digest = hashlib.sha256(self.train.numpy().tobytes())
        digest.update(self.val.numpy().tobytes())
        return digest.hexdigest()[:12]

    def site_batch(
        self,
        site_index: int,
        num_sites: int,
        round: int,
        inner_step: int,
        local_rank: int,
        world_size: int,
        batch_size: int,
        seq_len: int | None = None,
        seed: int | None = None,
    ) -> Batch:
        """This rank's part of a site's training batch; the same arguments give the same tensors.

        Parameters
        ----------
        site_index, num_sites
            Which of the disjoint training shards to read.
        round, inner_step
            Position in training; every pair gives a fresh draw.
        local_rank, world_size
            This trainer within its site; rank ``r`` gets ``tensor_split(batch, world_size)[r]``.
        batch_size
            Rows in the whole site's batch (at least ``world_size``).
        seq_len, seed
            Default to the corpus config's.

        Returns
        -------
        inputs, targets
            LongTensors of shape ``(rows, seq_len)``; ``targets`` is ``inputs`` shifted by one.
        """
        seq_len = self.config.seq_len if seq_len is None else seq_len
        starts = self.site_window_starts(
            site_index,
            num_sites,
            round,
            inner_step,
            local_rank,
            world_size,
            batch_size,
            seq_len,
            seed,
        )
        return self._windows(self.train, starts, seq_len)

    def site_window_starts(
        self,
        site_index: int,
        num_sites: int,
        round: int,
        inner_step: int,
        local_rank: int,
        world_size: int,
        batch_size: int,
        seq_len: int | None = None,
        seed: int | None = None,
    ) -> torch.Tensor:
        """Offsets into ``train`` of the windows :meth:`site_batch` returns (same arguments)."""
        seq_len = self.config.seq_len if seq_len is None else seq_len
        seed = self.config.seed if seed is None else seed
        if not 0 <= site_index < num_sites:
            raise ValueError(f"site_index {site_index} not in [0, {num_sites})")
        if not 0 <= local_rank < world_size:
            raise ValueError(f"local_rank {local_rank} not in [0, {world_size})")
        if batch_size < world_size:
            raise ValueError(f"batch_size {batch_size} leaves some of {world_size} ranks no rows")
        shard_len = len(self.train) // num_sites
        window = seq_len + 1
        gen = torch.Generator().manual_seed(
            _unit_hash("train", seed, site_index, num_sites, round, inner_step, batch_size, seq_len)
        )
        # A random phase keeps windows from always starting at the same byte offsets.
        offset = int(torch.randint(window, (1,), generator=gen))
        n_windows = (shard_len - offset) // window
        if n_windows < batch_size:
            raise ValueError(
                f"site shard of {shard_len} tokens holds {n_windows} windows of {window}, "
                f"fewer than batch_size {batch_size}"
            )
        chosen = torch.randperm(n_windows, generator=gen)[:batch_size]
        starts = site_index * shard_len + offset + chosen * window
        return torch.tensor_split(starts, world_size)[local_rank]

    def unit_batch(
        self,
        unit_index: int,
        inner_step: int,
        steps_per_unit: int,
        local_rank: int,
        world_size: int,
        batch_size: int,
        seq_len: int | None = None,
        seed: int | None = None,
    ) -> Batch:
        """This rank's part of the batch of ``inner_step`` of shared data unit ``unit_index``.

        Parameters
        ----------
        unit_index
            ``k`` of unit ``"u<k>"`` (``Round.data_unit_index``).
        inner_step, steps_per_unit
            Position within the unit, and H: the unit's length in inner steps. Every site
            must use the same H, or units would overlap.
        local_rank, world_size
            This trainer within its site; rank ``r`` gets ``tensor_split(batch, world_size)[r]``.
        batch_size
            Rows in the whole site's batch (at least ``world_size``).
        seq_len, seed
            Default to the corpus config's.

        Returns
        -------
        inputs, targets
            LongTensors of shape ``(rows, seq_len)``; ``targets`` is ``inputs`` shifted by one.
        """
        seq_len = self.config.seq_len if seq_len is None else seq_len
        seed = self.config.seed if seed is None else seed
        if not 0 <= local_rank < world_size:
            raise ValueError(f"local_rank {local_rank} not in [0, {world_size})")
        if batch_size < world_size:
            raise ValueError(f"batch_size {batch_size} leaves some of {world_size} ranks no rows")
        stream = self.shared_stream(seq_len, seed)
        starts = stream.window_starts(unit_index, inner_step, steps_per_unit, batch_size)
        return self._windows(
            self.train, torch.tensor_split(starts, world_size)[local_rank], seq_len
        )

    def shared_stream(self, seq_len: int | None = None, seed: int | None = None) -> SharedStream:
        """The shared-data stream over the training split (made once per ``seq_len, seed``)."""
        seq_len = self.config.seq_len if seq_len is None else seq_len
        seed = self.config.seed if seed is None else seed
        streams = self.__dict__.setdefault("_streams", {})
        if (seq_len, seed) not in streams:
            streams[seq_len, seed] = SharedStream(len(self.train), seq_len, seed)
        return streams[seq_len, seed]

    def validation_batches(
        self, n_batches: int, batch_size: int, seq_len: int | None = None
    ) -> list[Batch]:
        """``n_batches`` fixed validation batches, windows spread evenly over the held-out files."""
        seq_len = self.config.seq_len if seq_len is None else seq_len
        last_start = len(self.val) - (seq_len + 1)
        if last_start < 0:
            raise ValueError(f"validation split ({len(self.val)} tokens) is shorter than a window")
        starts = torch.linspace(0, last_start, n_batches * batch_size).long()
        return [self._windows(self.val, s, seq_len) for s in starts.split(batch_size)]

    @staticmethod
    def _windows(tokens: torch.Tensor, starts: torch.Tensor, seq_len: int) -> Batch:
        rows = tokens[starts[:, None] + torch.arange(seq_len + 1)].long()
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


_READ: dict[tuple[str | None, int, float], Corpus] = {}
_CACHE: dict[CorpusConfig, Corpus] = {}


def load_corpus(config: CorpusConfig | None = None) -> Corpus:
    """The corpus for ``config``, read once per process and then served from a cache.

    Files are read once per (root, cap, split); ``seq_len`` and ``seed`` are only batching
    defaults, so configs differing in them share the token tensors.
    """
    config = config or CorpusConfig()
    cached = _CACHE.get(config)
    if cached is None:
        key = (config.root, config.max_bytes, config.val_fraction)
        read = _READ.get(key)
        if read is None:
            cached = _READ[key] = Corpus(config)
        else:
            cached = Corpus.__new__(Corpus)
            cached.__dict__.update(read.__dict__, config=config)
        _CACHE[config] = cached
    return cached


@torch.no_grad()
def evaluate(
    model: nn.Module, corpus: Corpus, n_batches: int, batch_size: int, seq_len: int | None = None
) -> float:
    """Mean validation loss of ``model`` over ``corpus.validation_batches(...)``.

    The model is put in eval mode for the duration and returned to its previous mode. Under FSDP
    every rank of a site must call this (the forward passes are collective); all get the same
    value.
    """
    if seq_len is None:
        seq_len = getattr(getattr(model, "config", None), "seq_len", None) or corpus.config.seq_len
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        total = 0.0
        batches = corpus.validation_batches(n_batches, batch_size, seq_len)
        for inputs, targets in batches:
            total += float(lm_loss(model(inputs.to(device)), targets.to(device)))
        return total / len(batches)
    finally:
        model.train(was_training)
