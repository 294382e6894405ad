"""Ray actors and the single controller that drives them (see controller.py for the loop)."""
