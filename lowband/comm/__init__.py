"""Every byte lowband puts on the wire: :class:`Comm`, :class:`CommLedger`, algorithms, codecs."""

from lowband.comm.comm import ALGORITHMS, Comm, CommHandle, all_finite, finite_probe, group_timeout, new_group
from lowband.comm.ledger import CommLedger, CommRecord, LedgerTotals, default_ledger, ring_wire_bytes

__all__ = ["ALGORITHMS", "Comm", "CommHandle", "CommLedger", "CommRecord", "LedgerTotals", "all_finite",
           "default_ledger", "finite_probe", "group_timeout", "new_group", "ring_wire_bytes"]
