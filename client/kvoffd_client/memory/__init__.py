"""How an engine shares its KV memory with the daemon; module names are the protocol's memory kinds."""
