"""Saved state: file format, reader, writer, state dicts, consolidation, pretrained loading
(``checkpoint.py`` is the entry point).
"""
