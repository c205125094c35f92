"""Demo models and test fixtures: deterministic local checkpoints (``recipe``), built on demand and
cached, never committed or downloaded."""
