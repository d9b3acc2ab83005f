"""Wrap time: the composition root (options, ``build_root``, ``ShardRoot``), module tree to
units, communicators, casts, deferred init, nesting."""
