"""The folder slime's MUSA bootstrap puts on ``sys.path``: point ``MUSA_PATCH_PATH`` and
``MUSA_TITAN_PATH`` here (``musa_patch.py``, ``musa_titan.py``). A package too, so a wheel
of Titan carries the two modules."""


def apply_and_register() -> str:
    """What slime's MUSA bootstrap modules run: Titan's start-up answers
    (:func:`adapters.slime.patch.apply_rl_patch`), then ``titan`` in slime's registry where
    slime is installed (the bootstrap also runs without it: miles' MUSA PR)."""
    from adapters.slime.patch import apply_rl_patch

    name = apply_rl_patch()
    try:
        from adapters.slime.accelerator import register
    except ImportError:
        return name
    register()
    return name
