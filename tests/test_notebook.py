"""The Colab notebook: a valid notebook whose cells run in order on this machine's CPU. On a bare
runtime (jax installed, jaxgpt not, the notebook outside any checkout) it installs jaxgpt from the
source its first cell names, keeps the runtime's jax, and trains."""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import jax
import pytest
from conftest import xla_flags

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "experiments" / "colab.ipynb"
SOURCE_LINE = 'JAXGPT_SOURCE = ""'
NO_SOURCE = ("Set JAXGPT_SOURCE in the first code cell to a git URL or a wheel path "
             "(this notebook is not inside a jaxgpt checkout).")

# Runs the first `limit` cells of the notebook given on the command line, as Jupyter would, then
# says which jax and jaxgpt it ended up with. IPython is the notebook's own display layer; outside
# Jupyter a stand-in records the image.
RUNNER = textwrap.dedent("""
    import json, sys, types
    shown = []
    display_module = types.ModuleType("IPython.display")
    display_module.Image = lambda filename: filename
    display_module.display = shown.append
    namespace = {}
    cells = [c for c in json.load(open(sys.argv[1]))["cells"] if c["cell_type"] == "code"]
    for cell in cells[:int(sys.argv[2])]:
        source = "".join(cell["source"])
        if "IPython" in source:  # only that cell sees the stand-in (tqdm probes for IPython)
            sys.modules["IPython"] = types.ModuleType("IPython")
            sys.modules["IPython.display"] = display_module
        exec(source, namespace)
        sys.modules.pop("IPython", None)
        sys.modules.pop("IPython.display", None)
    import jax, jaxgpt
    print("JAX", jax.__version__, jax.__file__)
    print("JAXGPT", jaxgpt.__file__)
    if "summary" in namespace:
        print("SUMMARY", json.dumps(namespace["summary"]))
    print("SHOWN", shown)
""")


def _code_cells() -> list[str]:
    notebook = json.loads(NOTEBOOK.read_text())
    return ["".join(cell["source"]) for cell in notebook["cells"] if cell["cell_type"] == "code"]


def test_notebook_is_valid_and_names_its_source_in_one_marked_line():
    notebook = json.loads(NOTEBOOK.read_text())
    assert notebook["nbformat"] == 4
    code = _code_cells()
    assert code and all(cell["outputs"] == [] for cell in notebook["cells"] if cell["cell_type"] == "code")
    for source in code:
        compile(source, "cell", "exec")  # every cell is plain Python (no shell magics)
    assert code[0].startswith(SOURCE_LINE + "  # <- SET THIS")  # the one thing a user edits, at the top


@pytest.fixture(scope="module")
def runtime_packages(tmp_path_factory) -> Path:
    """A stand-in for a Colab runtime's packages: every package of this environment but jaxgpt."""
    folder = tmp_path_factory.mktemp("runtime-packages")
    site = Path(sysconfig.get_paths()["purelib"])
    for entry in site.iterdir():
        if not entry.name.lower().startswith(("jaxgpt", "__editable__")):
            (folder / entry.name).symlink_to(entry)
    return folder


@pytest.fixture
def bare_runtime(tmp_path, runtime_packages) -> tuple[Path, Path]:
    """(python, its own site-packages) of a fresh venv that sees the runtime's packages, not jaxgpt."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = venv / "bin" / "python"
    own = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              check=True, capture_output=True, text=True).stdout.strip())
    (own / "runtime.pth").write_text(f"import site; site.addsitedir({str(runtime_packages)!r})\n")
    return python, own


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """jaxgpt built as a wheel, standing in for the remote a user names."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = _copy_project(tmp / "source")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp / "dist"), str(source)], check=True, timeout=300)
    [built] = (tmp / "dist").glob("jaxgpt-*.whl")
    return built


def _run(python: Path, notebook: Path, cells: int, **env: str) -> subprocess.CompletedProcess:
    environ = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}  # no jaxgpt on the path
    environ.update({"PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1",  # offline: all it needs is here
                    "XLA_FLAGS": xla_flags(1), **env})
    return subprocess.run([str(python), "-c", RUNNER, str(notebook), str(cells)], cwd=notebook.parent,
                          env=environ, capture_output=True, text=True, timeout=300)


def _notebook_in(folder: Path, source: str) -> Path:
    """A copy of the notebook in `folder` with JAXGPT_SOURCE set as a user would set it."""
    notebook = json.loads(NOTEBOOK.read_text())
    cell = next(cell for cell in notebook["cells"] if cell["cell_type"] == "code")
    text = "".join(cell["source"])
    assert text.count(SOURCE_LINE) == 1
    cell["source"] = text.replace(SOURCE_LINE, f"JAXGPT_SOURCE = {json.dumps(source)}")
    folder.mkdir(parents=True, exist_ok=True)
    copy = folder / "colab.ipynb"
    copy.write_text(json.dumps(notebook))
    return copy


def _copy_project(folder: Path) -> Path:
    """What a checkout holds that pip needs to build jaxgpt."""
    folder.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, folder / name)
    shutil.copytree(ROOT / "jaxgpt", folder / "jaxgpt", ignore=shutil.ignore_patterns("__pycache__"))
    return folder


def test_on_a_bare_runtime_it_installs_from_the_named_source_keeps_jax_and_trains(tmp_path, bare_runtime, wheel):
    python, own_packages = bare_runtime
    notebook = _notebook_in(tmp_path / "content", str(wheel))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 400)
    run = tmp_path / "content" / "run"
    result = _run(python, notebook, len(_code_cells()), JAXGPT_NOTEBOOK_STEPS="1", JAXGPT_NOTEBOOK_OUT=str(run),
                  JAXGPT_NOTEBOOK_DATA=str(corpus))
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert f"installing jaxgpt from {wheel}, keeping jax=={jax.__version__}, jaxlib==" in out
    # jaxgpt went into the runtime's own packages; jax is still the runtime's, not a second copy.
    assert list(own_packages.glob("jaxgpt-*.dist-info"))
    assert out.split("JAXGPT ", 1)[1].split("\n", 1)[0].startswith(str(own_packages))
    assert not list(own_packages.glob("jax-*")) and not list(own_packages.glob("jaxlib*"))
    jax_version, jax_file = out.split("JAX ", 1)[1].split("\n", 1)[0].split(" ", 1)
    assert jax_version == jax.__version__ and str(own_packages) not in jax_file
    summary = json.loads(out.split("SUMMARY ", 1)[1].splitlines()[0])
    assert summary["step"] == 1 and summary["event"] == "end"
    assert str(run / "loss.png") in out.split("SHOWN", 1)[1]
    assert (run / "loss.png").stat().st_size > 0


def test_without_a_source_outside_a_checkout_it_stops_with_one_line(tmp_path, bare_runtime):
    python, own_packages = bare_runtime
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "another"\n')  # a project, not jaxgpt
    notebook = _notebook_in(tmp_path / "content", "")
    result = _run(python, notebook, 1)
    assert result.returncode == 1
    assert result.stderr.strip() == NO_SOURCE  # the whole message: one line, no traceback
    assert "installing" not in result.stdout and not list(own_packages.glob("jaxgpt*"))


def test_without_a_source_inside_a_checkout_it_installs_that_checkout(tmp_path, bare_runtime):
    python, own_packages = bare_runtime
    checkout = _copy_project(tmp_path / "jaxgpt-checkout")
    notebook = _notebook_in(checkout / "experiments", "")
    # pip builds the checkout with the setuptools at hand rather than fetching one (offline)
    result = _run(python, notebook, 1, PIP_NO_BUILD_ISOLATION="0")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"installing jaxgpt from {checkout}, keeping jax==" in result.stdout
    assert list(own_packages.glob("jaxgpt-*.dist-info"))
    assert result.stdout.split("JAXGPT ", 1)[1].startswith(str(own_packages))
