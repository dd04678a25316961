"""Sites of different speeds: blocking DiLoCo, streaming and async side by side.

::

    python -m bench.hetero [--quick] [--runs blocking,streaming,async,streaming-kill,async-kill]
                           [--slowdown 2] [--down-s 5] [--rounds 6] [--inner-steps 80]
                           [--out DIR] [--png PATH]

Each run is a real job, as in ``bench.utilisation``: a ``coordinator serve`` and three
``siteclient start`` sites (one FSDP2 trainer each, ``examples/gpt_diloco/train.py``, the
0.87 M-parameter GPT) over mutual TLS, every site dialling the coordinator through its own
``bench.relay.Relay`` (20 ms each way, 50 Mbit/s per direction). Site 2 is ``--slowdown``
times slower: its trainer sleeps (F - 1) x each inner step's measured compute inside the step,
as a slower accelerator would take longer (train.py ``--slowdown``).

Runs, the same outer rounds and inner steps (``--rounds`` of H = ``--inner-steps``):

- ``blocking``: DiLoCo; every round waits for all three sites.
- ``streaming``: ``[streaming] fragments = 2, delay_steps = 3/4 of H/P``; every round waits for
  all three sites (``min_sites = 3``), the trainers wait for a late round at step tau.
- ``async``: the same streaming job with ``min_sites = 2``, a grace of the recent arrival
  spread, at most 0.3 s (a tenth of a fast site's round or less), ``merge = "when_ready"``
  (the trainers train on past tau while a round is late), ``late_discount = 0.5`` and
  ``max_staleness = 3`` (an update that misses its round folds into the next round of its
  fragment still open, up to three versions of it behind, at half weight per version).
- ``streaming-kill``, ``async-kill``: the same, with site 1 (a fast one) killed with SIGKILL,
  agent and trainers, once half the coordinator rounds have closed, and started again on the
  same run dir ``--down-s`` seconds later.

What is measured
----------------
Each site's compute utilisation (CU: seconds in step bodies over the wall time from its first
step to its last, ``bench.utilisation``), its longest wait per task, the tokens every trainer
stepped over (``steps`` records, cancelled tasks included) and the tokens counted into theta
(the coordinator's ``update`` events: a task's inner steps times a late update's discount,
times batch x sequence length). Every theta the coordinator checkpoints is kept (hard-linked
as it appears) and evaluated afterwards on held-out text (``examples.gpt_diloco.evaluate``),
which gives each run's validation loss over wall time and over counted tokens. The runs are
compared at equal wall time (the shortest run's span: the newest theta each run had
checkpointed by then) and at equal counted tokens, both from the runs without a kill; a killed
site's own CU (its downtime in it) is marked and left out of a run's lowest.

Output: a line per run, the table, the plot (``hetero.png`` in ``--out``, or ``--png``) and
last ``async_cu_min=... streaming_cu_min=... blocking_cu_min=...
async_loss_vs_streaming_pct=... async_tokens_vs_streaming=...
async_loss_vs_streaming_equal_tokens_pct=...`` (pct: 100 * (async - streaming) / streaming, at
equal wall time unless said), and with the kill runs ``streaming_kill_cu_min=...
async_kill_cu_min=... async_kill_loss_vs_streaming_kill_pct=...``. About 6 minutes on 2 cores;
``--quick`` about 3.
"""
