"""Integrations of the sparse_mla ops into inference engines (see DESIGN.md)."""
