"""The notebook layer: the ``%agent`` magic and the ipywidgets panel, thin adapters over ``Workspace``."""
