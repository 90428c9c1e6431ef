"""Tollgate: one OpenAI-compatible endpoint for self-hosted LLMs.

The library every service shares, in layers (each imports only those below
it; import-linter checks this): ``wire`` (contracts, subjects, codec, NATS
helpers, the bus topology), ``runtime`` (settings, logs, tracing, operations
routes), the domain libraries ``keys``, ``models`` and ``analytics``, and on
top the operator's application ``app`` (the ``tollgate`` command), which no
service imports.
"""

__version__ = "0.1.0"
