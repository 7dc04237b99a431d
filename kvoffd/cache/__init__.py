"""What the daemon knows: the keyspace (index, policies, warm restart, tiers below the pool) over the pool (README.md)."""
