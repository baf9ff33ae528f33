"""Engine memory: loading weights from disk into planned buffers, and planners that work under a
byte budget. ``loader`` is shared by budgeted inference and cold start."""
