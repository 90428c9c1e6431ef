"""The auth service: key lifecycle (admin API), audit, and budget accounting."""
