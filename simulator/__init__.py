"""Trace-driven discrete-event simulator that drives the real scheduler and cache manager."""
