"""Peer replicas over torch.distributed: each rank's resident image is kept
in the shared memory of ranks on other nodes, so a replaced node restores
from a peer's RAM (``LoadStats.source == "peer"``) rather than from storage.

The images travel on a gloo process group of their own
(``torch.distributed.new_group(backend="gloo")``), never the training's,
from one background thread per rank that handles the steps in the order
they were saved: every rank takes part in every step's exchange (a rank
with nothing to send says so), so the group's point-to-point messages pair
up on every rank. Node identity comes from ``ACP_NODE_ID``, else the host
name. Rank r's image goes to ``replicas`` ranks: the same local rank on
each of the next ``replicas`` nodes (wrapping around).

Every image travels with the xxh3 quick sum of each chunk, sent right
after its bytes: the holder seals its replica with them, and the step
counts as *replicated* (``wait_replicated``) without anyone hashing the
image with blake3 first. The blake3 digests of its chunks follow in the
same exchange when the sender has them: a step being persisted is hashed
by its flush anyway (the send shares that hash), and the holder binds its
replica to them; a RAM snapshot (``persist=False``) is not hashed for its
replicas, which keep their sums alone. Before ``load`` uses a replica,
every chunk must give its quick sum, and its digests must be the ones
wanted (the committed index's, when the step is committed); a replica of
a committed step that has no digests, or a chunk that does not give its
sum, is checked against the digests with blake3 (``acp-core``'s one
verified reader), and a replica that fails is skipped with a log line
naming it, and the next source is used. The quick sums
catch any accidental change of the bytes (in transit, in a replica slot)
but for a chance of 2^-64 per chunk; they are not a defence against a
rank of the job that forges bytes and sums (see ``acp.replica`` in
docs/distributed.md).

Every wait of the exchange is bounded by the group's timeout
(``Checkpointer(replica_timeout=)``, ``ACP_REPLICA_TIMEOUT``, default
60 s): a peer that died or stopped answering fails that step's
replication (logged on the ``acp`` logger; ``wait_replicated`` raises),
never the training. A failed exchange may leave half a message in the
group, so replication then stays off (later steps fail at once, naming
the first failure) until the next ``Checkpointer``; the steps stay
protected by storage as their persist policy says.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import queue
import socket
import threading
import warnings
from collections.abc import Sequence
from concurrent.futures import Future
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from . import _acp
from ._plan import ref_names_cached

__all__ = ["DEFAULT_TIMEOUT", "TorchReplicas", "node_id", "placement"]

logger = logging.getLogger("acp")

DEFAULT_TIMEOUT = 60.0
"""Seconds one replica exchange waits for a peer, by default."""


def node_id() -> str:
    """This process's node: ``ACP_NODE_ID`` when set, else the host name."""
    return os.environ.get("ACP_NODE_ID") or socket.gethostname()


def placement(nodes: list[str], replicas: int) -> dict[int, list[int]]:
    """The holders of each rank's replicas, given each rank's node: the
    same local rank (modulo that node's size) on the next ``replicas``
    nodes, in node order of first appearance; never a rank of its own
    node. Fewer holders than ``replicas`` when there are not enough nodes."""
    order = list(dict.fromkeys(nodes))
    members = {n: [r for r, m in enumerate(nodes) if m == n] for n in order}
    out: dict[int, list[int]] = {}
    for r, n in enumerate(nodes):
        i = order.index(n)
        local = members[n].index(r)
        holders = []
        for k in range(1, min(replicas, len(order) - 1) + 1):
            other = members[order[(i + k) % len(order)]]
            holders.append(other[local % len(other)])
        out[r] = holders
    return out


MAX_GATHERED = 64 << 20
"""The most bytes of JSON a rank may contribute to an all-gather."""


def all_gather_json(value: Any, group: dist.ProcessGroup) -> list[Any]:
    """Every rank's ``value`` (plain JSON values), gathered over ``group``.
    As JSON, never pickle (``all_gather_object``): a load must not run
    what another process sent. A rank that claims more than
    ``MAX_GATHERED`` bytes, or sends what is not JSON, fails the call."""
    data = json.dumps(value).encode()
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=group)
    lengths = [int(s.item()) for s in sizes]
    if any(not 0 < n <= MAX_GATHERED for n in lengths):
        raise RuntimeError(
            f"all-gather of ranks' inventories: a rank claims {max(lengths)} bytes "
            f"(the limit is {MAX_GATHERED})"
        )
    longest = max(lengths)
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(out, mine, group=group)
    return [json.loads(t[:n].numpy().tobytes()) for t, n in zip(out, lengths)]


def _ints(values: Any, what: str) -> list[int]:
    if not isinstance(values, list) or not all(type(v) is int for v in values):
        raise RuntimeError(f"a rank's replica inventory: {what} is not a list of integers")
    return values


MAX_HEADER = 100 << 20
"""The largest safetensors header :func:`_image_refers_elsewhere` reads."""


def _image_refers_elsewhere(image: memoryview, step: int) -> bool | None:
    """Whether the safetensors image ``image`` (of ``step``) has a values
    tree that refers to tensors its header does not list; None when its
    header cannot be read."""
    try:
        if len(image) < 8:
            return None
        n = int.from_bytes(image[:8], "little")
        if n > min(len(image) - 8, MAX_HEADER):
            return None
        header = json.loads(bytes(image[8 : 8 + n]))
        values = header.get("__metadata__", {}).get("acp.values")
        if not isinstance(values, str):
            return False
        names = {k for k in header if k != "__metadata__"}
        return bool(ref_names_cached(values, step) - names)
    except (ValueError, AttributeError, _acp.AcpError):
        return None


def _frombuffer(view: memoryview) -> torch.Tensor:
    # A read-only slot view: gloo only reads what it sends.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(view, dtype=torch.uint8)


def _chunks(image: _acp.ReplicaImage) -> int:
    """The chunk count of ``image``: one quick sum, one digest each."""
    _, _, n, chunk, _ = image.meta()
    return -(-int(n) // int(chunk))


class _Incoming:
    """An image being received from rank ``src`` into ``receipt``."""

    def __init__(self, src: int, receipt: _acp.Receipt, data: Any, work: Any, digests: int):
        self.src = src
        self.receipt = receipt
        self.data = data  # the tensor over receipt's buffer, until received
        self.work = work
        self.digests = digests


class TorchReplicas:
    """The replica exchange of one rank. Collective to create (every rank
    of the default group, in the same order as its other collectives)."""

    def __init__(self, replicas: int, timeout: float = DEFAULT_TIMEOUT) -> None:
        if not dist.is_initialized():
            raise RuntimeError("replicas need torch.distributed to be initialised")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.timeout = timeout
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
        if not isinstance(group, dist.ProcessGroup):
            raise RuntimeError("this rank is not in the replica group")
        self.group: dist.ProcessGroup = group
        nodes = all_gather_json(node_id(), self.group)
        self.nodes: list[str] = [str(n) for n in nodes]
        self.holders = placement(self.nodes, replicas)
        self.sources = sorted(r for r, hs in self.holders.items() if self.rank in hs)
        self._engine: _acp.Engine | None = None
        self._jobs: queue.Queue[tuple[int, Future[list[int]]] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._broken: str | None = None  # the first failed exchange

    def attach(self, engine: _acp.Engine, sends: list[Any] | None = None) -> None:
        """Starts the background exchange for ``engine``; it first waits
        for ``sends`` (a restore's, posted but not yet complete)."""
        self._engine = engine
        self._thread = threading.Thread(
            target=self._run, args=(sends or [],), name=f"acp-replicas-r{self.rank}", daemon=True
        )
        self._thread.start()

    def replicate(self, step: int) -> Future[list[int]]:
        """Queues the exchange of ``step``: sends this rank's image to its
        holders and receives its sources' images. The future's result is
        the ranks that now hold this rank's image."""
        fut: Future[list[int]] = Future()
        self._jobs.put((step, fut))
        return fut

    def close(self) -> None:
        """Finishes the queued exchanges and stops the thread."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None

    def _run(self, sends: list[Any]) -> None:
        try:
            self._wait(sends)
        except BaseException as e:  # the restore's sends: reported, as an exchange's
            self._broken = f"the restore's sends failed: {e}"
            logger.warning(
                "acp: rank %d: the restore's replica sends failed, replicas are off until "
                "the next Checkpointer: %s",
                self.rank,
                e,
            )
        # The Thread keeps its arguments for as long as it runs: emptied, the
        # list no longer holds the restore's pinned replica images.
        sends.clear()
        while (job := self._jobs.get()) is not None:
            step, fut = job
            if self._broken is not None:
                fut.set_exception(
                    RuntimeError(f"replication of step {step}: off after {self._broken}")
                )
                continue
            try:
                self._exchange(step, fut)
            except BaseException as e:  # reported through the future, if not done
                self._broken = f"step {step}'s exchange failed: {e}"
                if fut.done():
                    # Replicated (sealed with its sums); its digests were not.
                    logger.warning(
                        "acp: rank %d: the digests of step %d were not exchanged, replicas "
                        "are off until the next Checkpointer: %s",
                        self.rank,
                        step,
                        e,
                    )
                    continue
                logger.warning(
                    "acp: rank %d: replication of step %d failed, replicas are off until "
                    "the next Checkpointer (the step is protected by storage only): %s",
                    self.rank,
                    step,
                    e,
                )
                fut.set_exception(e)

    # --- the wire, per image: a header of 5 int64 (rank, step, len,
    # chunk_bytes, chunk count n), len -1 for "nothing"; then the image,
    # received straight into the memory that keeps it (a replica slot, or
    # the buffer the load verifies and reads); then the sums trailer: the
    # count of quick sums (an int64, little-endian: n, or 0 when the sender
    # has none) and n quick sums (8 bytes each, zeros when none); then the
    # digests trailer: an int64 flag (1: digests follow, 0: none) and n
    # digests (32 bytes each, zeros when none).
    #
    # In an exchange the holder seals the replica with the sums alone, and
    # the step counts as replicated; the digests trailer comes after, once
    # the sender has digests (its step is being persisted: the flush hashes
    # it anyway) or with none (a RAM snapshot is not hashed for its
    # replicas), and binds the replica to them. A restore's transfer sends
    # both trailers at once and the receiver seals with both. Nothing uses
    # an image before its bytes were checked against the sums (bound to
    # digests that are the ones wanted, or alone for a step not committed)
    # or the digests.

    def _isend(self, to: int, image: _acp.ReplicaImage | None, rank: int, step: int) -> list[Any]:
        """Posts the header and the bytes of ``image`` (``None``: "nothing"
        of ``rank``'s ``step``) to rank ``to``; its trailers follow
        (``_isend_sums``, ``_isend_digests``)."""
        if image is None:
            header = torch.tensor([rank, step, -1, 0, 0], dtype=torch.int64)
            return [dist.isend(header, dst=to, group=self.group), header]
        r, s, n, chunk, _ = image.meta()
        header = torch.tensor([r, s, n, chunk, _chunks(image)], dtype=torch.int64)
        data = _frombuffer(image.buffer())
        works: list[Any] = [
            dist.isend(header, dst=to, group=self.group),
            dist.isend(data, dst=to, group=self.group),
        ]
        # Keep the tensors (and the pinned slot) alive until sent.
        works.append((header, data, image))
        return works

    def _isend_sums(self, to: int, sums: bytes, n: int) -> list[Any]:
        """Posts the sums trailer of an image of ``n`` chunks: ``sums`` is
        its quick sums (8 bytes each), or empty."""
        count = n if len(sums) == 8 * n else 0
        raw = bytearray(count.to_bytes(8, "little")) + (sums if count else bytes(8 * n))
        t = torch.frombuffer(raw, dtype=torch.uint8)
        return [dist.isend(t, dst=to, group=self.group), t]

    def _isend_digests(self, to: int, digests: bytes | None, n: int) -> list[Any]:
        """Posts the digests trailer of an image of ``n`` chunks:
        ``digests`` (32 bytes each), or ``None``."""
        flag = 1 if digests is not None and len(digests) == 32 * n else 0
        body = digests if digests is not None and flag else bytes(32 * n)
        raw = bytearray(flag.to_bytes(8, "little")) + body
        t = torch.frombuffer(raw, dtype=torch.uint8)
        return [dist.isend(t, dst=to, group=self.group), t]

    def _recv_sums(self, src: int, n: int) -> bytes:
        """The sums trailer from ``src``: its quick sums, or empty."""
        t = torch.empty(8 + 8 * n, dtype=torch.uint8)
        dist.recv(t, src=src, group=self.group)
        raw = t.numpy().tobytes()
        return raw[8:] if int.from_bytes(raw[:8], "little") == n else b""

    def _recv_digests(self, src: int, n: int) -> bytes | None:
        """The digests trailer from ``src``: its digests, or ``None``."""
        t = torch.empty(8 + 32 * n, dtype=torch.uint8)
        dist.recv(t, src=src, group=self.group)
        raw = t.numpy().tobytes()
        return raw[8:] if int.from_bytes(raw[:8], "little") == 1 else None

    def _irecv(self, src: int, begin: Any, rank: int, step: int) -> _Incoming | None:
        """Receives the header from ``src``, which must describe ``rank``'s
        image of ``step`` (or its absence), and posts the receive of the
        image into ``begin(rank, step, len, chunk_bytes)``'s buffer (a
        ``_acp.Receipt``); ``None`` when ``src`` has nothing. A header of
        another rank or step (a stale or buggy peer, a stream out of step)
        or whose chunk count is not its length's is refused before
        anything is sized by it."""
        header = torch.empty(5, dtype=torch.int64)
        dist.recv(header, src=src, group=self.group)
        r, s, n, chunk, nd = (int(v) for v in header.tolist())
        nothing = n == -1 and chunk == 0 and nd == 0
        if (r, s) != (rank, step) or not (
            nothing or (n >= 0 and chunk > 0 and nd == -(-n // chunk))
        ):
            raise RuntimeError(
                f"rank {self.rank}: the replica header from rank {src} says rank {r}'s step "
                f"{s} ({n} bytes, chunks of {chunk}, {nd} digests); expected rank {rank}'s "
                f"image of step {step}, or none"
            )
        if nothing:
            return None
        receipt = begin(r, s, n, chunk)
        data = torch.frombuffer(receipt.buffer(), dtype=torch.uint8)
        work = dist.irecv(data, src=src, group=self.group)
        return _Incoming(src, receipt, data, work, nd)

    def _received(self, inc: _Incoming) -> None:
        """Waits for ``inc``'s image to arrive; nothing writes into its
        buffer afterwards."""
        inc.work.wait()
        # The receipt seals only once nothing can write into its buffer.
        inc.data = inc.work = None

    def _finish_sums(self, inc: _Incoming) -> None:
        """Waits for ``inc``'s image and its sums, and seals it with the
        sums alone (its digests follow: ``_finish_digests``)."""
        self._received(inc)
        sums = self._recv_sums(inc.src, inc.digests)
        if not sums:
            raise RuntimeError(
                f"rank {self.rank}: rank {inc.src} sent {inc.receipt!r} without quick sums"
            )
        inc.receipt.finish(b"", sums)

    def _finish_digests(self, inc: _Incoming, step: int) -> None:
        """Receives the digests that follow ``inc``'s sums, if any, and
        binds the replica sealed with those sums to them."""
        digests = self._recv_digests(inc.src, inc.digests)
        e = self._engine
        if (
            digests is not None
            and e is not None
            and not e.add_replica_digests(inc.src, step, digests)
        ):
            logger.debug(
                "acp: rank %d: rank %d's digests of step %d not recorded (replica gone)",
                self.rank,
                inc.src,
                step,
            )

    def _finish_whole(self, inc: _Incoming) -> None:
        """Waits for ``inc``'s image and both trailers, and seals it with
        them (a restore's transfer)."""
        self._received(inc)
        sums = self._recv_sums(inc.src, inc.digests)
        digests = self._recv_digests(inc.src, inc.digests)
        inc.receipt.finish(digests or b"", sums)

    @staticmethod
    def _wait(works: list[Any]) -> None:
        for w in works:
            if hasattr(w, "wait"):
                w.wait()

    def _exchange(self, step: int, fut: Future[list[int]]) -> None:
        assert self._engine is not None
        e = self._engine
        # Kept resident until the exchange ends (newer saves seal meanwhile),
        # so that it can protect an image this rank still holds.
        held = e.hold_replicating(step)
        # The flush of this step (a persisted save) pauses while its bytes
        # travel: replicated first, the sooner of its two protections.
        e.exchange_started(step)
        try:
            image, incoming, holders = self._send_and_receive(step)
        finally:
            e.exchange_ended(step)
            if held:
                e.release_replicating(step)
        # Replicated: every holder sealed this rank's image with its sums.
        fut.set_result(holders)
        self._follow_with_digests(step, image, incoming)

    def _send_and_receive(
        self, step: int
    ) -> tuple[_acp.ReplicaImage | None, list[_Incoming | None], list[int]]:
        """Sends this rank's image of ``step`` and its sums to its holders
        and receives its sources' into replica slots, sealed with their
        sums; returns the image, what was received and the holders."""
        assert self._engine is not None
        e = self._engine
        try:
            image: _acp.ReplicaImage | None = e.pin_resident(step)
        except _acp.CheckpointNotFound:
            image = None
        holders = self.holders[self.rank]
        works: list[Any] = []
        for h in holders:
            works += self._isend(h, image, self.rank, step)
        # Every source posted its header before anything that can wait.
        incoming = [self._irecv(src, e.begin_replica, src, step) for src in self.sources]
        if image is not None:
            # Summed (unless a flush or the snapshot's own sum did) while the
            # bytes travel: xxh3, several times cheaper than blake3.
            sums = e.resident_sums(image)
            n = _chunks(image)
            for h in holders:
                works += self._isend_sums(h, sums, n)
        for inc in incoming:
            if inc is not None:
                self._finish_sums(inc)
        self._wait(works)
        if image is None:
            return None, incoming, []
        # Every holder has it: this rank's own image of the step stays
        # resident until a newer one is protected (or committed), so a
        # node loss finds it on the surviving node.
        if holders:
            e.protect(step)
        return image, incoming, list(holders)

    def _follow_with_digests(
        self, step: int, image: _acp.ReplicaImage | None, incoming: list[_Incoming | None]
    ) -> None:
        """After an exchange: sends the digests of this rank's image to its
        holders (when it has some: see ``Engine.digests_to_send``) and
        binds the replicas received to their senders' digests."""
        assert self._engine is not None
        works: list[Any] = []
        if image is not None:
            # A held save waits for its decision, well within the time its
            # holders wait for these digests.
            got = self._engine.digests_to_send(image, self.timeout / 4)
            n = _chunks(image)
            for h in self.holders[self.rank]:
                works += self._isend_digests(h, None if got is None else got[0], n)
        for inc in incoming:
            if inc is not None:
                self._finish_digests(inc, step)
        self._wait(works)

    # --- restore

    def restore(self, group: Sequence[int] | None = None) -> int | None:
        """Collective: agrees on the newest step every rank can restore
        (from its own RAM, storage, or a replica), has each replica a rank
        needs sent to it (offered to its engine, verified by the load), and
        returns the step; None when there is none. Call ``load(step)`` on
        every rank next.

        A step that is not committed has no index to find the tensors of a
        ``replicated`` state that other ranks wrote: each rank of this
        rank's replica ``group`` (default: every rank) whose image of the
        step is not readable on this node is then sent to it as well."""
        assert self._engine is not None
        self.close()  # no exchange may interleave with the restore's messages
        e = self._engine
        inv = {
            "local": e.resident_steps(),
            "held": [v for r, s, *_ in e.replicas() for v in (r, s)],
            "committed": e.steps(),
        }
        all_inv = [
            {k: _ints(i.get(k) if isinstance(i, dict) else None, k) for k in inv}
            for i in all_gather_json(inv, self.group)
        ]
        committed = {s for i in all_inv for s in i["committed"]}
        held: dict[tuple[int, int], list[int]] = {}
        for h, i in enumerate(all_inv):
            pairs = i["held"]
            for r, s in zip(pairs[::2], pairs[1::2]):
                held.setdefault((r, s), []).append(h)
        steps = committed | {s for i in all_inv for s in i["local"]} | {s for _, s in held}

        def has(r: int, s: int) -> bool:
            return s in committed or s in all_inv[r]["local"] or (r, s) in held

        step = max(
            (s for s in steps if all(has(r, s) for r in range(self.world_size))), default=None
        )
        if step is None:
            self.attach(e)
            return None
        # (holder, to, rank): ``holder`` sends ``rank``'s image to ``to``.
        transfers = [
            (held[(r, step)][0], r, r)
            for r in range(self.world_size)
            if step not in all_inv[r]["local"] and (r, step) in held
        ]
        if step not in committed:
            transfers += self._shares(step, group, all_inv, held)
        works: list[Any] = []
        for h, to, r in transfers:
            if self.rank != h:
                continue
            image = self._own_image(step) if r == h else e.pin_replica(r, step)
            works += self._isend(to, image, r, step)
            if image is not None:
                # As held: sums, and digests when they came (a rank's own
                # image of a step not committed: its sums alone).
                n = _chunks(image)
                got = None if r == h else e.digests_to_send(image, 0.0)
                works += self._isend_sums(to, e.resident_sums(image), n)
                works += self._isend_digests(to, None if got is None else got[0], n)
        for h, to, r in transfers:
            if self.rank == to:
                # Received into the buffer the load verifies and reads, one
                # image at a time: two from the same holder arrive in order.
                inc = self._irecv(h, functools.partial(e.begin_peer_image, h), r, step)
                if inc is not None:
                    self._finish_whole(inc)
        # This rank's sends complete on the replica thread (which waits for
        # them before any exchange), so its own load overlaps them.
        self.attach(e, sends=works)
        return step

    def _own_image(self, step: int) -> _acp.ReplicaImage | None:
        """This rank's resident image of ``step``, pinned; None when it is
        gone (sent as "nothing": the load then names what is missing)."""
        assert self._engine is not None
        try:
            image: _acp.ReplicaImage = self._engine.pin_resident(step)
        except _acp.CheckpointNotFound:
            return None
        return image

    def _refers_elsewhere(self, step: int) -> dict[int, bool]:
        """For each image of ``step`` this rank has (its own, resident, and
        the replicas it keeps of other ranks), whether it refers to tensors
        it does not hold (other ranks wrote them: a ``replicated`` save),
        by the rank whose image it is. Read from each image's header,
        unverified: it only decides which images travel, and the load
        verifies every byte it uses."""
        assert self._engine is not None
        e = self._engine
        out: dict[int, bool] = {}
        images: list[tuple[int, Any]] = []
        own = self._own_image(step)
        if own is not None:
            images.append((self.rank, own))
        for r, s, *_ in e.replicas():
            if s == step and r != self.rank:
                try:
                    images.append((r, e.pin_replica(r, step)))
                except _acp.AcpError:
                    continue
        for r, image in images:
            if image is None:
                continue
            refers = _image_refers_elsewhere(image.buffer(), step)
            if refers is not None:
                out[r] = out.get(r, False) or refers
        return out

    def _shares(
        self,
        step: int,
        group: Sequence[int] | None,
        all_inv: list[dict[str, list[int]]],
        held: dict[tuple[int, int], list[int]],
    ) -> list[tuple[int, int, int]]:
        """Collective, for ``step``, which is not committed: the transfers
        ``(holder, to, rank)`` that bring each rank the images of the ranks
        of its replica group whose files hold tensors it refers to, when
        they are not readable on its node (the rank's own slot there, or a
        replica slot there). Each rank says, for each image of the step it
        has (its own, the replicas it keeps), whether that image refers to
        tensors it does not hold, and names its group."""
        told = self._refers_elsewhere(step)
        mine = {
            "refers": [r for r, v in sorted(told.items()) if v],
            "told": sorted(told),
            "group": sorted(set(group)) if group is not None else list(range(self.world_size)),
        }
        said = all_gather_json(mine, self.group)
        groups: list[list[int]] = []
        refers: list[bool | None] = [None] * self.world_size
        for i in said:
            got = {k: _ints(i.get(k) if isinstance(i, dict) else None, k) for k in mine}
            if any(not 0 <= r < self.world_size for k in got for r in got[k]):
                raise RuntimeError(f"a rank's answer names ranks outside the job: {got}")
            groups.append(got["group"])
            for r in got["told"]:
                refers[r] = bool(refers[r]) or r in got["refers"]

        def readable(to: int, r: int) -> bool:
            node = self.nodes[to]
            if self.nodes[r] == node and step in all_inv[r]["local"]:
                return True
            return any(self.nodes[h] == node for h in held.get((r, step), []))

        out: list[tuple[int, int, int]] = []
        for to in range(self.world_size):
            # Nobody could tell (no image of it read): it may need them.
            if refers[to] is False:
                continue
            for r in groups[to]:
                if r == to or readable(to, r):
                    continue
                if step in all_inv[r]["local"]:
                    out.append((r, to, r))
                elif (r, step) in held:
                    out.append((held[(r, step)][0], to, r))
        return out
