"""Distributed start-up and the TP/PP/VPP/EP/DP layout."""
