"""The example notebook runs top to bottom in a real Jupyter kernel and shows what it claims."""
from pathlib import Path

import nbformat
from nbclient import NotebookClient

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def cell_text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.get("output_type") == "stream")


def test_notebook_executes_and_its_outputs_hold():
    nb = nbformat.read(EXAMPLES / "offline_inference.ipynb", as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(EXAMPLES)}}).execute()
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(o.get("output_type") != "error" for c in code for o in c.outputs)
    generate, chat, stream = cell_text(code[1]), cell_text(code[2]), cell_text(code[3])
    assert generate.count(" -> ") == 3 and "outputs: 3" in generate
    assert chat.count("tokens, first token after") == 2
    assert "stream matches: True" in stream
