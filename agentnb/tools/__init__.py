"""Tools: the ``@tool`` machinery (schemas, path confinement, result checks) and the built-in tools."""
