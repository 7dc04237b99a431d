"""Warm restart: the pool file's slot records, the keeper that keeps them true, and the adoption of a previous daemon's blocks."""
