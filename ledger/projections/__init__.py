"""Read models derived from the event order: rebuildable at any time."""
