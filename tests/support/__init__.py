"""Shared builders of the tests: tiny checkpoints, engines driven step by step, in-process backends."""
