"""FX graph passes: find indexer selection sites, prove them legal, rewrite them; selection replay."""
