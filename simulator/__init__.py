"""Trace-driven discrete-event simulator that drives the real scheduler and cache manager."""

from gpufaas import native

native.install()  # before the submodules below: their compiled builds where built and current
