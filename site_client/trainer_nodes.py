"""Where a trainer rank sits in a site of several hosts, and what its node passes between them.

A multi-node site runs one agent per host (``siteclient start --nnodes N --node-rank k``). The
*driver* is the lowest rank on node 0, whose agent holds the site's lease: it alone asks for
tasks and hands over node 0's part, as rank 0 does on one host. Each node's lowest rank is its
*leader*: the only one of its node that speaks to its own agent (``site_client.node_agent``).
Which rank lands on which node is the rendezvous's choice, so each rank learns it from its own
agent's ``hello`` and the ranks compare notes once.

Everything that crosses between nodes goes over the trainers' process group as UTF-8 text in
uint8 tensors (JSON where it has fields; no pickle): the task node 0's agent handed out (its
theta's version and hash, the lease), and each node's part of the update
(``site_client.node_parts``). A site on one host has one node, and none of this runs.
"""

from __future__ import annotations

import json
import uuid

import torch
import torch.distributed as dist


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
        self.driver = self.node_of.index(0)
        self.leader = self.node_of.index(self.node)

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
        """The driver's ``text`` on every rank."""
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

    def theta_here(self, driver_path: str, task: dict, fetch) -> str:
        """This node's copy of the task's theta: the driver's file on node 0, else the one
        this node's leader has its agent ``fetch(task)`` (every rank of the node maps it)."""
        mine = ""
        if self.is_leader:
            mine = driver_path if self.node == 0 else fetch(task)
        paths = self.gather_texts(mine)
        return paths[self.leader]

    def upload_id(self, round_number: int) -> str:
        """One id, the driver's, for every node's part of this update."""
        return self.broadcast_text(f"r{round_number}-{uuid.uuid4().hex[:16]}")
