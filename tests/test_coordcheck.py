"""`jaxgpt coordcheck`: the widths it builds, its figures (flat in width under muP, growing under
the standard parametrisation) and its files, and one-line errors for widths it cannot build."""

import json

import numpy as np
import pytest

from jaxgpt.cli.main import main
from jaxgpt.config import load_config
from jaxgpt.errors import UserError
from jaxgpt.tools.coordcheck import coordcheck, widened

# Two blocks, head width 16, context 32, a char-sized vocabulary of the built-in BPE; 3 steps at a
# rate high enough to move the weights in that time.
SETS = ["model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.context_length=32", "model.mup_base_width=32",
        "train.batch_size=4", "train.warmup_steps=0", "train.lr=1e-2", "train.sample_tokens=0"]


def test_widths_grow_the_heads_at_the_head_width_and_the_feed_forward_with_the_model():
    cfg = load_config(None, [*SETS, "model.kv_heads=1", "model.hidden_size=48"])
    wide = widened(cfg, 128).model
    assert (wide.d_model, wide.n_heads, wide.kv_heads, wide.hidden_size, wide.scan_layers) == (128, 8, 4, 192, False)
    with pytest.raises(UserError, match="width 40 is not a multiple of the head width 16"):
        widened(cfg, 40)


def test_mup_keeps_every_quantity_flat_in_width_where_sp_grows_it(tmp_path):
    mean = lambda record, w, q: float(np.mean(record["widths"][str(w)][q][-1]))  # noqa: E731
    figures = {}
    for parametrization in ("sp", "mup"):
        cfg = load_config(None, [*SETS, f"model.parametrization={parametrization}"])
        figures[parametrization] = coordcheck(cfg, [32, 128], 3, tmp_path / parametrization, progress=False)
    for quantity in ("attention", "feed_forward", "residual"):
        sp = mean(figures["sp"], 128, quantity) / mean(figures["sp"], 32, quantity)
        mup = mean(figures["mup"], 128, quantity) / mean(figures["mup"], 32, quantity)
        assert sp > 3 and 0.6 < mup < 1.5, (quantity, sp, mup)  # measured: sp 7-10, mup 0.77-1.06
    saved = json.loads((tmp_path / "mup" / "coordcheck.json").read_text())
    assert saved == json.loads(json.dumps(figures["mup"])) and saved["steps"] == 3
    assert [len(saved["widths"]["32"][q]) for q in ("embedding", "attention", "logits")] == [4, 4, 4]  # steps 0..3
    assert len(saved["widths"]["32"]["attention"][0]) == 2  # a figure per block
    assert (tmp_path / "mup" / "coordcheck.png").stat().st_size > 10_000


def test_the_command_refuses_bad_widths_in_one_line(tmp_path, capsys):
    assert main(["coordcheck", *sum((["--set", s] for s in SETS), []), "--widths", "32,x", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == "jaxgpt coordcheck: error: coordcheck: --widths '32,x' must be integers, comma-separated"
    assert main(["coordcheck", *sum((["--set", s] for s in SETS), []), "--widths", "32,24", "--out", str(tmp_path)]) == 2
    assert "width 24 is not a multiple of the head width 16" in capsys.readouterr().err
