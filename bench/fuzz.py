"""``python -m bench.fuzz``: property-based fuzzing of every coordinator RPC against a live
coordinator process.

The fuzzer is the package ``bench.fuzzing`` (its docstring says what a run sends and checks,
and which module holds what). This module is its entry point, with the same flags and output,
and keeps the names tests and scripts use importable as ``bench.fuzz.<name>``.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script (python bench/fuzz.py): bench must import
    sys.path.insert(0, str(REPO))

# Re-exports (noqa: F401), not an __all__: hypothesis also draws the short string literals of
# local modules, so the list of names in an __all__ would change the cases a seed generates.
from bench.fuzzing.cases import KNOWN_BUGS, Case, Finding, describe, known_bug  # noqa: E402,F401
from bench.fuzzing.constants import (  # noqa: E402,F401
    ALLOWED,
    CLIENT_CANCEL,
    DESERIALIZE,
    KIND_LIST,
    KINDS,
    MAX_CHUNK_BYTES,
    MAX_UPDATE_BYTES,
    SITE_A,
    SITE_B,
    TRAINABLE,
    UPDATE_ITEMSIZE,
)
from bench.fuzzing.gen_wire import BYTE_OPS  # noqa: E402,F401
from bench.fuzzing.mutations_stream import OPS  # noqa: E402,F401
from bench.fuzzing.oracle import Resume, corrupt_last_chunk, manifest_problem, push_verdict  # noqa: E402,F401
from bench.fuzzing.report import Report, print_report  # noqa: E402,F401
from bench.fuzzing.runner import Fuzzer, main, run  # noqa: E402,F401
from bench.fuzzing.session import job_config  # noqa: E402,F401

if __name__ == "__main__":
    sys.exit(main())
