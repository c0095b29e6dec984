"""The recipe's ``exports:`` items, re-exported from their torch-free home, compress.schema.exports."""

from compress.schema.exports import *  # noqa: F403 - every public name (format constants, spec classes, ExportSpec)
from compress.schema.exports import _Export  # noqa: F401 - the base of every export config (a plugin format subclasses it)
