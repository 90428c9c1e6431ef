"""The operator's application: the ``tollgate`` command, the local supervisor and replay.

No service imports it.
"""
