"""Views derived from the stored events: HTML (render), DataFrames (frames), plots and exported notebooks.

Views read through the store; they never write events and never import the notebook layer."""
