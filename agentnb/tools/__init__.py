"""The tools a piece can name: :mod:`.base` holds the registry and ``@tool``; importing the package registers the built-in ones."""

from . import builtin as builtin  # registers Read, Write, Edit, Glob, Grep, Bash, … on import
