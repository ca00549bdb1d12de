"""Views derived from the stored events: HTML (render), DataFrames (frames), plots and exported notebooks.

Views read typed events through the store and the structural sources of ``views/source.py``; they never
write events and never import the facade (workspace.py), the notebook layer or the CLI."""
