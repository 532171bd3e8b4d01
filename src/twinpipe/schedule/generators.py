"""Imports every built-in generator module so that each registers itself."""

from twinpipe.schedule import dualpipe  # noqa: F401
