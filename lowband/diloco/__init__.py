"""Streaming DiLoCo: fragment-wise, overlapped, quantized outer synchronisation across replica groups.

* :mod:`~lowband.diloco.schedule`: which fragment is prepared / synced after which inner step (pure);
* :mod:`~lowband.diloco.fragments`: split a model into fragments, validate user-given ones;
* :mod:`~lowband.diloco.outer`: the outer step's math (pseudo-gradient, outer step, merge);
* :mod:`~lowband.diloco.streaming`: :class:`StreamingDiLoCo`, the distribution (inner optimizer hook);
* :mod:`~lowband.diloco.state`: the one state format (DCP-ready), :class:`DilocoCheckpoint`, and
  :class:`~lowband.diloco.state.GTPShardLayout` (the logical form of row-sharded (GTP) parameters in it);
* :mod:`~lowband.diloco.membership`: static membership and the replica x dp mesh.
* :mod:`~lowband.diloco.ft`: fault-tolerant membership through torchft (optional extra ``ft``).
* :mod:`~lowband.diloco.average`: the average of the replicas' models (the model to keep at the end).
"""

from lowband.diloco.average import replica_average
from lowband.diloco.fragments import Fragment, split_fragments
from lowband.diloco.membership import StaticMembership, replica_mesh
from lowband.diloco.outer import default_outer_optimizer, outer_sgd
from lowband.diloco.schedule import ScheduleConfig, actions_at, fragment_for, plan, validate_schedule
from lowband.diloco.state import DilocoCheckpoint
from lowband.diloco.streaming import StreamingDiLoCo

__all__ = ["DilocoCheckpoint", "Fragment", "ScheduleConfig", "StaticMembership", "StreamingDiLoCo",
           "actions_at", "default_outer_optimizer", "fragment_for", "outer_sgd", "plan", "replica_average",
           "replica_mesh", "split_fragments", "validate_schedule"]
