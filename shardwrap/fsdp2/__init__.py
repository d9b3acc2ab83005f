"""The FSDP2 door: ``fully_shard`` and ``FSDPModule``, torch's names on shardwrap's engine.

``fully_shard.py`` (the entry point, bottom-up calls and the root), ``module.py``
(``FSDPModule``'s methods), ``dtensor_views.py`` (parameters and gradients as DTensors
over the flat shard), ``options.py`` (the arguments, and what is refused), ``state.py``
(each call's record), ``meta_init.py`` (meta-device modules), ``assign_load.py``
(``load_state_dict(assign=True)``), ``forward_method.py``
(``register_fsdp_forward_method``), ``replicas.py`` (HSDP's ``set_requires_all_reduce``
and ``set_all_reduce_hook``). The layout: ``layout/chunks.py``.
"""

from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

from .forward_method import register_fsdp_forward_method
from .fully_shard import fully_shard
from .module import FSDPModule, GradientReductionHandle, UnshardHandle

__all__ = [
    "FSDPModule",
    "GradientReductionHandle",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "UnshardHandle",
    "fully_shard",
    "register_fsdp_forward_method",
]
