"""The Hydra app and command-line tools: train, compare, demo, export; config schemas and run summaries."""
