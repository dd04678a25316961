"""Case generators for the unary RPCs (Join, Heartbeat, Fetch, Leave, Status), and the lease
a case carries: the victim's, one altered, another site's, a random one or none."""

from __future__ import annotations

from hypothesis import strategies as st

from wire.proto import isthmus_pb2 as pb

from .cases import Case, _short
from .constants import HELD_MAX, HELD_METHODS, SITE_A, SITE_B, SPEC_NAME, U64_MAX, _u64
from .strategies import DOUBLES, HUGE_TEXT, NAMES, TEXT, U32, U64, unknown_fields


class RpcCases:
    """``Fuzzer``'s generators of Join, Heartbeat, Fetch, Leave and Status cases (a mixin)."""

    # ---- building blocks for cases -------------------------------------------------------------

    def _lease_copy(self, name: str) -> pb.Lease:
        lease = pb.Lease()
        lease.CopyFrom(self.leases[name])
        return lease

    def draw_lease(self, data) -> tuple[pb.Lease | None, str]:
        a = self._lease_copy(SITE_A)
        mode = data.draw(
            st.sampled_from(
                ["a"] * 4 + ["a_ignored", "a_token", "other_site", "b", "extra", "random", "absent"]
            )
        )
        if mode == "a":
            return a, "lease=a"
        if mode == "a_ignored":
            a.ttl_s, a.lease_id = data.draw(DOUBLES), data.draw(U64)
            return a, "lease=a_ignored_fields"
        if mode == "a_token":
            t = a.token
            a.token = data.draw(
                st.sampled_from([_u64(x) for x in (t - 1, t + 1, t + 2**32, t - 2**32, 0, t ^ 1)])
                | U64.filter(lambda x: x != t)
            )
            return a, f"lease_token({a.token})"
        if mode == "other_site":
            a.site = data.draw(NAMES | st.sampled_from([SITE_B, SITE_A.upper(), SITE_A + "\n"]))
            return a, f"lease_site({_short(a.site)})"
        if mode == "b":
            return self._lease_copy(SITE_B), "lease=b"
        if mode == "extra":
            pick = data.draw(st.integers(0, 7))  # drawn whatever the state (see _index)
            if self.extras:
                name = sorted(self.extras)[pick % len(self.extras)]
                lease = pb.Lease()
                lease.CopyFrom(self.extras[name][0])
                return lease, "lease=extra"
            return a, "lease=a"
        if mode == "random":
            lease = pb.Lease(site=data.draw(NAMES), lease_id=data.draw(U64), token=data.draw(U64))
            lease.ttl_s = data.draw(DOUBLES)
            return lease, "lease=random"
        return None, "lease=absent"

    # ---- case generators (one per kind) ---------------------------------------------------------

    def gen_join(self, data) -> Case:
        site = data.draw(NAMES | st.sampled_from([SITE_A, SITE_B]))
        req = pb.JoinRequest(site=site)
        if data.draw(st.booleans()):
            req.capabilities.CopyFrom(
                pb.Capabilities(
                    codecs=data.draw(st.lists(TEXT, max_size=4)),
                    world_size=data.draw(U32),
                    num_examples=data.draw(U64),
                )
            )
        if data.draw(st.booleans()):
            req.have_version = data.draw(U64)
        req.have_hash = data.draw(st.binary(max_size=64))
        verdict = "accept" if SPEC_NAME.fullmatch(site) else "refuse"
        stay = data.draw(st.booleans())
        return Case("", "Join", req, ops=[f"site({_short(site)})"], verdict=verdict, stay=stay)

    def _lease_verdict(self, lease: pb.Lease | None) -> str:
        if lease is None:
            return "refuse"
        return "accept" if (lease.site, lease.token) in self.valid_leases() else "refuse"

    def gen_heartbeat(self, data) -> Case:
        lease, note = self.draw_lease(data)
        req = pb.HeartbeatRequest()
        if lease is not None:
            req.lease.CopyFrom(lease)
        if data.draw(st.booleans()):
            req.progress.CopyFrom(
                pb.Progress(
                    round=data.draw(U64),
                    inner_step=data.draw(U32),
                    train_loss=data.draw(DOUBLES),
                    phase=data.draw(TEXT | HUGE_TEXT),
                )
            )
        return Case("", "Heartbeat", req, ops=[note], verdict=self._lease_verdict(lease))

    def gen_fetch(self, data) -> Case:
        lease, note = self.draw_lease(data)
        total = len(self.published[2])
        req = pb.FetchRequest()
        if lease is not None:
            req.lease.CopyFrom(lease)
        ops = [note]
        version_mode = data.draw(st.sampled_from(["absent", "absent", "current", "other"]))
        if version_mode == "current":
            req.version = self.r
        elif version_mode == "other":
            req.version = data.draw(st.sampled_from([self.r + 1, U64_MAX]) | U64)
            ops.append(f"version({req.version})")
        if data.draw(st.booleans()):
            req.from_version = data.draw(U64)
        req.offset = data.draw(
            st.sampled_from([0, 0, total, total + 1, U64_MAX]) | st.integers(0, total) | U64
        )
        ops.append(f"offset({req.offset})")
        if data.draw(st.booleans()):  # a ranged fetch ([transfer] streams > 1)
            req.length = data.draw(
                st.sampled_from([1, 0, total, total - min(req.offset, total), total + 1, U64_MAX])
                | st.integers(0, total)
                | U64
            )
            ops.append(f"length({req.length})")
        ok = (
            self._lease_verdict(lease) == "accept"
            and (not req.HasField("version") or req.version == self.r)
            and req.offset <= total
            # A range holds at least one byte and ends inside the payload.
            and (not req.HasField("length") or 0 < req.length <= total - req.offset)
        )
        return Case("", "Fetch", req, ops=ops, verdict="accept" if ok else "refuse")

    def gen_leave(self, data) -> Case:
        lease, note = self.draw_lease(data)
        req = pb.LeaveRequest(reason=data.draw(TEXT | HUGE_TEXT))
        if lease is not None:
            req.lease.CopyFrom(lease)
        return Case("", "Leave", req, ops=[note], verdict=self._lease_verdict(lease))

    def gen_held(self, data) -> Case:
        """An honest heartbeat of site A while another connection holds calls open."""
        method = data.draw(st.sampled_from(HELD_METHODS))
        n = data.draw(st.integers(1, HELD_MAX))
        lease = self._lease_copy(SITE_A)
        req = pb.HeartbeatRequest(lease=lease)
        ops = [f"held({method.rsplit('/', 2)[-2]}.{method.rsplit('/', 1)[-1]} x{n})"]
        return Case(
            "", "Heartbeat", req, ops=ops, verdict=self._lease_verdict(lease), held=(method, n)
        )

    def gen_status(self, data) -> Case:
        mode = data.draw(st.sampled_from(["typed", "unknown_fields", "random_bytes"]))
        if mode == "typed":
            return Case("", "Status", pb.StatusRequest(), verdict="accept")
        raw = data.draw(unknown_fields() if mode == "unknown_fields" else st.binary(max_size=64))
        return Case("", "Status", raw, raw=True, ops=[mode], verdict="accept")
