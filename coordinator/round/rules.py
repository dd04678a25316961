"""Round decisions as pure functions of (clock, state, options).

Three questions, each answered in one place:

* who is in a round (``open_round``): the sites holding a live lease when it opens. A round waits
  to open until ``min_sites`` are there, then ``join_window_s`` more for late starters;
* whether an update counts (``admit_update``): only for the open round, from a participant, once;
* when a round closes (``decide_close``): when every participant that still holds a lease has
  delivered, or at the deadline if at least ``min_sites`` updates are in. Below quorum it keeps
  waiting and says why. With ``grace_s`` a round that has its quorum waits at most a grace
  window (``grace_window``: fixed, or a multiple of recent rounds' arrival spread) for the
  rest, so a slow or dead site costs the others the grace, not the deadline.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from wire.config_table import ConfigError, positive, rule, setting


@dataclass(frozen=True)
class RoundsConfig:
    """The ``[rounds]`` table: how many rounds, and who is in one and for how long.

    ``min_sites, max_sites, join_window_s, deadline_s`` come first, so the round functions'
    tests can build one positionally. ``total`` and ``inner_steps`` have defaults for such
    code but a job config must say them: they decide how long the job trains.
    """

    min_sites: int = setting(
        1,
        check=positive,
        help="quorum: a round opens once this many sites hold leases, and closes at its "
        "deadline only with this many updates",
    )
    max_sites: int = setting(64, check=positive, help="the most sites admitted to a round")
    join_window_s: float = setting(
        5.0,
        check=rule(lambda v: v >= 0, "must be >= 0"),
        help="after quorum, how long the first round waits for more sites",
    )
    deadline_s: float = setting(
        1800.0,
        check=positive,
        help="a round closes at its deadline if ``min_sites`` updates are in (below quorum it "
        "keeps waiting and says why)",
    )
    total: int = setting(
        10,
        check=positive,
        required=True,
        help="outer rounds (with ``[streaming]``, of every fragment: the coordinator runs "
        "``total * fragments`` rounds)",
    )
    inner_steps: int = setting(
        50,
        check=positive,
        required=True,
        help="H, inner steps per round (with ``[streaming]``, between two syncs of one "
        "fragment: a coordinator round is ``H / fragments`` steps)",
    )

    grace_s: float | None = setting(
        None,
        check=rule(lambda v: v >= 0, "must be >= 0"),
        help="once ``min_sites`` updates are in, wait at most this long for the other "
        "participants, then close (their updates arrive late: dropped, or folded into the "
        "next round by the strategy's ``late_discount``). Unset: wait for every live "
        "participant until the deadline (deterministic rounds)",
    )
    grace_spread_factor: float = setting(
        0.0,
        check=rule(lambda v: v >= 0, "must be >= 0"),
        help="> 0: the grace is this multiple of the arrival spread (first to last update) of "
        "the recent rounds every participant delivered to (the median of the last "
        "``GRACE_HISTORY``), at most ``grace_s``; 0: ``grace_s`` itself",
    )

    max_staleness: int = setting(
        1,
        check=positive,
        help="federated mode, with the strategy's ``late_discount``: a late update folds into "
        "the next round of its fragment still open, at most this many versions of that "
        "fragment behind (its weight times ``late_discount ** k`` at k behind); 1: the next "
        "round of its fragment only",
    )

    def check(self) -> None:
        """A round can never have more than ``max_sites``, so it must allow ``min_sites``."""
        if self.max_sites < self.min_sites:
            raise ConfigError(
                f"rounds.max_sites: must be >= rounds.min_sites ({self.min_sites}), "
                f"got {self.max_sites}"
            )


RoundOptions = RoundsConfig  # the name the round functions' callers knew first


@dataclass(frozen=True)
class RoundState:
    """Round ``number``: ``opened_at`` is None while it waits for sites."""

    number: int
    opened_at: float | None = None
    quorum_since: float | None = None
    participants: frozenset[str] = frozenset()
    received: dict[str, float] = field(default_factory=dict)
    closed: bool = False
    arrivals: dict[str, float] = field(default_factory=dict)  # when each update was counted


@dataclass(frozen=True)
class Decision:
    act: bool
    reason: str


class UpdateRefused(Exception):
    """An update that must not count; ``code`` says which kind of refusal it is."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def open_round(now: float, state: RoundState, live: set[str], opts: RoundsConfig) -> RoundState:
    """Open a waiting round once enough sites hold leases; returns the (maybe) new state."""
    if state.opened_at is not None:
        return state
    if len(live) < opts.min_sites:
        # A later round (quorum_since = -inf, see next_round) never waits for a join window.
        keep = state.quorum_since if state.quorum_since == float("-inf") else None
        return replace(state, quorum_since=keep)
    quorum_since = state.quorum_since if state.quorum_since is not None else now
    if len(live) < opts.max_sites and now - quorum_since < opts.join_window_s:
        return replace(state, quorum_since=quorum_since)
    chosen = frozenset(sorted(live)[: opts.max_sites])
    return replace(state, opened_at=now, quorum_since=quorum_since, participants=chosen)


def waiting_reason(
    now: float, state: RoundState, live: set[str], opts: RoundsConfig, grace=None
) -> str:
    if state.opened_at is None:
        if len(live) < opts.min_sites:
            return f"waiting for sites: {len(live)} of min_sites={opts.min_sites} have joined"
        since = state.quorum_since if state.quorum_since is not None else now
        left = opts.join_window_s - (now - since)
        return f"quorum reached; opening in {max(left, 0):.1f}s unless more sites join"
    return decide_close(now, state, live, opts, grace).reason


def admit_round(state: RoundState, round_number: int) -> None:
    """Raise ``UpdateRefused`` unless ``round_number`` is the open round."""
    if round_number < state.number or (round_number == state.number and state.closed):
        raise UpdateRefused(
            "late", f"round {round_number} is closed; the current round is {state.number}"
        )
    if round_number > state.number or state.opened_at is None:
        raise UpdateRefused(
            "early", f"round {round_number} is not open; the current round is {state.number}"
        )


def admit_update(state: RoundState, site: str, round_number: int) -> None:
    """Raise ``UpdateRefused`` unless an update from ``site`` for ``round_number`` may count."""
    admit_round(state, round_number)
    if site not in state.participants:
        raise UpdateRefused(
            "not_participant",
            f"site {site!r} is not a participant of round {round_number} "
            "(it joined after the round opened; it takes part from the next round)",
        )
    if site in state.received:
        raise UpdateRefused(
            "duplicate", f"site {site!r} already delivered its update for round {round_number}"
        )


def admit_latecomers(
    now: float, state: RoundState, live: set[str], opts: RoundsConfig
) -> RoundState:
    """Past the deadline and still below quorum, sites that joined after the round opened
    become participants: otherwise a round whose sites died for good could never close."""
    if state.opened_at is None or state.closed or len(state.received) >= opts.min_sites:
        return state
    if now < state.opened_at + opts.deadline_s:
        return state
    room = opts.max_sites - len(state.participants & live) - len(state.received.keys() - live)
    newcomers = sorted(live - state.participants)[: max(room, 0)]
    if not newcomers:
        return state
    return replace(state, participants=state.participants | frozenset(newcomers))


GRACE_HISTORY = 5  # rounds whose arrival spread sets an adaptive grace


def grace_window(spreads: Sequence[float], opts: RoundsConfig) -> float | None:
    """How long a round with its quorum waits for the rest (None: until the deadline).
    ``spreads``: the arrival spreads of the rounds closed with every participant, oldest
    first; with ``grace_spread_factor`` the grace follows the last ``GRACE_HISTORY`` of them
    (the median, times the factor), never above ``grace_s``."""
    if opts.grace_s is None:
        return None
    recent = sorted(spreads[-GRACE_HISTORY:])
    if opts.grace_spread_factor <= 0 or not recent:
        return opts.grace_s
    median = recent[len(recent) // 2]
    return min(opts.grace_s, opts.grace_spread_factor * median)


def quorum_at(state: RoundState, min_sites: int) -> float | None:
    """When the ``min_sites``-th update was counted (an update replayed after a restart
    counts from the round's opening); None below quorum."""
    if len(state.received) < min_sites or min_sites < 1:
        return None
    times = sorted(state.arrivals.get(k, state.opened_at or 0.0) for k in state.received)
    return times[min_sites - 1]


def arrival_spread(state: RoundState) -> float | None:
    """First to last update of a round, from the updates counted live (None: fewer than 2)."""
    times = [state.arrivals[k] for k in state.received if k in state.arrivals]
    return max(times) - min(times) if len(times) >= 2 else None


def decide_close(
    now: float,
    state: RoundState,
    live: set[str],
    opts: RoundsConfig,
    grace: float | None = None,
) -> Decision:
    """Whether the open round closes now, and why (or why not). ``grace``: how long a round
    with its quorum waits for the rest (``grace_window``; None: until the deadline)."""
    if state.opened_at is None or state.closed:
        return Decision(False, "round not open")
    got = len(state.received)
    outstanding = sorted((state.participants & live) - state.received.keys())
    if not outstanding and got >= opts.min_sites:
        return Decision(True, f"all {got} live participants delivered")
    since = quorum_at(state, opts.min_sites) if grace is not None else None
    if since is not None and outstanding and now >= since + grace:
        return Decision(
            True,
            f"{got} updates, quorum (min_sites={opts.min_sites}) reached {now - since:.1f}s "
            f"ago: the {grace:.1f}s grace is over; not waiting for {', '.join(outstanding)}",
        )
    if now >= state.opened_at + opts.deadline_s:
        if got >= opts.min_sites:
            return Decision(
                True, f"deadline passed with {got} updates (min_sites={opts.min_sites})"
            )
        return Decision(
            False,
            f"deadline passed but only {got} of min_sites={opts.min_sites} updates arrived; "
            f"waiting on {outstanding or 'new sites'}",
        )
    if not outstanding:
        return Decision(
            False, f"{got} of min_sites={opts.min_sites} updates and no live participant left"
        )
    waiting = f"waiting on {len(outstanding)} site(s): {', '.join(outstanding)}"
    if since is not None:
        waiting += f" (closing in {max(since + grace - now, 0.0):.1f}s: the grace after quorum)"
    return Decision(False, waiting)


def record_update(
    state: RoundState, site: str, weight: float, now: float | None = None
) -> RoundState:
    """``state`` with ``site``'s update counted (``now``: when; None for a replay)."""
    arrivals = state.arrivals if now is None else {**state.arrivals, site: now}
    return replace(state, received={**state.received, site: weight}, arrivals=arrivals)


def next_round(state: RoundState) -> RoundState:
    """The round after ``state``. The join window only delays a job's first round: later
    rounds open as soon as quorum holds."""
    return RoundState(number=state.number + 1, quorum_since=float("-inf"))
