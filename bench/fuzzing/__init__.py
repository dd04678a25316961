"""Property-based fuzzing of every coordinator RPC against a live coordinator process.

``python -m bench.fuzz [--cases N] [--seed S] [--workdir DIR]`` starts ``coordinator serve``
(plaintext on loopback, the tiny model of ``tests/coord_harness.py``), joins two sites, ``fz-a``
(the victim whose lease most hostile requests carry) and ``fz-b``, waits for a round in which
both are participants, then lets hypothesis generate N hostile requests, each sent as a real RPC
over real gRPC: Join, Heartbeat, Fetch, Leave, Status and Push streams, typed and as raw bytes.

Cases come from three sources:

* random messages of every kind (unicode, huge and almost-valid names, random capabilities,
  leases, progress, versions, offsets, manifests, chunks);
* mutations of a valid message: a valid push for the open round from ``fz-a`` (or a valid
  Heartbeat/Fetch/Leave) with one to three fields or bytes altered: header fields, manifest
  entries, bytes claimed that no tensor needs (after the last one or before one, the payload
  padded to match and its SHA-256 recomputed), chunk offsets/data/order/count, stream
  structure (no header, two headers, chunks before the header, an empty message), NaN/Inf
  with a correct SHA-256, an interrupted upload resumed with a hostile continuation, a stream
  cancelled by the client, a second stream for an upload held open by a first (busy), one
  serialized message with a byte flipped, inserted, deleted or truncated, or an extra
  undecodable message (the server then sees bad bytes);
* oversized messages (33 MB, 4 MiB + 1 chunks, 100001 tensors, 1 MB strings echoed back);
* held calls: up to 40 calls or streams of one method opened from another connection and never
  sent a request, while an honest heartbeat of ``fz-a`` is timed (``honest_heartbeat_p99_ms``);
* replay of damaged spool files: a valid update counts, the coordinator is killed, the update's
  spooled file is damaged (a bit flipped, cut short, extended, deleted, its record cut) and the
  coordinator restarted: the update must not count and ``fz-a`` must be asked for it again.

The invariant is *hostile input changes nothing*. A client-side oracle, written from the
protocol's rules rather than from the server's code, says whether a push stream would be a
valid, complete update that must count. Such a stream is never sent as it is: its last chunk
gets one bit flipped (an SHA-256 mismatch), so every push sent is one that must not count
(a damaged-spool case's update does count, until its file is damaged and the server restarted).
After every case the fuzzer checks that the coordinator process is alive and answers Status,
that the round number, theta's hash and the round's count of updates are unchanged, and that
the reply was a well-formed gRPC status from the allowed set (an UNKNOWN or INTERNAL status is
an uncaught exception in the server). Two framework outcomes are allowed only where they are
the point of the case: ``INTERNAL(deserialize)`` (grpc's answer to bytes that are not the
request type) for raw-byte cases, and ``CLIENT_CANCEL`` for streams the client aborts. At the
end the coordinator's log is scanned for tracebacks (grpc's own log of undecodable requests
excepted).

A state change or a crash is recorded with a reproducer and the run goes on (the fuzzer brings
the job back to a clean open round: valid zero updates from both sites close the round). The
last line printed is ``cases=N crashes=C state_changes=S``; the exit status is 1 when either
count is not zero. Warnings that are neither (a refusal that echoes a huge attacker string, a
Join accepting a name the protocol forbids, a wrong Fetch answer) are printed above it.

``--kinds push_resume,wire`` runs a subset of the case kinds (``KINDS``); ``--skip-known-bugs``
leaves out the cases that hit a bug listed in ``KNOWN_BUGS`` (tests/test_fuzz.py does).
A run is reproducible from its seed (printed) up to timing; ``findings.jsonl`` in the work folder
holds every finding with its messages, base64-encoded.

The package, one concept a module (``bench/fuzz.py`` is the entry point and re-exports):

* ``constants``: the run's limits, the protocol's rules restated, allowed outcomes, case kinds;
* ``strategies``: hypothesis strategies for hostile field values;
* ``oracle``: the client-side validity oracle for push streams;
* ``cases``: the case model, findings, ``KNOWN_BUGS``, how a case is printed and saved;
* ``report``: the run's report, its tables and the printed summary;
* ``session``: the coordinator process, the channel, the two sites' leases, resync/recover;
* ``checks``: sending one case and the checks after it;
* ``gen_rpc``: Join, Heartbeat, Fetch, Leave and Status cases;
* ``gen_push``: push cases (valid pushes mutated, resumed, cancelled, concurrent);
* ``mutations_header``, ``mutations_manifest``, ``mutations_stream``: the push mutation ops;
* ``gen_wire``: raw-byte and oversized cases;
* ``gen_spool``: damaged-spool cases (a restart each);
* ``runner``: ``Fuzzer`` (all of the above), ``run()`` and the command line.
"""

import sys
from pathlib import Path

# The coordinator harness lives in tests/ (coord_harness.py), the wire package at the root.
REPO = Path(__file__).resolve().parent.parent.parent
for _path in (REPO, REPO / "tests"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))
