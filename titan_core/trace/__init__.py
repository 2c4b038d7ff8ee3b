"""Distributed Holistic Trace Analysis of PyTorch profiler (Kineto) traces.

Imports nothing heavy (no torch, no megatron); see README.md in this folder for the
analyses, the annotation convention Titan's runs follow, and the config file.
"""
