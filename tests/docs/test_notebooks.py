"""The notebooks: committed without outputs, and each runs top to bottom in a real Jupyter kernel in its
smoke configuration (EAGLE_JAX_SMOKE=1), failing on any cell error."""

import json
import time
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))


def test_the_three_notebooks_exist_and_carry_no_outputs():
    assert [p.name for p in NOTEBOOKS] == ["01_quickstart.ipynb", "02_train_draft_head.ipynb",
                                           "03_harness_and_scaling.ipynb"]
    for path in NOTEBOOKS:
        nb = json.loads(path.read_text())
        for i, cell in enumerate(nb["cells"]):
            if cell["cell_type"] == "code":
                assert cell.get("outputs") == [] and cell.get("execution_count") is None, \
                    f"{path.name} cell {i} has outputs: clear them before committing"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_in_smoke_configuration(path, tmp_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("EAGLE_JAX_SMOKE", "1")
    monkeypatch.setenv("EAGLE_JAX_WORKDIR", str(tmp_path / "work"))
    nb = nbformat.read(path, as_version=4)
    t0 = time.perf_counter()
    NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 1, "the notebook's figures were not drawn"
    print(f"{path.name}: {time.perf_counter() - t0:.0f} s")
