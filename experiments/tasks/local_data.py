"""The splits of a task on local JSONL files, for the task YAMLs of this folder.

A task names this loader and its files (one JSON object a line, the fields its templates read):

    custom_dataset: !function local_data.load
    dataset_kwargs:
      files:
        validation: data/hellaswag_val.jsonl

A relative path is read from this folder, so the tasks run from any working directory, and
nothing is fetched from the Hugging Face hub.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets

HERE = Path(__file__).resolve().parent


def load(files: dict[str, str], **_metadata: Any) -> datasets.DatasetDict:
    """One split per entry of `files`; the harness passes its task metadata too (unused here)."""
    splits = {}
    for split, name in files.items():
        path = Path(name) if Path(name).is_absolute() else HERE / name
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: the task's YAML in {HERE} says where to get it")
        lines = path.read_text(encoding="utf-8").splitlines()
        splits[split] = datasets.Dataset.from_list([json.loads(line) for line in lines if line.strip()])
    return datasets.DatasetDict(splits)
