"""Where a trainer rank sits in a site of several hosts, and what its node passes between them.

A multi-node site runs one agent per host (``siteclient start --nnodes N --node-rank k``). The
*driver* is the lowest rank on node 0, whose agent holds the site's lease: it alone asks for
tasks and hands over node 0's part, as rank 0 does on one host. Each node's lowest rank is its
*leader*: the only one of its node that speaks to its own agent (``site_client.agent.node_agent``).
Which rank lands on which node is the rendezvous's choice, so each rank learns it from its own
agent's ``hello`` and the ranks compare notes once.

Everything that crosses between nodes goes over the trainers' process group as UTF-8 text in
uint8 tensors (JSON where it has fields; no pickle): the task node 0's agent handed out (its
theta's version and hash, the lease), and each node's part of the update
(``site_client.agent.node_parts``). A site on one host has one node, and none of this runs.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
import torch.distributed as dist


def node_ranks_problem(node_of: list[int], count: int) -> str | None:
    """What is wrong with the node ranks the site's hosts gave (``node_of``: each trainer
    rank's host's ``--node-rank``), or None. Two hosts that gave the same ``--node-rank`` land
    in one rendezvous without complaint: it numbers hosts itself, and only this tells them
    apart."""
    given = sorted(set(node_of))
    if given == list(range(count)):
        return None
    missing = sorted(set(range(count)) - set(given))
    why = (
        f"so no host is node {', '.join(map(str, missing))}: two hosts were given the same "
        "--node-rank"
        if missing
        else "some outside 0..N-1"
    )
    return (
        f"the site's {count} hosts gave node ranks {given}, {why}; give each host of the "
        f"site its own --node-rank of 0..{count - 1}"
    )


class SiteNodes:
    """This rank's node, its node's leader and the site's driver.

    Parameters
    ----------
    hello
        This rank's agent's ``hello`` reply (``node``, ``nodes``).
    rank, world_size
        The rank in the site's process group, and its size.
    """

    def __init__(self, hello: dict, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.count = int(hello.get("nodes", 1))
        self.node = int(hello.get("node", 0))
        if self.count <= 1:
            self.node_of = [0] * world_size
        else:
            mine = torch.tensor([self.node], dtype=torch.int64)
            every = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
            dist.all_gather(every, mine)
            self.node_of = [int(t.item()) for t in every]
            problem = node_ranks_problem(self.node_of, self.count)
            if problem:
                raise ValueError(problem)
        self.driver = self.node_of.index(0)
        self.leader = self.node_of.index(self.node)
        self._boxes: tuple[list | None, list] | None = None  # (this rank's, every rank's)

    @property
    def multi(self) -> bool:
        return self.count > 1

    @property
    def is_driver(self) -> bool:
        return self.rank == self.driver

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader

    def ranks_here(self) -> list[int]:
        """The ranks on this rank's node."""
        return [r for r, n in enumerate(self.node_of) if n == self.node]

    # ---- text between ranks ---------------------------------------------------------------

    def broadcast_text(self, text: str) -> str:
        """The driver's ``text`` on every rank (the theta file's path, the task; no pickle)."""
        data = text.encode() if self.is_driver else b""
        size = torch.tensor([len(data)], dtype=torch.int64)
        dist.broadcast(size, src=self.driver)
        raw = torch.zeros(int(size.item()), dtype=torch.uint8)
        if self.is_driver and data:
            raw.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        dist.broadcast(raw, src=self.driver)
        return bytes(raw.tolist()).decode()

    def gather_texts(self, text: str) -> list[str]:
        """Every rank's ``text``, by rank, on every rank."""
        data = text.encode()
        size = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(sizes, size)
        longest = max(int(s.item()) for s in sizes)
        raw = torch.zeros(longest, dtype=torch.uint8)
        if data:
            raw[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        every = [torch.zeros(longest, dtype=torch.uint8) for _ in range(self.world_size)]
        dist.all_gather(every, raw)
        return [
            bytes(t[: int(s.item())].tolist()).decode() for t, s in zip(every, sizes, strict=True)
        ]

    # ---- what the nodes share -------------------------------------------------------------

    def shared_hello(self, hello: dict) -> dict:
        """``hello`` with the driver's job config and checkpoint place (the other nodes'
        agents never joined, so they know neither)."""
        keys = ("job_config", "checkpoint_url", "checkpoint_dir")
        shared = json.loads(self.broadcast_text(json.dumps({k: hello.get(k, "") for k in keys})))
        return {**hello, **shared}

    def theta_here(
        self, driver_path: str, reply: dict, agent, boxes: list | None
    ) -> tuple[str, dict]:
        """This node's copy of the task's theta, and the task as the driver had it (version,
        theta hash, lease). Node 0 maps the driver's file; on node k the leader has its agent
        ``fetch`` the bytes of the ``boxes`` (each rank's own: ``[name, offset, shape]``) of
        its node's ranks, and every rank of the node maps that file."""
        keys = ("version", "theta_hash", "lease")
        task = json.loads(self.broadcast_text(json.dumps({k: reply.get(k) for k in keys})))
        if self._boxes is None or self._boxes[0] is not boxes:
            # Each rank's boxes do not change from round to round: gathered once per model.
            self._boxes = (boxes, [json.loads(t) for t in self.gather_texts(json.dumps(boxes))])
        every = self._boxes[1]
        mine = ""
        if self.is_leader and self.node == 0:
            mine = driver_path
        elif self.is_leader:
            # None (a rank that did not say, e.g. streaming outer steps): theta whole.
            ours = [every[r] for r in self.ranks_here()]
            here = None if None in ours else [b for rank_boxes in ours for b in rank_boxes]
            mine = agent.call("fetch", boxes=here, **task)["theta_path"]
        return self.gather_texts(mine)[self.leader], task

    def submit_parts(
        self, agent, paths: list[str], task: dict, version: int, durable: bool, given: dict
    ) -> None:
        """Each node's agent encodes its own ranks' files (``paths``, on the leaders); every
        node learns every part; node 0's agent queues the update (it completes it), the
        others push their parts under the lease in ``given`` (the driver's task)."""
        where = {"round": task["round"], "data_unit": task["data_unit"]}
        mine = ""
        if self.is_leader:
            mine = json.dumps(agent.call("encode", paths=paths, **where))
        replies = [json.loads(t) for t in self.gather_texts(mine) if t]
        layout = [r["part"] for r in replies]
        # Node 0's lease as it stood at the hand-off (newer than the task's, if it re-joined).
        lease = next((r["lease"] for r in replies if "lease" in r), given["lease"])
        upload_id, weight = self.agreed(task, layout)
        task = {**task, "weight": weight}
        if self.is_driver:
            agent.call(
                "submit", paths=paths, durable=durable, layout=layout, upload_id=upload_id, **task
            )
        elif self.is_leader:
            agent.call(
                "push_part",
                layout=layout,
                upload_id=upload_id,
                base_version=version,
                lease=lease,
                **task,
            )
            for path in paths:  # encoded into the part its agent holds
                Path(path).unlink(missing_ok=True)

    def agreed(self, task: dict, layout: list) -> tuple[str, float]:
        """The upload id and the driver's weight, the same for every node's part of this
        update. The id is the layout's digest: trainers restarted after their hand-off hand
        the same bytes over again (raw updates, their state restored from the checkpoint),
        and their hosts then push into the same upload rather than start another."""
        text = json.dumps(sorted(layout, key=lambda p: p["node"]), sort_keys=True).encode()
        digest = hashlib.sha256(text).hexdigest()[:24]
        unit = f"-{task['data_unit']}" if task["data_unit"] else ""
        mine = {"upload_id": f"r{task['round']}{unit}-{digest}", "weight": task["weight"]}
        theirs = json.loads(self.broadcast_text(json.dumps(mine)))
        return str(theirs["upload_id"]), float(theirs["weight"])
