"""``shardwrap.initialize``: a ``PipelineModule`` gets the pipeline engine, any other model
the data-parallel one (``engine.initialize``).

The pipeline engine is imported only when asked for: ``torch.distributed.pipelining``
costs ``import shardwrap`` its numpy import otherwise.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from .engine import initialize as _initialize_data_parallel
from .pipe_module import PipelineModule


@functools.wraps(_initialize_data_parallel)
def initialize(*args: Any, **kwargs: Any):
    bound = inspect.signature(_initialize_data_parallel).bind(*args, **kwargs)
    if isinstance(bound.arguments.get("model"), PipelineModule):
        from .pipe_engine import initialize_pipeline

        return initialize_pipeline(**bound.arguments)
    return _initialize_data_parallel(*args, **kwargs)
