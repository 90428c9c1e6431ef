"""The router: Tollgate's OpenAI-compatible HTTP edge."""
