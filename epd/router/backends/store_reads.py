"""Which items of a request prefill reads from the cluster's encoder cache store itself, instead of
having an encoder push them (``prefill_store_reads``).

Encoders say, in each Encode answer, which items' rows are in the store (``store`` handles). The
router keeps the latest of those per content hash (bounded: the oldest go first) with the encoder
that said so. For the next request carrying the item:

- ``auto``: prefill reads it from the store when no encoder on prefill's host is known to hold it
  (the encoder that made or found it is on another host, or out of rotation): a repeated image then
  costs one fetch instead of an encoder's call, its queue and a push across hosts. An encoder on
  prefill's host keeps the item: its push is a shared-memory lease, cheaper than a fetch.
- ``always``: whenever the store has it (the encoders then do nothing for repeats, wherever they are).
- ``never``: encoders push every item, as without a store.

Only prefill workers that say they read the store (``reads_encoder_store`` in their health) get
such handles. A hint that proved wrong (prefill could not read the entry: evicted, damaged, the
store down) is forgotten and the item is encoded the usual way, within the same request.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

from epd.v1 import common_pb2, tensor_pb2

MAX_KNOWN_ITEMS = 16_384  # content hashes remembered (a handle is ~200 bytes)
PREFILL_STORE_READS = ("auto", "always", "never")


class StoreReads:
    def __init__(self, mode: str = "auto", max_items: int = MAX_KNOWN_ITEMS) -> None:
        if mode not in PREFILL_STORE_READS:
            raise ValueError(f"prefill_store_reads must be one of {list(PREFILL_STORE_READS)}, got {mode!r}")
        self.mode, self.max_items = mode, max_items
        self._known: OrderedDict[str, tuple[tensor_pb2.TensorHandle, str]] = OrderedDict()
        self.num_sent = 0  # items sent to prefill as store handles
        self.num_missed = 0  # of those, items prefill could not read (encoded and pushed instead)

    def learn(self, mm_hashes: Iterable[str], handles: Iterable[tensor_pb2.TensorHandle], encoder: str) -> None:
        """An encoder's answer: per item (by content hash), a store handle of its rows, or an empty
        handle where the store does not have them."""
        if self.mode == "never":
            return
        for mm_hash, handle in zip(mm_hashes, handles):
            if handle.WhichOneof("body") != "store":
                self._known.pop(mm_hash, None)
                continue
            self._known[mm_hash] = (handle, encoder)
            self._known.move_to_end(mm_hash)
            if len(self._known) > self.max_items:
                self._known.popitem(last=False)

    def forget(self, mm_hash: str) -> None:
        self._known.pop(mm_hash, None)
        self.num_missed += 1

    def pick(self, request_id: str, mm_hashes: list[str], prefill, encoder_hosts: Callable[[], dict[str, str]]
             ) -> list[common_pb2.EmbeddingPush]:
        """The items (by index) prefill reads from the store, as the pushes its PrefillRequest
        carries. ``prefill``: its worker state; ``encoder_hosts()``: the encoders in rotation,
        address -> host id."""
        if self.mode == "never" or not self._known or not prefill.last_health.reads_encoder_store:
            return []
        stored, encoder_host = [], encoder_hosts() if self.mode == "auto" else {}
        for index, mm_hash in enumerate(mm_hashes):
            known = self._known.get(mm_hash)
            if known is None:
                continue
            handle, encoder = known
            if self.mode == "auto" and encoder_host.get(encoder) == prefill.host_id:
                continue  # an encoder beside prefill holds it: its push is a shared-memory lease
            stored.append(common_pb2.EmbeddingPush(request_id=request_id, item_index=index, embedding=handle))
        self.num_sent += len(stored)
        return stored
