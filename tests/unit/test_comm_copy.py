"""``lowband.comm.Comm`` under ``copy`` and ``pickle``: a handle to a process group is shared by copies of
a model (an EMA copy of a TP model communicates over the same group) and refuses to be pickled with one
line naming what to save instead."""

from __future__ import annotations

import copy
import pickle

import pytest

from lowband.comm import Comm, CommLedger


def test_copies_share_the_comm_and_pickling_is_refused_by_name() -> None:
    comm = Comm(ledger=CommLedger(), name="tp")
    holder = {"comm": comm, "also": comm}
    dup = copy.deepcopy(holder)
    assert dup["comm"] is comm and dup["also"] is comm and copy.copy(comm) is comm
    with pytest.raises(TypeError, match=r"lowband.comm.Comm 'tp' is a handle to a process group and cannot be "
                                        r"pickled .* save state_dict\(\)s instead"):
        pickle.dumps(holder)
