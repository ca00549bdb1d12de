"""Model specs and the models behind them: ``scripted:``, ``replay:``, ``openai:`` and the built-in ``demo``."""
