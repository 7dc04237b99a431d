"""The block pool's memory: its geometry and on-disk format, the allocator, the pool file, private memory, NUMA placement."""
