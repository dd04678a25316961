"""The fuzz run's fixed values: the coordinator's limits and timeouts, the protocol's rules
restated for the oracle (not imported from the server), the outcomes a case may end in, and the
case kinds with their weights."""

from __future__ import annotations

import re

import torch

SITE_A, SITE_B = "fz-a", "fz-b"
MAX_UPDATE_BYTES = 4096
MAX_CHUNK_BYTES = 4 << 20
TTL_S = 30.0
REFRESH_S = 5.0
CALL_TIMEOUT_S = 5.0
BIG_CALL_TIMEOUT_S = 20.0
SETTLE_S = 0.03
BIG_DETAILS = 4096  # a refusal message longer than this echoes attacker input back
U64_MAX = 2**64 - 1


def _u64(x: int) -> int:
    """Clamp a computed value into uint64 (protobuf refuses anything else)."""
    return min(max(int(x), 0), U64_MAX)


def _i64(x: int) -> int:
    return min(max(int(x), -(2**63)), 2**63 - 1)


# The protocol's rules, restated here (not imported from the server) for the oracle.
TRAINABLE = {"lin.bias": [16], "lin.weight": [16, 8]}
UPDATE_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
WIRE_DTYPES = [
    "float32", "float64", "bfloat16", "float16", "int64", "int32", "int16", "int8", "uint8", "bool"
]  # fmt: skip
ALIGN = 64  # tensors start at most this far aligned after the previous one ends
SPEC_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")  # used with fullmatch: 1-63 chars

ALLOWED = frozenset(
    {
        "OK",
        "INVALID_ARGUMENT",
        "FAILED_PRECONDITION",
        "ABORTED",
        "ALREADY_EXISTS",
        "NOT_FOUND",
        "RESOURCE_EXHAUSTED",
        "UNAVAILABLE",
        "DATA_LOSS",  # a payload whose SHA-256 does not match: the site sends it again
        # deliberate refusals of the mutual-TLS layer; never expected on the plaintext port
        "UNAUTHENTICATED",
        "PERMISSION_DENIED",
    }
)
DESERIALIZE = "INTERNAL(deserialize)"
CLIENT_CANCEL = "CLIENT_CANCEL"
METHOD_PATH = "/isthmus.v1.Coordinator/"

# Case kinds and their weights (out of 100).
KINDS = {
    "join": 8,
    "heartbeat": 6,
    "fetch": 7,
    "leave": 5,
    "status": 2,
    "push_random": 5,
    "push_header": 10,
    "push_manifest": 12,
    "push_chunks": 12,
    "push_structure": 5,
    "push_nonfinite": 4,
    "push_resume": 7,
    "push_cancel": 3,
    "push_concurrent": 3,
    "wire": 7,
    "oversize": 1,
    "held": 2,
    "spool": 1,  # a coordinator restart each: a few seconds
}
# What a "held" case holds open from another connection, never sending a request: unary calls
# and streams of every kind, up to HELD_MAX at once, while an honest heartbeat is timed.
HELD_METHODS = (
    "/isthmus.v1.Coordinator/Heartbeat",
    "/isthmus.v1.Coordinator/Join",
    "/isthmus.v1.Coordinator/WaitRound",
    "/isthmus.v1.Coordinator/Fetch",
    "/isthmus.v1.Coordinator/Push",
    "/isthmus.v1.Bulk/Push",
    "/isthmus.v1.Bulk/Fetch",
)
HELD_MAX = 40
KIND_LIST = [k for k, w in KINDS.items() for _ in range(w)]
