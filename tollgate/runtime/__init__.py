"""The runtime every service shares: settings, logs, tracing, operations routes, service runner."""
