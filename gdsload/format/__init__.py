"""The shard format: aligned tar writer, indexes, manifest, reader (see DESIGN.md)."""
