"""Finding the leading coordinator among several (``--coordinator A:7070,B:7070``).

A standby coordinator refuses every call with ``UNAVAILABLE`` and names the leader twice: in
words (``"standby; the leader is B:7070"``) and in the trailing metadata ``isthmus-leader``
(a field, not prose, for clients to read). ``next_address`` is the rule a client follows after
a refusal; pure, so it is tested without a network.
"""

from __future__ import annotations

from wire.config_table import check_listen

LEADER_KEY = "isthmus-leader"


def parse_addresses(text: str) -> tuple[list[str], str | None]:
    """``"a:1,b:2"`` -> (["a:1", "b:2"], None), or ([], why not) for a malformed list."""
    parts = [p.strip() for p in text.split(",")]
    for part in parts:
        if problem := check_listen(part):
            return [], f"{part!r}: {problem}" if len(parts) > 1 else problem
    if len(set(parts)) != len(parts):
        return [], "an address is named twice"
    return parts, None


def leader_named(exc: BaseException) -> str | None:
    """The leader a standby's refusal names, if ``exc`` is one."""
    import grpc  # here: the command lines import this module before they need grpc

    if not isinstance(exc, grpc.RpcError) or exc.code() != grpc.StatusCode.UNAVAILABLE:
        return None
    try:
        metadata = exc.trailing_metadata() or ()
    except Exception:  # a locally made error carries no call to ask
        return None
    for key, value in metadata:
        if key == LEADER_KEY and value and not check_listen(str(value)):
            return str(value)
    return None


def next_address(addresses: list[str], current: str, named: str | None) -> str:
    """Where to call after a refusal or a failure at ``current``: the leader a standby named
    (even one not in the list: the operator gave the hosts, the leader knows its address),
    else the next address of the list in turn."""
    if named:
        return named
    if current not in addresses:
        return addresses[0]
    return addresses[(addresses.index(current) + 1) % len(addresses)]
