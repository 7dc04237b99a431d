"""What the daemon knows: the index of cached blocks, the slab pool they live in, and the admission/eviction policy."""
