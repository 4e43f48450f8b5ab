"""Configuration: the command line, its validation, and the run plan built from it."""
