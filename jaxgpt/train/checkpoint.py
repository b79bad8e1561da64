"""Checkpoints over Orbax's CheckpointManager: the train state plus a JSON manifest.

A run directory holds `config.toml` (resolved), `tokenizer.json` and `checkpoints/<step>/`. Each
checkpoint holds the state (params, optimiser state, step) and a manifest: the fingerprints of the
config, tokenizer and token files it was trained with, the resolved config itself (to name what
differs on a mismatch), the data position, and a checksum of the state computed on the device
before the write. Orbax writes each checkpoint into a temporary folder and renames it when
complete, so a half-written one is never listed. The save's last act before that rename records
the size and SHA-256 of every file (`checkpoint_files`); a restore checks them before Orbax reads
anything, and the state's checksum catches what a bug could write wrong.

Only the trainer writes to a run. It moves a damaged checkpoint aside (to `checkpoints/damaged-<step>`,
or `damaged-<step>-<n>` when that name is taken) and uses the previous one. Readers (`load_run`:
generate, eval, export-hf, bench) open the run read-only: they skip a damaged checkpoint with a
warning and never delete, rename or create anything, so a run being trained is safe to read.
A checkpoint whose files all match their record is not damaged: if the storage layer still fails
to read it, that is one line naming the file (`Unreadable`), and nothing is moved.

How Orbax is driven (its handlers, the event loops of a restore, its log lines, which of its
errors mean damage) is `jaxgpt.train.orbax_plumbing`'s; this module says what a checkpoint is.
"""

from __future__ import annotations

import logging
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from jaxgpt.config import ModelConfig, RunConfig, build_config, load_config
from jaxgpt.errors import Failure, UserError
from jaxgpt.model.decoder import Params
from jaxgpt.runs.rundir import RunDir
from jaxgpt.train.checkpoint_files import MANIFEST_KEY, Damaged, verify, write_record
from jaxgpt.train.orbax_plumbing import (
    ReaderNotices,
    TrainerNotices,
    first_line,
    handlers,
    loops_that_finish_their_tasks,
    storage_error,
)
from jaxgpt.train.state_layout import Carried, NotCarried, carry_over, leaf_names, same_layout
from jaxgpt.train.step import TrainState, init_state


class StateMismatch(UserError):
    """A good checkpoint of another model's state: refused, and left where it is. `saved_config`:
    the config its manifest records, to name what differs."""

    def __init__(self, message: str, saved_config: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.saved_config = saved_config


class Unreadable(Failure):
    """A checkpoint whose files all match their record, which the storage layer still fails to
    read (another tensorstore, a bug): not damage, so nothing is moved; one line names the file."""


def _classified(err: Exception, folder: Path, verified: bool) -> Exception:
    """`err`, as Damaged where it says the files are damaged, as Unreadable where it would but
    every file matched its record (`verified`), as itself otherwise (memory, a permission, a bug),
    so that nothing good is moved aside for it."""
    if isinstance(err, (Damaged, StateMismatch)) or not storage_error(err):
        return err
    if verified:
        named = re.findall(r'local file "([^"]+)"', str(err))
        return Unreadable(f"checkpoint {folder} matches the checksums written with it, but "
                          f"{named[-1] if named else 'one of its files'} cannot be read "
                          f"({type(err).__name__}: {first_line(err)}); nothing was moved")
    return Damaged(f"unreadable ({type(err).__name__}: {first_line(err)})")


def _assemble(like: TrainState, carried: Carried, raw: dict[str, Any], fresh: TrainState | None) -> TrainState:
    """The state asked for, each leaf from the saved one it continues or from `fresh`, placed as
    `like` places it."""
    fresh_leaves = dict(leaf_names(fresh)) if fresh is not None else {}
    leaves = []
    for name, want in leaf_names(like):
        source = carried.sources[name]
        if source is not None:
            value = raw[source]
        elif name in fresh_leaves:
            value = fresh_leaves[name]
        else:
            value = jnp.zeros(want.shape, want.dtype)
        sharding = getattr(want, "sharding", None)
        leaves.append(jax.device_put(value, sharding) if sharding is not None else value)
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(like), leaves)


@jax.jit
def tree_checksum(tree: Any) -> jax.Array:
    """A uint32 checksum of every bit of every leaf; exact on any sharding (modular sums commute)."""
    total = jnp.uint32(0)
    for i, leaf in enumerate(jax.tree_util.tree_leaves(tree)):
        leaf = jnp.asarray(leaf)
        unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[leaf.dtype.itemsize]
        bits = jax.lax.bitcast_convert_type(leaf, unsigned).astype(jnp.uint32).reshape(-1)
        weights = jnp.arange(bits.size, dtype=jnp.uint32) * jnp.uint32(2654435761) + jnp.uint32(2 * i + 1)
        total = total * jnp.uint32(1000003) + jnp.sum(bits * weights, dtype=jnp.uint32)
    return total


def on_one_device(abstract: Any) -> Any:
    """Abstract arrays placed on this process's first device: a restore target that ignores the
    devices named in the checkpoint (it may come from a run on other or more devices)."""
    one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return jax.tree_util.tree_map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=one),
                                  abstract)


# A save that waits longer than this for the previous one is worth a note: checkpoints come faster
# than the storage takes them, and each wait stops training (Orbax warns from 1 s as well).
SLOW_SAVE_S = 1.0


# A reader lists the checkpoints while a trainer may remove old ones (keep_checkpoints).
READER_OPEN_ATTEMPTS = 5


class Checkpointer:
    """The checkpoints of one run. `read_only` opens them as a reader: no save, no cleanup of the
    temporary folders a trainer may be writing, no move of a damaged checkpoint."""

    def __init__(self, run_dir: Path, keep: int, *, read_only: bool = False) -> None:
        self.directory = RunDir(run_dir).checkpoints.absolute()
        self.keep = keep
        self.read_only = read_only
        self._notices = ReaderNotices() if read_only else TrainerNotices()
        logging.getLogger("absl").addFilter(self._notices)  # until close()
        self._saving: int | None = None  # the step whose save is in flight
        self._noted_slow = False
        self._verified: set[int] = set()  # steps whose files matched their record at the last restore
        self.manager = self._open()

    def _open(self) -> ocp.CheckpointManager:
        if not self.read_only:
            options = ocp.CheckpointManagerOptions(
                max_to_keep=self.keep, create=True, cleanup_tmp_directories=True, enable_async_checkpointing=True,
                async_options=ocp.AsyncOptions(post_finalization_callback=self._record_files))
            return ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers())
        options = ocp.CheckpointManagerOptions(read_only=True, create=False, cleanup_tmp_directories=False,
                                               enable_async_checkpointing=False, save_root_metadata=False,
                                               save_interval_steps=0)
        for _ in range(READER_OPEN_ATTEMPTS - 1):
            try:
                return ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers())
            except (FileNotFoundError, NotADirectoryError):
                pass  # a trainer removed an old checkpoint while Orbax listed them: list them again
        return ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers())

    def save(self, state: TrainState, manifest: dict[str, Any]) -> None:
        """Start writing a checkpoint of `state`; training goes on while Orbax writes it."""
        if self.read_only:
            raise PermissionError(f"{self.directory} is open read-only")
        step = int(state.step)
        manifest = {**manifest, "step": step, "data_step": step, "state_checksum": int(tree_checksum(state)),
                    "state_leaves": [name for name, _ in leaf_names(state)], MANIFEST_KEY: True}
        started = time.perf_counter()
        self.manager.wait_until_finished()  # one save in flight: `_record_files` knows its step
        waited = time.perf_counter() - started
        if waited > SLOW_SAVE_S and not self._noted_slow and jax.process_index() == 0:
            self._noted_slow = True
            print(f"note: checkpoint {step} waited {waited:.1f} s for checkpoint {self._saving} to be written: "
                  "checkpoints come faster than they are written (raise train.checkpoint_every)", file=sys.stderr)
        self._saving = step
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.PyTreeSave(state), manifest=ocp.args.JsonSave(manifest)
        ), force=True)

    def _record_files(self) -> None:
        """Orbax's last call before it commits the save in flight (on its save thread, in the
        primary process): the record of its files, written into the folder it is about to commit."""
        step = self._saving
        pending = self.directory / f"{step}{ocp.path.atomicity_types.TMP_DIR_SUFFIX}"
        write_record(pending if pending.is_dir() else self.directory / str(step))  # else: committed by a file

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def restore(self, like: TrainState, step: int, fresh: TrainState | None = None
                ) -> tuple[TrainState, dict[str, Any], Carried | None]:
        """Restore `step` into the structure and shardings of `like`: (state, manifest, how it was
        carried over or None). A saved state of another layout whose params and step match is
        carried over (`state_layout`), its new leaves taken from `fresh` (zeros without one: a
        reader needs only the params); one that is another model's raises StateMismatch. Damage
        raises Damaged, and a storage error on a checkpoint whose files all match their record
        Unreadable; any other error (memory, a permission) is raised as itself."""
        if verify(self.directory / str(step)):
            self._verified.add(step)
        else:
            self._verified.discard(step)
        manifest = self._manifest(step)
        saved = self._saved_leaves(step)
        wanted = leaf_names(like)
        if same_layout(wanted, saved):
            abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, like)
            state = self._read(step, abstract, ocp.checkpoint_utils.construct_restore_args(abstract))
            order, carried = [leaf for _, leaf in leaf_names(state)], None
        else:
            try:
                carried = carry_over(wanted, saved)
            except NotCarried as err:
                raise StateMismatch(f"checkpoint {self.directory / str(step)} is not this model's: {err}",
                                    manifest.get("config")) from None
            one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
            raw = dict(leaf_names(self._read(step, None, jax.tree_util.tree_map(
                lambda m: ocp.ArrayRestoreArgs(sharding=one, global_shape=m.shape, dtype=m.dtype),
                self._metadata(step)))))
            names = self._saved_order(manifest, set(raw))
            order = None if names is None else [raw[name] for name in names]
            state = _assemble(like, carried, raw, fresh)
        if order is not None and int(tree_checksum(order)) != manifest.get("state_checksum"):
            raise Damaged("its contents do not match the checksum written with it")
        return state, manifest, carried

    def _manifest(self, step: int) -> dict[str, Any]:
        try:
            with loops_that_finish_their_tasks():
                manifest = self.manager.restore(step, args=ocp.args.Composite(
                    manifest=ocp.args.JsonRestore()))["manifest"]
        except Exception as err:
            raise self._classified(err, step) from None
        if not isinstance(manifest, dict) or manifest.get("step") != step:
            raise Damaged("its manifest is missing or names another step")
        return manifest

    def _metadata(self, step: int) -> Any:
        try:
            with loops_that_finish_their_tasks():
                metadata = self.manager.item_metadata(step)["state"]
        except Exception as err:
            raise self._classified(err, step) from None
        tree = getattr(metadata, "tree", metadata)
        if not tree:
            raise Damaged("the description of its arrays is missing")
        return tree

    def _saved_leaves(self, step: int) -> dict[str, Any]:
        """The saved arrays' metadata (shape, dtype) by name, in the saved tree's order."""
        return dict(leaf_names(self._metadata(step)))

    def _read(self, step: int, abstract: Any, restore_args: Any) -> Any:
        try:
            with loops_that_finish_their_tasks():
                return self.manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.PyTreeRestore(abstract, restore_args)))["state"]
        except Exception as err:
            raise self._classified(err, step) from None

    def _classified(self, err: Exception, step: int) -> Exception:
        """`err` as `_classified` takes it for checkpoint `step`, knowing whether its files verified."""
        return _classified(err, self.directory / str(step), step in self._verified)

    @staticmethod
    def _saved_order(manifest: dict[str, Any], names: set[str]) -> list[str] | None:
        """The saved leaves' names in the order the checksum took them: as the manifest lists
        them, else as the saved config lays its state out (None where that is another layout:
        the checksum cannot be recomputed)."""
        order = manifest.get("state_leaves")
        if order is None and isinstance(manifest.get("config"), dict):
            try:
                saved_cfg = build_config(manifest["config"])
            except ValueError:
                return None
            order = [name for name, _ in leaf_names(jax.eval_shape(lambda: init_state(saved_cfg, jax.random.key(0))))]
        return order if order is not None and set(order) == names and len(order) == len(names) else None

    def restore_newest_good(
        self, like: TrainState, warn: Callable[[str], None], fresh: TrainState | None = None
    ) -> tuple[TrainState, dict[str, Any], Carried | None] | None:
        """The newest checkpoint that restores and verifies (`restore`). A damaged newer one is
        moved aside by a trainer and skipped by a reader; a good one of another layout is carried
        over, or refused (StateMismatch), never moved. A reader skips one the trainer removed
        while it read, and lists again when every checkpoint it listed was removed (a trainer
        that saves faster than the reader restores, keeping few)."""
        self.manager.wait_until_finished()
        for _ in range(READER_OPEN_ATTEMPTS if self.read_only else 1):
            removed = False
            for step in reversed(self.steps()):
                folder = self.directory / str(step)
                try:
                    return self.restore(like, step, fresh)
                except Damaged as err:
                    if self.read_only:
                        gone = not folder.exists()  # the trainer dropped it (keep_checkpoints)
                        if not gone:
                            warn(f"checkpoint {folder} is damaged: {err}; skipped, falling back to the previous one")
                        removed |= gone
                        continue
                    aside = self.aside_name(step)
                    warn(f"checkpoint {folder} is damaged: {err}; "
                         f"moved to {aside.name}, falling back to the previous one")
                    folder.rename(aside)
                    self.manager.close()
                    self.manager = self._open()
                except Exception:
                    if self.read_only and not folder.exists():  # removed while it was read
                        removed = True
                        continue
                    raise
            if not removed:
                return None
            self.manager.close()
            self.manager = self._open()
        return None

    def aside_name(self, step: int) -> Path:
        """A free name for a damaged checkpoint of `step`: `damaged-<step>`, else `damaged-<step>-<n>`."""
        aside, n = self.directory / f"damaged-{step}", 0
        while aside.exists():
            n += 1
            aside = self.directory / f"damaged-{step}-{n}"
        return aside

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
        logging.getLogger("absl").removeFilter(self._notices)


def load_run_config(run_dir: str | Path) -> RunConfig:
    path = RunDir(run_dir).config
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory (no {path.name})")
    return load_config(path)


def finished_at(run_dir: str | Path, steps: int) -> int | None:
    """The step of the run's newest checkpoint if it has reached `steps` and verifies, else None;
    read without writing anything (a damaged one means the run is not finished)."""
    cfg = load_run_config(run_dir)
    checkpointer = Checkpointer(Path(run_dir), keep=cfg.train.keep_checkpoints, read_only=True)
    try:
        newest = checkpointer.latest_step()
        if newest is None or newest < steps:
            return None
        like = on_one_device(jax.eval_shape(lambda: init_state(cfg, jax.random.key(0))))
        try:
            checkpointer.restore(like, newest)
        except (Damaged, StateMismatch):
            return None
        return newest
    finally:
        checkpointer.close()


def _to_stderr(message: str) -> None:
    print(message, file=sys.stderr)


def load_run(run_dir: str | Path, warn: Callable[[str], None] = _to_stderr) -> tuple[ModelConfig, Params]:
    """The model config and params of the newest good checkpoint in a run directory, read without
    writing anything there (a trainer may be writing to it)."""
    cfg, params, _ = load_newest(run_dir, warn)
    return cfg, params


def load_newest(run_dir: str | Path, warn: Callable[[str], None] = _to_stderr) -> tuple[ModelConfig, Params, int]:
    """`load_run`, and the step of the checkpoint it read."""
    cfg = load_run_config(run_dir)
    like = on_one_device(jax.eval_shape(lambda: init_state(cfg, jax.random.key(0))))
    checkpointer = Checkpointer(Path(run_dir), keep=cfg.train.keep_checkpoints, read_only=True)
    try:
        found = checkpointer.restore_newest_good(like, warn)
    finally:
        checkpointer.close()
    if found is None:
        raise FileNotFoundError(f"no good checkpoint in {RunDir(run_dir).checkpoints}")
    state, manifest, _ = found
    return cfg.model, state.params, manifest["step"]


def load_step(run_dir: str | Path, step: int | None = None) -> tuple[ModelConfig, Params, int]:
    """`load_newest`, or the checkpoint of `step` (one line where the run has none at it)."""
    if step is None:
        return load_newest(run_dir)
    cfg = load_run_config(run_dir)
    like = on_one_device(jax.eval_shape(lambda: init_state(cfg, jax.random.key(0))))
    checkpointer = Checkpointer(Path(run_dir), keep=cfg.train.keep_checkpoints, read_only=True)
    try:
        if step not in checkpointer.steps():
            raise UserError(f"{run_dir} has no checkpoint at step {step} (it has {checkpointer.steps() or 'none'})")
        state, _, _ = checkpointer.restore(like, step)
    finally:
        checkpointer.close()
    return cfg.model, state.params, step
