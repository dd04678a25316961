"""CPU per byte of the data plane, beside the floor measured in the same run.

::

    python -m bench.dataplane [--size 50m] [--sites 2] [--rounds 9] [--warm-up 5]
                              [--codec fp32|int8] [--out DIR]

A real ``coordinator serve`` and ``--sites`` real ``siteclient start`` sites (one FSDP2
trainer each, the residual stack of ``bench.sync``) run a DiLoCo job over mutual TLS on
loopback. Every thread of the coordinator and of each agent is sampled from ``/proc`` (user +
system CPU: the kernel's counters, stable on a shared machine), and each round's CPU is split
into the windows the agents' ``timings.jsonl`` records give:

* **push**: from the first site's push to the last one's end: the coordinator receives,
  checks, digests, spools and folds; the agents digest and send;
* **close**: from the last push's end to the first fetch of theta_{r+1}: the rest of the fold,
  the outer step, publishing;
* **fetch**: the sites fetch theta_{r+1}: the coordinator serves, the agents receive, check
  and write it where the trainers map it.

The coordinator's checkpoint (written in the background) is shown on its own, outside the
data plane's figure. The rounds after the first ``--warm-up`` are measured: a long job's steady
state, in which the coordinator's theta and strategy files and the sites' theta files and
checkpoints are written over the pages of pruned ones (``coordinator.persist.spare_files``).
Then the floor, on the same machine and certificates (``bench.dataplane.floor``): TLS
(AES-GCM through the same gRPC stack), one memcpy, one pass of the payload digest and one
float32 add per byte. The coordinator's
floor is TLS receive + memcpy + digest + add per byte received and TLS send per byte served;
an agent's, TLS send + digest per byte pushed and TLS receive + memcpy + digest per byte
fetched. The last line::

    coord_cpu_s_per_gb=... coord_floor_cpu_s_per_gb=... agent_cpu_s_per_gb=...
    agent_floor_cpu_s_per_gb=... coord_vs_floor=... agent_vs_floor=...

(one line), and ``dataplane.png`` in ``--out`` shows where each side's CPU goes.
"""
