"""Helpers every layer may import: value checks and the settings base of the config files."""
