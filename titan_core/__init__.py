"""Titan's shared Megatron training base.

Importing this package is deliberately cheap (no torch, no megatron): the trace analyzer
lives under it and must run on a laptop with nothing but the traces.
"""

__version__ = "0.1.0"
