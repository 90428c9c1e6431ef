"""The wire: message contracts, subject names, the codec, the NATS helpers and the bus topology.

The lowest layer: it imports nothing else from Tollgate.
"""
