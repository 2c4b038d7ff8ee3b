"""Titan as a training backend of other RL frameworks: ``adapters.slime``, ``adapters.miles``.

Each adapter imports its framework's own code (never a re-declaration of it); a missing or
broken framework package is a :class:`adapters.peers.PeerImportError` naming it.
"""
