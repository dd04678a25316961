"""One case, sent and checked: the call (typed or raw, cancelled by the client, or two
concurrent streams), the outcome's label, and the checks after it (an allowed status, no echo
of a huge input, a right reply to an accepted request, the state unchanged, the server alive)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
import time
import traceback

import grpc
from google.protobuf.message import DecodeError
from hypothesis import strategies as st
from hypothesis.errors import HypothesisException

from wire.proto import isthmus_pb2 as pb

from .cases import Case, Finding, _serialized, known_bug
from .constants import (
    ALLOWED,
    BIG_DETAILS,
    CALL_TIMEOUT_S,
    CLIENT_CANCEL,
    DESERIALIZE,
    SETTLE_S,
    SITE_A,
    SITE_B,
)
from .holding import HeldCalls


class _Cancel(Exception):
    """Raised inside a request iterator: grpc then cancels the call (no half-close)."""


def _requests(items: list, cancel_at: int | None):
    for i, m in enumerate(items):
        if cancel_at is not None and i == cancel_at:
            raise _Cancel
        yield m
    if cancel_at is not None:
        raise _Cancel


def _label(exc: grpc.RpcError, case: Case) -> tuple[str, str]:
    """The table's name for a failed call's outcome, and its details."""
    code, details = exc.code(), exc.details() or ""
    label = code.name if code is not None else "NONE"
    if code is grpc.StatusCode.INTERNAL and details == "Exception deserializing request!":
        label = DESERIALIZE
    if case.cancel_at is not None and (
        code is grpc.StatusCode.CANCELLED
        or (code is grpc.StatusCode.UNKNOWN and details == "Exception iterating requests!")
    ):
        label = CLIENT_CANCEL
    return label, details


class CaseChecks:
    """``Fuzzer``'s part that runs one case and checks what it did (a mixin over ``Session``)."""

    # ---- one case -----------------------------------------------------------------------------

    def one_case(self, data, target: int) -> None:
        if self.report.cases >= target:
            return
        kind = data.draw(st.sampled_from(self.kind_list))
        try:
            case = getattr(self, f"gen_{kind}")(data)
        except HypothesisException:
            raise
        except Exception:  # a bug of the fuzzer itself: show it, keep fuzzing the server
            self.report.fuzzer_errors.append(f"generating a {kind} case:\n{traceback.format_exc()}")
            return
        case.kind = kind
        bug = known_bug(case) if self.skip_known_bugs else None
        if bug is not None:
            self.report.skipped[bug] += 1
            return
        self.run_case(case)
        n = self.report.cases
        if self.progress_every and n % self.progress_every == 0:
            self.out(
                f"[fuzz] {n}/{target} cases  crashes={self.report.crashes} "
                f"state_changes={self.report.state_changes}  "
                f"{time.monotonic() - self.started:.1f}s"
            )

    def _call(self, case: Case) -> tuple[str, str, object]:
        if case.held is None:
            return self._call_once(case)
        held = HeldCalls(self.attacker, *case.held)
        try:
            t0 = time.monotonic()
            result = self._call_once(case)
            self.report.honest_ms.append((time.monotonic() - t0) * 1000)
            return result
        finally:
            held.release()

    def _call_once(self, case: Case) -> tuple[str, str, object]:
        method = case.method
        try:
            if method == "Restart":
                return self.call_restart(case)
            if method == "Push":
                call = self.raw_calls["Push"] if case.raw else self.stub.Push
                reply = call(_requests(case.request, case.cancel_at), timeout=case.timeout)
            elif method == "Fetch":
                call = self.raw_calls["Fetch"] if case.raw else self.stub.Fetch
                reply = list(call(case.request, timeout=case.timeout))
            else:
                call = self.raw_calls[method] if case.raw else getattr(self.stub, method)
                reply = call(case.request, timeout=case.timeout)
            return "OK", "", reply
        except grpc.RpcError as exc:
            return (*_label(exc, case), None)

    def _call_concurrent(self, case: Case) -> tuple[str, str, object, str, str]:
        """Stream 1 sends ``hold_after`` messages and waits; once the server has taken them,
        stream 2 (``case.second``) runs to its end; then stream 1 sends the rest."""
        hold = threading.Event()
        items, k = case.request, case.hold_after

        def first():
            yield from items[:k]
            hold.wait(CALL_TIMEOUT_S)
            yield from items[k:]

        prefix = sum(len(m.chunk.data) for m in items[:k] if m.WhichOneof("kind") == "chunk")
        before = self._status().wan_bytes_in
        future = self.stub.Push.future(first(), timeout=CALL_TIMEOUT_S + 5)
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and not future.done():
            if self._status().wan_bytes_in >= before + prefix:
                break
            time.sleep(0.002)
        label2, details2, _ = self._call(Case(case.kind, "Push", case.second))
        hold.set()
        try:
            return "OK", "", future.result(), label2, details2
        except grpc.RpcError as exc:
            return (*_label(exc, case), None, label2, details2)

    def finding(self, category: str, case: Case, outcome: str, details: str, extra: str = ""):
        f = Finding(category, self.report.cases, case, outcome, details, extra)
        self.report.findings.append(f)
        if self.findings_file is not None:
            record = {"category": category, "case_no": f.case_no, "outcome": outcome}
            record |= {"details": details[:2000], "extra": extra, "case": _serialized(case)}
            self.findings_file.write(json.dumps(record) + "\n")
            self.findings_file.flush()

    def run_case(self, case: Case) -> None:
        self.report.cases += 1
        self.report.distinct.add(hashlib.sha256(repr(_serialized(case)).encode()).digest()[:8])
        if case.prelude is not None:
            try:
                reply = self.stub.Push(iter(case.prelude), timeout=CALL_TIMEOUT_S)
                if reply.complete or reply.acked_offset != case.prelude_acked:
                    self.finding("wrong_reply", case, "OK", "", f"prelude answered {reply}")
            except grpc.RpcError as exc:
                self.finding("wrong_reply", case, exc.code().name, exc.details() or "", "prelude")
        allowed = ALLOWED | ({DESERIALIZE} if case.raw else set())
        allowed |= {CLIENT_CANCEL} if case.cancel_at is not None else set()
        outcomes = []
        if case.second is None:
            label, details, reply = self._call(case)
        else:
            label, details, reply, label2, details2 = self._call_concurrent(case)
            outcomes.append((f"{case.kind}(2nd)", label2, details2, "the second stream: "))
        outcomes.insert(0, (case.kind, label, details, ""))
        for row, code, text, which in outcomes:
            self.report.table[row][code] += 1
            if code not in allowed:
                self.report.crashes += 1
                self.finding("crash", case, code, text, which + "a status outside the allowed set")
            if len(text) > BIG_DETAILS or "metadata size exceeds" in text:
                self.finding("echo", case, code, text, f"{which}refusal of {len(text)} chars")
        if label == "OK":
            self.after_ok(case, reply)
        if case.method == "Push" and label in (DESERIALIZE, CLIENT_CANCEL):
            # The client has its answer, but the server's handler may still be running.
            time.sleep(SETTLE_S)
        self.check_state(case, label, details)
        self.previous = case

    def after_ok(self, case: Case, reply) -> None:
        if case.method == "Join":
            lease = reply.lease
            if case.verdict == "refuse" and not case.raw:
                self.finding("spec", case, "OK", "", f"Join admitted site {lease.site!r}")
            if lease.site in (SITE_A, SITE_B):
                self.leases[lease.site] = lease
                self.refreshed[lease.site] = time.monotonic()
            elif case.stay:
                self.extras[lease.site] = (lease, time.monotonic())
            else:
                self.extras.pop(lease.site, None)
                with contextlib.suppress(grpc.RpcError):
                    self.stub.Leave(pb.LeaveRequest(lease=lease), timeout=CALL_TIMEOUT_S)
        elif case.method in ("Heartbeat", "Leave"):
            if case.verdict == "refuse" and not case.raw:
                self.finding("spec", case, "OK", "", f"{case.method} with an invalid lease")
            site = None if case.raw else case.request.lease.site
            if case.method == "Leave":
                self.extras.pop(site, None)
            elif site in self.extras:
                self.extras[site] = (self.extras[site][0], time.monotonic())
        elif case.method == "Fetch":
            request = case.request
            if case.raw:
                try:
                    request = pb.FetchRequest.FromString(case.request)
                except DecodeError:
                    return
            elif case.verdict == "refuse":
                self.finding("spec", case, "OK", "", "Fetch served an invalid request")
                return
            problem = self.check_fetch(request, reply)
            if problem:
                self.finding("wrong_reply", case, "OK", "", problem)

    def check_fetch(self, request: pb.FetchRequest, msgs: list) -> str | None:
        version, theta_hash, payload = self.published
        if not msgs or not msgs[0].HasField("header"):
            return "the stream does not start with a header"
        h = msgs[0].header
        if h.version != version or bytes(h.theta_hash) != theta_hash:
            return f"header names version {h.version}, expected {version}"
        offset, data = request.offset, bytearray()
        for m in msgs[1:]:
            if m.HasField("header") or m.chunk.offset != offset + len(data):
                return "chunks out of order"
            data += m.chunk.data
        end = offset + request.length if request.HasField("length") else len(payload)
        if bytes(data) != payload[offset:end]:
            return (
                f"{len(data)} bytes served for [{offset}, {end}) differ from theta's payload there"
            )
        return None

    def check_state(self, case: Case, label: str, details: str) -> None:
        alive = self.coord.proc.poll() is None
        st_reply, err = None, ""
        if alive:
            try:
                st_reply = self._status()
            except grpc.RpcError as exc:
                err = f"Status failed: {exc.code().name} {exc.details()}"
        if st_reply is None:
            self.report.crashes += 1
            what = err or f"coordinator process exited ({self.coord.proc.returncode})"
            self.finding("crash", case, label, details, what)
            self.recover()
            return
        now = (st_reply.round.round, st_reply.round.theta_hash, st_reply.updates_received)
        if now != self.baseline:
            self.report.state_changes += 1
            extra = (
                f"round {self.baseline[0]}->{now[0]}, updates {self.baseline[2]}->{now[2]}, "
                f"theta {'changed' if now[1] != self.baseline[1] else 'same'}"
            )
            if self.previous is not None:
                extra += f" (the case before: {self.previous.kind} {self.previous.ops})"
            self.finding("state_change", case, label, details, extra)
            self.resync()
            return
        self.ensure_leases(st_reply)
