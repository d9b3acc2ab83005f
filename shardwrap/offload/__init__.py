"""Shard storage off the device: host (CPU) staging, disk store, sub-group stepping."""
