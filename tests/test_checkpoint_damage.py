"""Damage to any file of a checkpoint is found before Orbax reads it. `verify` names the first
damaged file for bytes overwritten at several offsets, a file cut short, removed or zeroed, in
every kind of file a checkpoint holds; each way it can say so, met end to end, makes `--resume`
move the checkpoint aside in one line, fall back to the previous one, and end bitwise equal to a
run never interrupted. Checkpoints written without a record of their files keep the older check;
a checkpoint whose files match their record is never moved."""

import json
import re
import shutil
from pathlib import Path

import pytest
from jaxgpt_lines import foreign_lines
from test_checkpoint import OVERRIDES, STEPS, assert_bitwise_equal, corpus, full_state, reference  # noqa: F401 (fixtures)

from jaxgpt.cli.main import main
from jaxgpt.train.checkpoint_files import MANIFEST_KEY, RECORD, Damaged, verify, write_record

EVERY = 4  # test_checkpoint's train.checkpoint_every


def resume(corpus, run, capsys) -> tuple[int, list[str]]:
    capsys.readouterr()
    code = main(["train", "--out", str(run), "--resume", "--no-progress", "--data", str(corpus),
                 *[a for o in OVERRIDES for a in ("--set", o)]])
    return code, capsys.readouterr().err.splitlines()


# Each kind of file in a checkpoint, found by a pattern on its path inside the step's folder.
FILES = {
    "array data (OCDBT data file)": r"state/ocdbt\.process_0/d/.+",
    "b-tree node (merged OCDBT)": r"state/d/.+",
    "OCDBT manifest": r"state/manifest\.ocdbt",
    "per-process OCDBT manifest": r"state/ocdbt\.process_0/manifest\.ocdbt",
    "tree metadata (shapes, dtypes)": r"state/_METADATA",
    "sharding metadata": r"state/_sharding",
    "jaxgpt's manifest": r"manifest/metadata",
    "jaxgpt's file record": re.escape(RECORD),
}
# Orbax rewrites its step metadata as it commits (the commit time), after the record is written:
# it is checked by parsing, and text changed inside its strings is harmless (see below).
STEP_METADATA = r"_CHECKPOINT_METADATA"


def files_of(checkpoint: Path, pattern: str) -> list[Path]:
    found = sorted(p for p in checkpoint.rglob("*") if p.is_file()
                   and re.fullmatch(pattern, str(p.relative_to(checkpoint))))
    assert found, f"no file matches {pattern} in {checkpoint}"
    return found


def overwrite_at(offset):
    def hurt(path: Path) -> None:
        blob = bytearray(path.read_bytes())
        start = offset(len(blob))
        blob[start:start + 7] = bytes(b ^ 0x5A for b in blob[start:start + 7])  # every byte changed
        path.write_bytes(bytes(blob))
    return hurt


HARMS = {
    "7 bytes at offset 40": overwrite_at(lambda n: min(40, max(n - 7, 0))),
    "7 bytes in the middle": overwrite_at(lambda n: n // 2),
    "the last 7 bytes": overwrite_at(lambda n: max(n - 7, 0)),
    "cut to half": lambda p: p.write_bytes(p.read_bytes()[:p.stat().st_size // 2]),
    "removed": lambda p: p.unlink(),
    "zeros": lambda p: p.write_bytes(bytes(p.stat().st_size)),
}


def damaged_copy(reference, tmp_path, pattern, harm) -> Path:
    run = shutil.copytree(reference[0], tmp_path / "run")
    newest = run / "checkpoints" / str(STEPS)
    for path in files_of(newest, pattern):
        HARMS[harm](path)
    return run


def assert_fell_back_once(code, err, run, reference) -> None:
    assert code == 0, err
    newest = run / "checkpoints" / str(STEPS)
    damaged = [line for line in err if "is damaged" in line]
    assert len(damaged) == 1 and damaged[0].startswith(f"checkpoint {newest} is damaged: "), err
    assert f"resuming {run} from step {STEPS - EVERY}" in err
    assert foreign_lines("\n".join(err)) == [], err
    assert (run / "checkpoints" / f"damaged-{STEPS}").is_dir()
    assert_bitwise_equal(full_state(run), reference[1])


def expected_damage(checkpoint: Path, path: Path, harm: str) -> str:
    """What `verify` says of `path` damaged by `harm`: the step metadata's as not parsing, any
    other file by how it differs from its record; the record's own damage as the record's, or,
    where the record still parses, as an entry of it that no longer matches its file."""
    name = str(path.relative_to(checkpoint))
    if name == RECORD:
        return (rf"its {re.escape(RECORD)} (is missing|does not parse)"
                rf"|.+ (is missing|holds \d+ bytes, \d+ were written|does not match the checksum written with it)")
    if name == STEP_METADATA:
        return rf"{STEP_METADATA} (is missing|does not parse)"
    if harm == "removed":
        return rf"{re.escape(name)} is missing"
    if harm == "cut to half":
        return rf"{re.escape(name)} holds \d+ bytes, \d+ were written"
    return rf"{re.escape(name)} does not match the checksum written with it"


@pytest.mark.parametrize("pattern,harm", [
    *((FILES[kind], harm) for kind in FILES for harm in HARMS),
    *((STEP_METADATA, harm) for harm in ("the last 7 bytes", "cut to half", "removed", "zeros")),
], ids=[*(f"{kind}-{harm}" for kind in FILES for harm in HARMS),
        *(f"step metadata-{harm}" for harm in ("the last 7 bytes", "cut to half", "removed", "zeros"))])
def test_verify_names_any_damage_to_any_file(reference, tmp_path, pattern, harm):
    checkpoint = shutil.copytree(reference[0] / "checkpoints" / str(STEPS), tmp_path / str(STEPS))
    assert verify(checkpoint) is True  # undamaged, it verifies
    paths = files_of(checkpoint, pattern)
    for path in paths:
        HARMS[harm](path)
    with pytest.raises(Damaged) as error:
        verify(checkpoint)
    assert re.fullmatch(expected_damage(checkpoint, paths[0], harm), str(error.value)), str(error.value)


# One end-to-end resume for each way `verify` reports damage: a file of other bytes, of another
# size, missing; the record itself; the step metadata.
@pytest.mark.parametrize("kind,harm", [
    ("array data (OCDBT data file)", "zeros"),
    ("tree metadata (shapes, dtypes)", "cut to half"),
    ("OCDBT manifest", "removed"),
    ("jaxgpt's file record", "zeros"),
    ("step metadata", "the last 7 bytes"),
])
def test_damage_falls_back_in_one_line_and_resumes_bitwise(reference, corpus, tmp_path, capsys, kind, harm):
    run = damaged_copy(reference, tmp_path, STEP_METADATA if kind == "step metadata" else FILES[kind], harm)
    code, err = resume(corpus, run, capsys)
    assert_fell_back_once(code, err, run, reference)


def test_text_changed_inside_the_step_metadatas_strings_is_harmless(reference, corpus, tmp_path, capsys):
    """Offset 40 falls inside a handler's name there: the file still parses, every recorded file
    matches, and the checkpoint restores exactly, so it is kept and used."""
    run = damaged_copy(reference, tmp_path, STEP_METADATA, "7 bytes at offset 40")
    newest = run / "checkpoints" / str(STEPS)
    json.loads((newest / STEP_METADATA).read_text())  # still parses
    code, err = resume(corpus, run, capsys)
    assert code == 0 and err == [f"{run} finished at step {STEPS}; raise train.steps to continue"], err
    assert_bitwise_equal(full_state(run), reference[1])


def written_before_records(run: Path) -> None:
    """Each checkpoint of `run` as one saved without a record of its files (and so without the
    params' own checksum, which came later: such a checkpoint is read whole)."""
    for checkpoint in (run / "checkpoints").iterdir():
        (checkpoint / RECORD).unlink()
        manifest_file = checkpoint / "manifest" / "metadata"
        manifest = json.loads(manifest_file.read_text())
        del manifest[MANIFEST_KEY], manifest["params_checksum"]
        manifest_file.write_text(json.dumps(manifest))


@pytest.mark.parametrize("kind,harm", [
    ("b-tree node (merged OCDBT)", "7 bytes at offset 40"),  # tensorstore's decode error, raised reading metadata
    ("array data (OCDBT data file)", "7 bytes in the middle"),
    ("array data (OCDBT data file)", "removed"),  # a bare Exception from Orbax, naming TensorStore
    ("OCDBT manifest", "zeros"),
    ("jaxgpt's manifest", "cut to half"),
])
def test_a_checkpoint_without_a_record_keeps_the_older_check(reference, corpus, tmp_path, capsys, kind, harm):
    run = shutil.copytree(reference[0], tmp_path / "run")
    written_before_records(run)
    for path in files_of(run / "checkpoints" / str(STEPS), FILES[kind]):
        HARMS[harm](path)
    code, err = resume(corpus, run, capsys)
    assert_fell_back_once(code, err, run, reference)


def test_a_record_and_its_checkpoint_are_written_together(reference):
    """Every file a restore reads is in the record; a checkpoint's record lists its own files."""
    for checkpoint in (reference[0] / "checkpoints").iterdir():
        record = json.loads((checkpoint / RECORD).read_text())["files"]
        on_disk = {str(p.relative_to(checkpoint)) for p in checkpoint.rglob("*") if p.is_file()}
        assert on_disk - set(record) == {"_CHECKPOINT_METADATA", "commit_success.txt", RECORD}
        assert any(name.startswith("state/ocdbt.process_0/d/") for name in record)


def test_two_damaged_checkpoints_fall_back_twice(reference, corpus, tmp_path, capsys):
    run = damaged_copy(reference, tmp_path, FILES["array data (OCDBT data file)"], "zeros")
    for path in files_of(run / "checkpoints" / str(STEPS - EVERY), FILES["b-tree node (merged OCDBT)"]):
        HARMS["7 bytes at offset 40"](path)
    code, err = resume(corpus, run, capsys)
    assert code == 0, err
    assert [line.split(" is damaged")[0] for line in err if "is damaged" in line] == [
        f"checkpoint {run / 'checkpoints' / str(STEPS)}", f"checkpoint {run / 'checkpoints' / str(STEPS - EVERY)}"]
    assert f"resuming {run} from step {STEPS - 2 * EVERY}" in err
    assert_bitwise_equal(full_state(run), reference[1])


def test_a_storage_error_on_files_that_match_their_record_moves_nothing(reference, corpus, tmp_path, capsys):
    """Bytes the storage layer cannot decode, recorded as written (as a writer's bug would leave
    them): not damage. One line names the file; every checkpoint stays where it is."""
    run = damaged_copy(reference, tmp_path, FILES["b-tree node (merged OCDBT)"], "7 bytes at offset 40")
    newest = run / "checkpoints" / str(STEPS)
    (newest / RECORD).unlink()
    write_record(newest)
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    code, err = resume(corpus, run, capsys)
    assert code == 1 and len(err) == 1, err
    assert re.fullmatch(rf"jaxgpt train: error: checkpoint {newest} matches the checksums written with it, but "
                        rf"{newest}/state/d/\w+ cannot be read \(ValueError: .+\); nothing was moved", err[0]), err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before
