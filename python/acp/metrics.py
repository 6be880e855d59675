"""Figures of acp's saves and loads, for monitoring.

``prometheus_text()`` renders the figures of every open checkpointer of
this process in the Prometheus text exposition format, e.g. to serve from
a ``/metrics`` endpoint; ``Checkpointer.stats()["figures"]`` has the same
aggregates as a dict. Log lines go to the ``acp`` logger (see
``acp._metrics`` for the levels).
"""

from acp._metrics import Metrics, logger, prometheus_text

__all__ = ["Metrics", "logger", "prometheus_text"]
