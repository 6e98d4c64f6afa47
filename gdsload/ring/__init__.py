"""The only allocator of batch memory: the prefetch ring (`ring.ring`) and the staging arenas
(`ring.staging`)."""
