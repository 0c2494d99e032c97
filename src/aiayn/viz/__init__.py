"""Pictures: attention maps, positional encodings, the learning-rate schedule, learning curves."""
