"""The case model (one hostile request or stream and what the oracle says of it), the
findings a case may leave, the known server bugs a run may leave out, and how a case is shown
(``describe``) and saved to findings.jsonl (``_serialized``)."""

from __future__ import annotations

import base64
from dataclasses import dataclass, field

from google.protobuf import text_format

from .constants import CALL_TIMEOUT_S

# ---- known server bugs ---------------------------------------------------------------------------

# What ``run(skip_known_bugs=True)`` leaves out (tests/test_fuzz.py reproduces each one in a
# strict xfail test). Remove an entry once its bug is fixed.
KNOWN_BUGS: dict[str, str] = {}  # none open; the ones found so far have regression tests


def known_bug(case: Case) -> str | None:
    """The KNOWN_BUGS entry ``case`` would trigger, if any (a rule per entry goes here)."""
    return None


# ---- cases, outcomes, findings ------------------------------------------------------------------


@dataclass
class Case:
    kind: str
    method: str  # Join, Heartbeat, Fetch, Leave, Status, Push or Restart (see gen_spool)
    request: object  # a message; for Push a list of messages; bytes (or a list) when raw
    raw: bool = False
    ops: list[str] = field(default_factory=list)  # what was done to a valid message
    verdict: str = "refuse"  # the oracle's word: refuse, accept or partial (never count)
    cancel_at: int | None = None  # Push: the client aborts the stream before this message
    prelude: list | None = None  # Push: sent first, a valid partial upload the case resumes
    prelude_acked: int = 0
    stay: bool = False  # Join: keep the new lease (else the fuzzer leaves at once)
    timeout: float = CALL_TIMEOUT_S
    hold_after: int | None = None  # Push: send this many messages, then hold the stream open
    second: list | None = None  # ... while this second push runs to its end
    second_ops: list[str] = field(default_factory=list)
    held: tuple[str, int] | None = None  # (method, n) held open by another connection meanwhile
    damage: tuple[str, int] | None = None  # Restart: how the spooled update is damaged


@dataclass
class Finding:
    category: str  # crash, state_change, spec, echo, wrong_reply
    case_no: int
    case: Case
    outcome: str
    details: str
    extra: str = ""

    @property
    def signature(self) -> tuple:
        ops = tuple(sorted({o.split("(")[0] for o in self.case.ops}))
        return (self.category, self.case.kind, ops, self.outcome)


def _short(value, n: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= n else f"{text[:n]}...({len(value)} long)"


def _fmt_message(m, limit: int = 400) -> str:
    if isinstance(m, bytes | bytearray):
        return f"raw {len(m)} bytes: {bytes(m[:80]).hex()}" + ("..." if len(m) > 80 else "")
    if m is None:
        return "(undecodable)"
    text = text_format.MessageToString(m, as_one_line=True)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


def describe(case: Case, max_messages: int = 14) -> str:
    head = f"kind={case.kind} method={case.method} ops={case.ops} oracle={case.verdict}"
    if case.cancel_at is not None:
        head += f" client_cancels_before_message={case.cancel_at}"
    lines = [head]
    if case.prelude is not None:
        lines.append(f"  prelude (acknowledged as partial, {case.prelude_acked} bytes):")
        lines += [f"    {_fmt_message(m)}" for m in case.prelude[:max_messages]]
        lines.append("  then:")
    msgs = case.request if isinstance(case.request, list) else [case.request]
    lines += [f"    {_fmt_message(m)}" for m in msgs[:max_messages]]
    if len(msgs) > max_messages:
        lines.append(f"    ... {len(msgs) - max_messages} more message(s)")
    if case.second is not None:
        lines.insert(len(lines) - len(msgs[:max_messages]) + case.hold_after, "    (held open)")
        lines.append("  the second stream, sent while the first was held open:")
        lines += [f"    {_fmt_message(m)}" for m in case.second[:max_messages]]
    return "\n".join(lines)


def _serialized(case: Case) -> dict:
    def enc(m):
        if m is None:
            return None
        raw = bytes(m) if isinstance(m, bytes | bytearray) else m.SerializeToString()
        if len(raw) > 1 << 20:
            return {"too_large_bytes": len(raw)}
        return base64.b64encode(raw).decode()

    msgs = case.request if isinstance(case.request, list) else [case.request]
    return {
        "kind": case.kind,
        "method": case.method,
        "raw": case.raw,
        "ops": case.ops,
        "cancel_at": case.cancel_at,
        "prelude": [enc(m) for m in case.prelude] if case.prelude is not None else None,
        "hold_after": case.hold_after,
        "second": [enc(m) for m in case.second] if case.second is not None else None,
        "damage": case.damage,
        "messages": [enc(m) for m in msgs],
    }
