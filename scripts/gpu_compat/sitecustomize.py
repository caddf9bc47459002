"""Only for scripts/gpu_check.sh on a machine whose torch predates 2.13 (the device image has 2.11).

torch 2.13 renamed DDP's ``broadcast_buffers`` to ``forward_sync_buffers``; lowband passes the new name.
On an older torch this maps it back, so the bench's DDP and ZeRO contenders run there. Never imported
by lowband itself or by its tests.
"""
import inspect

from torch.nn.parallel import DistributedDataParallel

_init = DistributedDataParallel.__init__
if "forward_sync_buffers" not in inspect.signature(_init).parameters:
    def _compat_init(self, *args, forward_sync_buffers=None, **kwargs):
        if forward_sync_buffers is not None:
            kwargs.setdefault("broadcast_buffers", forward_sync_buffers)
        _init(self, *args, **kwargs)

    DistributedDataParallel.__init__ = _compat_init
