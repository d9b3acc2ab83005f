"""Bottom layer: argument checks, dtype and size tables, private torch APIs, exit hooks."""
