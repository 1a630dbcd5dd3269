"""The pinned staging ring host appends copy from.

A copy from page-locked memory is queued and returns at once, so each host row goes
through a slot of its own until the copy has run: slots are reused round the ring, and the
host waits only when it comes round to a slot whose copy may still be in flight.
"""

from __future__ import annotations

import numpy as np

from ..driver.calls import drv
from ..driver.device import Device
from ..driver.memory import pinned_empty
from ..driver.stream import Event

__all__ = ["SLOT_GROUP", "STAGING_SLOTS", "StagingRing"]

STAGING_SLOTS = 64
SLOT_GROUP = 8  # staging slots per event


class StagingRing:
    """``slots`` page-locked slots for one token's K and V rows each, and one int32 each for
    a length, used in turn on the stream with handle ``handle``.

    Args:
        slots: how many.
        row_elems: elements of one token's K (and of its V) rows.
        dtype: the rows' dtype; None: an fp8 cache's, whose K and V of a slot sit side by
            side as bytes, room for float32 rows (``kv``), so one copy moves both.
        device: where the events are recorded.
        handle: the stream the copies are queued on.
    """

    def __init__(
        self, slots: int, row_elems: int, dtype: np.dtype | None, device: Device, handle: object
    ) -> None:
        if dtype is None:
            self.kv = pinned_empty((slots, 2 * row_elems * 4), np.uint8)
            self.k = self.v = self.kv
        else:
            self.k = pinned_empty((slots, row_elems), dtype)
            self.v = pinned_empty((slots, row_elems), dtype)
        self.seq = pinned_empty((slots,), np.int32)
        # Addresses computed once: numpy's .ctypes costs microseconds on every access.
        self.k_addr = self.k.ctypes.data
        self.v_addr = self.v.ctypes.data
        self.seq_addr = self.seq.ctypes.data
        # One event per group of slots, recorded after the group's last slot: a slot is
        # reused only after every other slot was, so its group's event covers it.
        self.group = min(SLOT_GROUP, slots)
        n_groups = -(-slots // self.group)
        self.events = [Event(timing=False, device=device) for _ in range(n_groups)]
        self.busy = [False] * n_groups
        self.slots = slots
        self.next = 0
        self.handle = handle

    def take(self) -> int:
        """The next staging slot, waited for when the ring has come round to it while its
        copies may still be in flight; the group's event is recorded after its last slot
        (by ``done``)."""
        slot = self.next
        self.next = (slot + 1) % self.slots
        group = slot // self.group
        if slot % self.group == 0 and self.busy[group]:
            self.events[group].synchronize()  # only when every slot is in flight
            self.busy[group] = False
        return slot

    def done(self, slot: int) -> None:
        """The copies from ``slot`` are queued: record its group's event after its last."""
        if slot % self.group == self.group - 1 or slot == self.slots - 1:
            group = slot // self.group
            drv("cuEventRecord", self.events[group].handle, self.handle)
            self.busy[group] = True

    def close(self) -> None:
        """Free the events (the page-locked memory goes with its arrays)."""
        for ev in self.events:
            ev.close()
