"""The folder slime's MUSA bootstrap puts on ``sys.path``: point ``MUSA_PATCH_PATH`` and
``MUSA_TITAN_PATH`` here (``musa_patch.py``, ``musa_titan.py``). A package too, so a wheel
of Titan carries the two modules."""
