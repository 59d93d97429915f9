"""What a run folder and its checkpoints hold: writing them complete or not at all, reading them without running code,
resuming, converting older ones."""
