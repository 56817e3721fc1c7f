"""Rendering results: JSON documents, tables and console lines (only this package imports rich)."""
