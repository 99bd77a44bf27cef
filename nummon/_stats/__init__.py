"""The statistics collector: the only part of the training-loop path that touches tensors.

Per step it launches reductions on the device: L2 norms of gradients, parameters and optimizer
state (one fused ``torch._foreach_norm`` on CUDA; a BLAS dot per tensor into a preallocated
buffer on CPU), max |g| (a fused inf-norm on CUDA; ``aminmax`` into a buffer on CPU) and the
(min, max) of every watched module output (``aminmax`` from a forward hook, into a buffer of the
output's dtype). It packs every scalar into one vector, copies that to the host once
(non-blocking into pinned memory on CUDA, read one step later) and turns it into plain floats,
the only thing that leaves here.

May import: `_core`, `_policy`.
"""

from .collector import StatsCollector
from .dtypes import dtype_name
from .pending import Pending

__all__ = ["Pending", "StatsCollector", "dtype_name"]
