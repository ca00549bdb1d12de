"""The engine: pieces, the job state machine (runner), the agent loop, the ContextManager and prompts.

It depends on ``events``, ``models``, ``tools`` and ``store`` (through its interface), never on the
``Workspace`` facade, the views or the notebook layer."""
