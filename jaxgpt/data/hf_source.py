"""`hf:NAME[@REVISION][:SPLIT]`: a Hugging Face dataset as a data source (`pip install 'jaxgpt[hf]'`).

NAME is a folder written by `Dataset.save_to_disk` (read where it lies, memory-mapped) or a dataset
on the hub, read in the library's streaming mode: nothing is downloaded whole. Rows are documents
(their `text_field` column). The held-out documents are the dataset's "validation" (else "test")
split where it has one, else the rows whose index hashes into `val_fraction`. The listing of a
folder is its files; of a hub dataset its name, revision ("main" unless pinned with @REVISION)
and split, so a store prepared from it is found again without asking the hub.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from jaxgpt.data.documents import Document, Source, in_val_split, stat_entry
from jaxgpt.errors import UserError

HELD_OUT_SPLITS = ("validation", "test")


class HFSource(Source):
    def __init__(self, spec: str, val_fraction: float, text_field: str) -> None:
        name, _, split = spec[len("hf:"):].partition(":")
        name, _, revision = name.partition("@")
        self.name, self.split, self.revision = name, split, revision or "main"
        self.val_fraction, self.text_field = val_fraction, text_field
        self.local = Path(name).expanduser().is_dir()
        self.identity = {"kind": "hf", "name": str(Path(name).expanduser().absolute()) if self.local else name,
                         "split": split, "text_field": text_field}
        self._datasets = _import_datasets(spec)
        self._listing = self.listing()
        self.description = f"hf:{name}" + (f" {split!r}" if split else "")

    def listing(self) -> list[list]:
        if not self.local:
            return [[f"hf:{self.name}", self.revision, self.split or "train"]]
        root = Path(self.name).expanduser()
        return [[p.relative_to(root).as_posix(), *stat_entry(p)] for p in sorted(root.rglob("*")) if p.is_file()]

    def size(self) -> int:
        return sum(e[1] for e in self._listing if isinstance(e[1], int)) if self.local else 0

    def _load(self):
        datasets = self._datasets
        try:
            if self.local:
                return datasets.load_from_disk(self.name)
            return datasets.load_dataset(self.name, revision=self.revision, streaming=True)
        except Exception as err:
            first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise UserError(f"cannot load hf dataset {self.name!r}: {first_line}") from None

    def documents(self) -> Iterator[Document]:
        datasets, loaded = self._datasets, self._load()
        if isinstance(loaded, (datasets.DatasetDict, datasets.IterableDatasetDict)):
            split = self.split or "train"
            if split not in loaded:
                raise UserError(f"hf dataset {self.name!r} has no split {split!r} (splits: {', '.join(loaded)})")
            held_out = next((s for s in HELD_OUT_SPLITS if s in loaded and s != split), None)
            if held_out is None:
                yield from self._rows(loaded[split], by_index=True)
            else:
                yield from self._rows(loaded[split], val=False)
                yield from self._rows(loaded[held_out], val=True)
        else:
            if self.split not in ("", "train"):
                raise UserError(f"hf dataset {self.name!r} has no splits; drop ':{self.split}' from data.source")
            yield from self._rows(loaded, by_index=True)

    def _rows(self, dataset, *, val: bool = False, by_index: bool = False) -> Iterator[Document]:
        columns = dataset.column_names
        if columns is not None and self.text_field not in columns:
            raise UserError(f"hf dataset {self.name!r} has no {self.text_field!r} column (columns: "
                             f"{', '.join(columns)}); name it with --set data.text_field=NAME")
        for index, row in enumerate(dataset.select_columns([self.text_field])):
            text = row[self.text_field]
            if text:
                yield Document(text, in_val_split(f"#{index}", self.val_fraction) if by_index else val)


def _import_datasets(spec: str):
    try:
        import datasets
    except ImportError:
        raise ImportError(f"data.source {spec!r} needs the datasets library: pip install 'jaxgpt[hf]'") from None
    return datasets
