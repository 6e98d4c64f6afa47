"""Conversion of existing datasets into gdsload shards (see engine.py)."""
