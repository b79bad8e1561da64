"""The Colab notebook is a valid notebook whose cells run, in order, on this machine's CPU."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "experiments" / "colab.ipynb"


def test_notebook_is_valid_and_its_cells_run_on_cpu(tmp_path):
    notebook = json.loads(NOTEBOOK.read_text())
    assert notebook["nbformat"] == 4
    code = ["".join(cell["source"]) for cell in notebook["cells"] if cell["cell_type"] == "code"]
    assert code and all(cell["outputs"] == [] for cell in notebook["cells"] if cell["cell_type"] == "code")
    for source in code:
        compile(source, "cell", "exec")  # every cell is plain Python (no shell magics)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 400)
    # IPython is the notebook's own display layer; outside Jupyter a stand-in records the image.
    runner = textwrap.dedent(f"""
        import json, sys, types
        shown = []
        display_module = types.ModuleType("IPython.display")
        display_module.Image = lambda filename: filename
        display_module.display = shown.append
        namespace = {{}}
        for cell in json.load(open({str(NOTEBOOK)!r}))["cells"]:
            source = "".join(cell["source"])
            if "IPython" in source:  # only that cell sees the stand-in (tqdm probes for IPython)
                sys.modules["IPython"] = types.ModuleType("IPython")
                sys.modules["IPython.display"] = display_module
            if cell["cell_type"] == "code":
                exec(source, namespace)
            sys.modules.pop("IPython", None)
            sys.modules.pop("IPython.display", None)
        print("SUMMARY", json.dumps(namespace["summary"]))
        print("SHOWN", shown)
    """)
    env = {**os.environ, "JAXGPT_NOTEBOOK_STEPS": "4", "JAXGPT_NOTEBOOK_OUT": str(tmp_path / "run"),
           "JAXGPT_NOTEBOOK_DATA": str(corpus), "JAXGPT_REPO": str(ROOT),
           "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    result = subprocess.run([sys.executable, "-c", runner], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.split("SUMMARY ", 1)[1].splitlines()[0])
    assert summary["step"] == 4 and summary["event"] == "end"
    assert str(tmp_path / "run" / "loss.png") in result.stdout.split("SHOWN", 1)[1]
    assert (tmp_path / "run" / "loss.png").stat().st_size > 0
