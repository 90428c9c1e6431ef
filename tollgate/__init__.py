"""Tollgate: one OpenAI-compatible endpoint for self-hosted LLMs.

This package is the small library every service shares: wire contracts,
subject names, settings, the NATS connection helper, the model catalog and
logging. Services import it; it never imports a service.
"""

__version__ = "0.1.0"
