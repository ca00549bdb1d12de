"""Run notebooks/07-compaction-loops.ipynb top to bottom and save only the outputs nbval compares.

    cd <repository root> && PYTHONPATH=$PWD python notebooks/compaction-loops/save_outputs.py

The notebook runs in a fresh kernel with ``notebooks/`` as its working folder (as nbval runs it); every cell
marked ``# NBVAL_CHECK_OUTPUT`` keeps its output and gets an execution count, every other cell is saved
without outputs (tests/test_notebooks.py checks both), and no widget state is kept.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent
NOTEBOOK = HERE.parent / "07-compaction-loops.ipynb"
CHECK = "NBVAL_CHECK_OUTPUT"


def main() -> int:
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else NOTEBOOK
    nb = nbformat.read(path, as_version=4)
    env = {k: v for k, v in os.environ.items() if k != "MPLBACKEND" and not k.startswith(("AGENTNB_", "OPENAI_"))}
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute(env=env)
    count = 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        if CHECK in cell.source:
            count += 1
            cell.execution_count = count
            for output in cell.outputs:
                if "execution_count" in output:
                    output["execution_count"] = count
        else:
            cell.outputs = []
            cell.execution_count = None
    nb.metadata.pop("widgets", None)
    nbformat.write(nb, path)
    print(f"{path}: {count} checked cells saved with their outputs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
