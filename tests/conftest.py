"""Shared pytest settings."""

from hypothesis import settings

# Reproducible runs in CI; locally too, so a failure seen once is seen again.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.load_profile("ci")
