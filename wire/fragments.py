"""Streaming outer steps: which tensors sync in which round, and how a site merges them.

With ``[streaming] fragments = P`` the parameters are split into P fragments that sync in
turn (Streaming DiLoCo, Douillard et al. 2025). Each coordinator round is one fragment's sync:
round r carries fragment ``r % P`` only and covers ``H / P`` inner steps, so each fragment
syncs every H steps (``rounds.inner_steps``) and ``rounds.total`` outer rounds are
``total * P`` coordinator rounds. A site sends round r's pseudo-gradient and trains on; it
merges the round's result ``delay_steps`` (tau) inner steps later, as
``theta_frag <- alpha * theta_local + (1 - alpha) * theta_global`` (``merge_alpha``)::

    [streaming]
    fragments = 4            # P; rounds.inner_steps % P == 0
    pattern = "strided"      # block b -> fragment b % P; "sequential": contiguous groups
    delay_steps = 2          # tau < rounds.inner_steps / P
    merge_alpha = 0.0        # 0: take the global fragment as it is
    merge = "blocking"       # "when_ready": merge at the first step from tau on it is there
    [[streaming.rules]]      # optional, first match wins: a tensor name -> a fragment
    match = "embed*"
    fragment = 0

A tensor's *block* is the first integer component of its dotted name (``blocks.3.attn.w`` is
in block 3). ``strided`` puts block b in fragment ``b % P``, ``sequential`` in
``b * P // blocks``; tensors without a block (embeddings, the head, final norms) go, largest
first, to whichever fragment holds the fewest elements so far. Everything here is a pure
function of the tensor names and shapes and the config, computed the same way by the
coordinator and by every site. ``fragments = 1, delay_steps = 0, merge_alpha = 0`` is plain
DiLoCo, bit for bit.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from wire.config_table import ConfigError, as_table, load_table, one_of, positive, rule, setting

PATTERNS = ("strided", "sequential")
MERGES = ("blocking", "when_ready")


@dataclass(frozen=True)
class FragmentRule:
    """One ``[[streaming.rules]]`` entry: tensors whose name matches go to ``fragment``."""

    match: str = setting(
        check=rule(bool, "must not be empty"),
        help="an fnmatch pattern on the tensor's name; the first rule that matches wins",
    )
    fragment: int = setting(
        check=rule(lambda v: v >= 0, "must be >= 0"),
        help="the fragment those tensors sync with (below ``streaming.fragments``)",
    )


@dataclass(frozen=True)
class StreamingConfig:
    """The ``[streaming]`` table (see the module docstring)."""

    fragments: int = setting(
        1,
        check=positive,
        help="P, the fragments that sync in turn, one per coordinator round "
        "(``rounds.inner_steps % P == 0``)",
    )
    pattern: str = setting(
        "strided",
        check=one_of(PATTERNS),
        help="``strided``: block b goes to fragment ``b % P``; ``sequential``: contiguous "
        "groups of blocks",
    )
    delay_steps: int = setting(
        0,
        check=rule(lambda v: v >= 0, "must be >= 0"),
        help="tau, the inner steps after sending a fragment at which its result is merged "
        "(``tau < rounds.inner_steps / P``)",
    )
    merge_alpha: float = setting(
        0.0,
        check=rule(lambda v: 0.0 <= v < 1.0, "must be in [0, 1) (1 would never merge)"),
        help="the merge keeps this much of the local model: ``theta_frag <- alpha * "
        "theta_local + (1 - alpha) * theta_global``",
    )
    merge: str = setting(
        "blocking",
        check=one_of(MERGES),
        help="``blocking``: a site waits at step tau for the round's result and merges it there "
        "(the same steps in every run); ``when_ready``: it trains on and merges the result at "
        "the first step from tau on at which it has arrived, waiting only before the task's "
        "last step, so a late round costs no idle time (the step of the merge then depends on "
        "timing: a run is not repeatable bit for bit)",
    )
    rules: list = setting(
        factory=list,
        help="``[[streaming.rules]]``, tensors to fragments by name before the pattern applies "
        "(see the next table)",
    )
    parsed_rules: tuple[FragmentRule, ...] = field(default=(), init=False)

    def __post_init__(self) -> None:
        parsed = []
        for i, entry in enumerate(self.rules):
            r = load_table(FragmentRule, entry, f"streaming.rules[{i}]")
            if r.fragment >= self.fragments:
                raise ConfigError(
                    f"streaming.rules[{i}].fragment: must be < streaming.fragments "
                    f"({self.fragments}), got {r.fragment}"
                )
            parsed.append(r)
        object.__setattr__(self, "parsed_rules", tuple(parsed))

    def check_steps(self, inner_steps: int) -> None:
        """H % P == 0 and tau < H / P, naming the keys."""
        p, tau = self.fragments, self.delay_steps
        if inner_steps % p:
            raise ConfigError(
                f"streaming.fragments: rounds.inner_steps ({inner_steps}) must be a multiple "
                f"of streaming.fragments ({p}), so that one fragment syncs every H/P steps"
            )
        if tau >= inner_steps // p:
            raise ConfigError(
                f"streaming.delay_steps: must be < rounds.inner_steps / streaming.fragments "
                f"({inner_steps} / {p} = {inner_steps // p}), got {tau}: a fragment's result "
                "must be merged before the next fragment is sent"
            )

    def fragment_of_round(self, round_number: int) -> int:
        return round_number % self.fragments


def streaming_from_job(job_config: Mapping[str, Any]) -> StreamingConfig | None:
    """The ``[streaming]`` table of a parsed job config, or None when it has none."""
    if "streaming" not in job_config:
        return None
    return load_table(StreamingConfig, as_table(job_config["streaming"], "streaming"), "streaming")


@dataclass(frozen=True)
class FragmentPlan:
    """The tensor names of each fragment (sorted), and which fragment a round syncs."""

    fragments: tuple[tuple[str, ...], ...]

    def names(self, round_number: int) -> tuple[str, ...]:
        return self.fragments[round_number % len(self.fragments)]

    def index_of(self, name: str) -> int:
        for i, names in enumerate(self.fragments):
            if name in names:
                return i
        raise KeyError(name)


def block_of(name: str) -> int | None:
    """The first integer component of a dotted tensor name (``layers.12.w`` -> 12)."""
    for part in name.split("."):
        if part.isdigit():
            return int(part)
    return None


def fragment_plan(shapes: Mapping[str, Sequence[int]], cfg: StreamingConfig) -> FragmentPlan:
    """Split the trainable tensors ``shapes`` (name -> shape) into ``cfg.fragments`` groups.

    Raises
    ------
    ConfigError
        A fragment would hold no tensor (more fragments than the model can be split into).
    """
    p = cfg.fragments
    groups: list[list[str]] = [[] for _ in range(p)]
    sizes = [0] * p
    loose: list[str] = []
    blocks = sorted({b for n in shapes if (b := block_of(n)) is not None})
    rank = {b: i for i, b in enumerate(blocks)}
    for name in sorted(shapes):
        chosen = next(
            (r.fragment for r in cfg.parsed_rules if fnmatch.fnmatchcase(name, r.match)), None
        )
        b = block_of(name)
        if chosen is None and b is not None:
            i = rank[b]
            chosen = i % p if cfg.pattern == "strided" else i * p // len(blocks)
        if chosen is None:
            loose.append(name)
            continue
        groups[chosen].append(name)
        sizes[chosen] += math.prod(shapes[name])
    for name in sorted(loose, key=lambda n: (-math.prod(shapes[n]), n)):
        lightest = min(range(p), key=lambda i: (sizes[i], i))
        groups[lightest].append(name)
        sizes[lightest] += math.prod(shapes[name])
    empty = [i for i, g in enumerate(groups) if not g]
    if empty:
        raise ConfigError(
            f"streaming.fragments: {p} fragments, but fragment {empty[0]} would hold no tensor "
            f"({len(shapes)} trainable tensors in {len(blocks)} blocks); use fewer fragments "
            "or [[streaming.rules]]"
        )
    return FragmentPlan(tuple(tuple(sorted(g)) for g in groups))
