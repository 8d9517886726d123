"""The pipeline's Prefect flows, one module per DVC stage, and the processes around them (docs/architecture.md).

A stage command (``python -m flows.<stage>``) first offers itself to the preloaded interpreter that ``make run``
starts (``flows.preload``): with ``TRACE_PRELOAD`` set and a server answering, the stage runs in a fork of it
and this process exits with its status; otherwise nothing happens here.
"""

from flows.forward import forward_stage as _forward_stage

_forward_stage()
