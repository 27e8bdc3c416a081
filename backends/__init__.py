"""Backends: one DeepSeek attention step of one layer for a whole batch, composed from ops/."""
