"""The project's own files: what `make train` and `make test` install, the licence, the README."""

import os
import shutil
import subprocess
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _make_dry_run(folder: Path, target: str) -> list[str]:
    """The commands `make TARGET` would run in `folder`, without running them."""
    # Under `make test` the parent make's variables would turn on "Entering directory" lines.
    env = {key: value for key, value in os.environ.items() if key not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    result = subprocess.run(["make", "-n", "--no-print-directory", target], cwd=folder, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_make_train_installs_only_what_training_needs_and_make_test_adds_the_test_extra(tmp_path):
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    train = _make_dry_run(tmp_path, "train")
    installs = [line for line in train if "pip install" in line and "--upgrade pip" not in line]
    assert installs and not any("test" in line for line in installs)
    assert any(line.rstrip().endswith("-e .") for line in installs)
    test = _make_dry_run(tmp_path, "test")
    assert any("pip install" in line and ".[test]" in line for line in test)
    # Once the training install is done, `make test` adds the extra without rebuilding the venv.
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / ".installed").touch()
    test = _make_dry_run(tmp_path, "test")
    assert not any("python3 -m venv" in line for line in test)
    assert any(".[test]" in line for line in test) and not any(line.rstrip().endswith("-e .") for line in test)
    assert _make_dry_run(tmp_path, "train") == [
        line for line in train if "jaxgpt train" in line]  # installed: training starts at once


def _names(deps: list[str]) -> set[str]:
    return {dep.split(">")[0].split("=")[0].strip().lower() for dep in deps}


def test_training_dependencies_hold_no_test_only_packages():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    core = {name.split("[")[0] for name in _names(project["dependencies"])}
    assert not core & {"torch", "transformers", "pytest", "hypothesis", "datasets", "lm-eval"}
    assert {"torch", "transformers", "pytest", "lm-eval[hf]"} <= _names(extras["test"])
    assert _names(extras["eval"]) == {"lm-eval"}  # the harness without its PyTorch backend


def test_a_stopped_make_train_continues_when_run_again(tmp_path):
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    (tmp_path / "pyproject.toml").touch()
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / ".installed").touch()
    [command] = _make_dry_run(tmp_path, "train")
    assert command.split()[1:] == ["train", "--out", "runs/default", "--resume"]


def test_the_project_carries_an_mit_licence_named_in_the_readme():
    licence = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert licence.startswith("MIT License") and "WITHOUT WARRANTY OF ANY KIND" in licence
    assert "[LICENSE](LICENSE)" in README and "MIT" in README


def test_readme_says_how_to_open_tensorboard_on_a_run():
    assert "tensorboard --logdir runs/default/tensorboard" in README


def test_readme_stays_short():
    assert len(README.encode("utf-8")) <= 15_000
