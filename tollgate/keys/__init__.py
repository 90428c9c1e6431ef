"""API keys: records (the whitelist), tokens (signing, verification) and the store on the bus."""
