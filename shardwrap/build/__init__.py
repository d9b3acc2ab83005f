"""Wrap time: module tree to units, communicators, casts, deferred init, nesting."""
