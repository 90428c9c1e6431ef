"""The worker: runs one model and serves the requests in its work-queue stream."""
