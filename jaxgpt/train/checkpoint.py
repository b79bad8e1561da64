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
They read the params alone, never the optimiser's state: the manifest holds the params' own
checksum beside the state's (a checkpoint written before it is read whole). A trainer removes a
checkpoint it no longer keeps by moving it out of the listing in one rename before deleting it,
so a reader finds each checkpoint whole or gone.
A checkpoint whose files all match their record is not damaged: if the storage layer still fails
to read it, that is one line naming the file (`Unreadable`), and nothing is moved.

How Orbax is driven (its handlers, the event loops of a restore, its log lines, which of its
errors mean damage) is `jaxgpt.train.orbax_plumbing`'s; this module says what a checkpoint is.
"""

from __future__ import annotations

import functools
import logging
import re
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jaxgpt.config import ModelConfig, RunConfig, build_config, load_config
from jaxgpt.errors import Failure, UserError
from jaxgpt.model.decoder import Params, init_params
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

if TYPE_CHECKING:  # the optimiser's module: a reader never imports it
    from jaxgpt.train.step import TrainState


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


@functools.partial(jax.jit, static_argnames="positions")
def _leaf_sums(leaves: list[Any], positions: tuple[int, ...]) -> jax.Array:
    """Each leaf's bits summed with weights that depend on its position in its tree (uint32, exact
    on any sharding: modular sums commute)."""
    sums = []
    for i, leaf in zip(positions, leaves):
        leaf = jnp.asarray(leaf)
        unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[leaf.dtype.itemsize]
        bits = jax.lax.bitcast_convert_type(leaf, unsigned).astype(jnp.uint32).reshape(-1)
        weights = jnp.arange(bits.size, dtype=jnp.uint32) * jnp.uint32(2654435761) + jnp.uint32(2 * i + 1)
        sums.append(jnp.sum(bits * weights, dtype=jnp.uint32))
    return jnp.stack(sums)


def _folded(sums: Any) -> int:
    """The leaves' sums folded in order into one uint32."""
    total = 0
    for value in np.asarray(jax.device_get(sums)).tolist():
        total = (total * 1000003 + int(value)) % 2**32
    return total


def tree_checksum(tree: Any) -> int:
    """A uint32 checksum of every bit of every leaf, in the tree's order."""
    leaves = jax.tree_util.tree_leaves(tree)
    return _folded(_leaf_sums(leaves, tuple(range(len(leaves)))))


def _checksums(state: TrainState, names: list[str]) -> tuple[int, int]:
    """(the state's checksum, its params' checksum) of a state whose leaves are `names`: the
    params' leaves' sums, weighed at their places in the state, folded alone, so that the params
    read alone can be checked."""
    sums = np.asarray(jax.device_get(_leaf_sums(jax.tree_util.tree_leaves(state), tuple(range(len(names))))))
    return _folded(sums), _folded([sums[i] for i, name in enumerate(names) if _is_param(name)])


def _is_param(name: str) -> bool:
    return name.startswith("params.")


class ParamsOnly(NamedTuple):
    """What a reader asks a checkpoint for: the params (abstract), named as in the train state."""
    params: Params


def abstract_state(cfg: RunConfig) -> TrainState:
    """The run's whole train state, abstract, on this process's first device (a restore target)."""
    from jaxgpt.train.step import init_state

    return on_one_device(jax.eval_shape(lambda: init_state(cfg, jax.random.key(0))))


def _reader_target(cfg: RunConfig) -> ParamsOnly:
    return ParamsOnly(on_one_device(jax.eval_shape(lambda: init_params(cfg.model, jax.random.key(0)))))


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

# Where a trainer moves a checkpoint it no longer keeps, whole, in one rename, before deleting it:
# a reader sees a checkpoint entire or not at all, never one losing its files while it reads.
REMOVED = ".removed"


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
                todelete_subdir=REMOVED, async_options=ocp.AsyncOptions(post_finalization_callback=self._record_files))
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
        names = [name for name, _ in leaf_names(state)]
        state_checksum, params_checksum = _checksums(state, names)
        manifest = {**manifest, "step": step, "data_step": step, "state_checksum": state_checksum,
                    "params_checksum": params_checksum, "state_leaves": names, MANIFEST_KEY: True}
        started = time.perf_counter()
        self.manager.wait_until_finished()  # one save in flight: `_record_files` knows its step
        waited = time.perf_counter() - started
        self._delete_removed()  # before the next is written: the disk holds keep + 1 at most
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

    def _delete_removed(self) -> None:
        """Delete the checkpoints Orbax moved out of the listing (`REMOVED`): the primary process
        moves them, and none but a trainer's reads that folder."""
        removed = self.directory / REMOVED
        if not self.read_only and jax.process_index() == 0 and removed.exists():
            shutil.rmtree(removed)

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
        self._verify(step)
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
        if order is not None and tree_checksum(order) != manifest.get("state_checksum"):
            raise Damaged("its contents do not match the checksum written with it")
        return state, manifest, carried

    def restore_params(self, like: Any, step: int, whole: Callable[[], TrainState] | None = None
                       ) -> tuple[Params, dict[str, Any]]:
        """The params of `step` alone, in the structure and placement of `like.params` (abstract,
        a `ParamsOnly` or a train state: nothing of the optimiser's state is read or held):
        (params, manifest). The checks are `restore`'s: the files against their record, then the
        params against the checksum written with them; a checkpoint written before that checksum
        is restored whole, into `whole()` (default: `like`)."""
        self._verify(step)
        manifest = self._manifest(step)
        order = manifest.get("state_leaves")
        if "params_checksum" not in manifest or not isinstance(order, list):
            state, manifest, _ = self.restore(like if whole is None else whole(), step)
            return state.params, manifest
        wanted = [(name, leaf) for name, leaf in leaf_names(like) if _is_param(name)]
        saved = {name: leaf for name, leaf in self._saved_leaves(step).items() if _is_param(name)}
        if not same_layout(wanted, saved):
            raise StateMismatch(f"checkpoint {self.directory / str(step)} is not this model's: its params differ",
                                manifest.get("config"))
        abstract = {"params": jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, like.params)}
        params = self._read(step, abstract, ocp.checkpoint_utils.construct_restore_args(abstract),
                            partial=True)["params"]
        read = dict(leaf_names({"params": params}))
        places = [(i, name) for i, name in enumerate(order) if _is_param(name)]
        if {name for _, name in places} != set(read):
            raise Damaged("its manifest lists other params than it holds")
        sums = _leaf_sums([read[name] for _, name in places], tuple(i for i, _ in places))
        if _folded(sums) != manifest["params_checksum"]:
            raise Damaged("its params do not match the checksum written with them")
        return params, manifest

    def _verify(self, step: int) -> None:
        """Check the files of `step` against their record (Damaged where one differs), and note
        whether they all matched, for telling damage from other storage errors."""
        if verify(self.directory / str(step)):
            self._verified.add(step)
        else:
            self._verified.discard(step)

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

    def _read(self, step: int, abstract: Any, restore_args: Any, partial: bool = False) -> Any:
        try:
            with loops_that_finish_their_tasks():
                return self.manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.PyTreeRestore(abstract, restore_args, partial_restore=partial)))["state"]
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
            order = [name for name, _ in leaf_names(abstract_state(saved_cfg))]
        return order if order is not None and set(order) == names and len(order) == len(names) else None

    def restore_newest_good(
        self, like: Any, warn: Callable[[str], None], fresh: TrainState | None = None, *,
        whole: Callable[[], TrainState] | None = None, params_only: bool = False,
    ) -> Any:
        """The newest checkpoint that restores and verifies (`restore`; `restore_params` with
        `params_only`, what a reader returns, `whole` its fallback). A damaged newer one is
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
                    return self.restore_params(like, step, whole) if params_only else self.restore(like, step, fresh)
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
        self._delete_removed()
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
        try:
            checkpointer.restore_params(_reader_target(cfg), newest, lambda: abstract_state(cfg))
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
    return load_step(run_dir, None, warn)


def load_step(run_dir: str | Path, step: int | None = None,
              warn: Callable[[str], None] = _to_stderr) -> tuple[ModelConfig, Params, int]:
    """`load_newest`, or the checkpoint of `step` (one line where the run has none at it)."""
    cfg = load_run_config(run_dir)
    params, step = read_params(run_dir, cfg, step, warn)
    return cfg.model, params, step


def read_params(run_dir: str | Path, cfg: RunConfig, step: int | None = None,
                warn: Callable[[str], None] = _to_stderr) -> tuple[Params, int]:
    """The params and step of a run whose config the caller has read (`load_run_config`): the
    newest good checkpoint's, or those of `step`."""
    checkpointer = Checkpointer(Path(run_dir), keep=cfg.train.keep_checkpoints, read_only=True)
    try:
        if step is not None:
            if step not in checkpointer.steps():
                raise UserError(f"{run_dir} has no checkpoint at step {step} (it has {checkpointer.steps() or 'none'})")
            params, _ = checkpointer.restore_params(_reader_target(cfg), step, lambda: abstract_state(cfg))
            return params, step
        found = checkpointer.restore_newest_good(_reader_target(cfg), warn, params_only=True,
                                                 whole=lambda: abstract_state(cfg))
    finally:
        checkpointer.close()
    if found is None:
        raise FileNotFoundError(f"no good checkpoint in {RunDir(run_dir).checkpoints}")
    params, manifest = found
    return params, manifest["step"]
