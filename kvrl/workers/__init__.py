"""Ray actors (or, with workers.address=inline, objects in this process: inline.py) and the single controller
that drives them (see controller.py for the loop)."""
