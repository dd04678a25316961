"""Replay of damaged spool files: a valid update from ``fz-a`` counts, the coordinator is
killed, the update's spooled file (or its record) is damaged on disk, and the coordinator is
started again on its state folder.

The restarted coordinator must not count the damaged update (the round's count of updates and
theta are back where the case started, which ``check_state`` checks as for every case), must
not stop, must keep the damaged files aside as evidence, and must ask ``fz-a`` to send its
update again (``RoundInfo.update_wanted``).
"""

from __future__ import annotations

import os
import signal

from hypothesis import strategies as st

from .cases import Case
from .constants import CALL_TIMEOUT_S, SITE_A

# How a spooled update is damaged; ``at`` picks the byte, the length or the cut.
DAMAGES = ("flip", "truncate", "extend", "delete", "record")


def damage_file(update, kind: str, at: int) -> None:
    """Damage ``update`` (``LABEL.update``; its record is ``LABEL.json``) so it differs."""
    size = update.stat().st_size
    if kind == "flip":
        with open(update, "r+b") as f:
            f.seek(at % size)
            byte = f.read(1)[0]
            f.seek(at % size)
            f.write(bytes([byte ^ (1 << (at % 8))]))
    elif kind == "truncate":
        os.truncate(update, at % size)
    elif kind == "extend":
        with open(update, "ab") as f:
            f.write(bytes(at % 64 + 1))
    elif kind == "delete":
        update.unlink()
    else:  # the record cut short: it no longer parses
        record = update.with_suffix(".json")
        text = record.read_bytes()
        record.write_bytes(text[: at % len(text)])


class SpoolCases:
    """``Fuzzer``'s generator of damaged-spool cases, and how one is carried out (a mixin)."""

    def gen_spool(self, data) -> Case:
        msgs = self.base_push(data)  # sent as it is: it must count before the kill
        kind = data.draw(st.sampled_from(DAMAGES))
        at = data.draw(st.integers(0, 2**20))
        return Case("", "Restart", msgs, ops=[f"{kind}({at})"], verdict="accept", damage=(kind, at))

    def call_restart(self, case: Case) -> tuple[str, str, object]:
        """Count the push, kill the coordinator, damage the file, start it again."""
        reply = self.stub.Push(iter(case.request), timeout=CALL_TIMEOUT_S)
        if self._status().updates_received != 1:
            return "OK", "", reply  # not counted (e.g. NaN after a cast): nothing to damage
        folder = self.coord.state_dir / "spool" / f"round-{self.r:08d}"
        self.coord.kill(signal.SIGKILL)
        damage_file(folder / f"{SITE_A}.update", *case.damage)
        try:
            self.coord.restart()
        except (RuntimeError, TimeoutError) as exc:
            self.report.crashes += 1
            self.finding("crash", case, "RESTART", str(exc)[-2000:], "no start on a damaged spool")
            for path in folder.glob(f"{SITE_A}.*"):  # so that it starts, and fuzzing goes on
                path.unlink()
            self.coord.restart()
        self._connect()
        self.leases.clear()
        self.ensure_leases(self._status())
        asked = self._heartbeat(SITE_A).round.update_wanted
        if not asked:
            self.finding("wrong_reply", case, "OK", "", "fz-a is not asked for its update again")
        if not any((folder / "damaged").glob(f"{SITE_A}.*.json")):
            self.finding("wrong_reply", case, "OK", "", "the damaged update was not set aside")
        return "OK", "", reply
