"""What `qtool calibrate` counts, and how it says it: the bar counts tokens through the whole model
(not tokens x blocks) at the summary line's rate, counts of 1 are singular, --device's help says
the default it shows, and a merge of two files made from one text says it counts that text twice."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from rich.progress import Progress

from qtool.calibrate_results import CalibrateSummary, DatasetInfo, MergeSummary
from qtool.engine.calibrate.run import WholeModel
from qtool.report import calibrate_console
from tests.conftest import Invoke

pytest.importorskip("transformers")
pytest.importorskip("gguf")

from tests.eval_models import build  # noqa: E402

TEXT = "A short calibration text, repeated until it fills a few windows. " * 30
OTHER = "Another text entirely, about something else, to make other windows. " * 30


class _Recorder:
    def __init__(self) -> None:
        self.starts: list[int] = []
        self.advanced = 0

    def start(self, total_bytes: int) -> None:
        self.starts.append(total_bytes)
        self.advanced = 0

    def advance(self, name: str, nbytes: int) -> None:
        self.advanced += nbytes


def test_the_bar_counts_tokens_through_the_whole_model(tmp_path: Path) -> None:
    """--tokens 128 on 2 blocks showed 256/256: the bar counted a window at every block."""
    from qtool import api

    model = build(tmp_path / "llama", "llama")
    text = tmp_path / "calib.txt"
    text.write_text(TEXT)
    seen = _Recorder()
    result = api.calibrate(model, tmp_path / "x.gguf", [text], 128, 32, threads=1, progress=seen)
    assert result.blocks == 2 and result.tokens == 128
    assert seen.starts == [128] and seen.advanced == 128


def test_whole_model_carries_remainders_exactly() -> None:
    """Token-blocks not a multiple of the block count still end at the exact total."""
    seen = _Recorder()
    whole = WholeModel(seen, 3)
    whole.start(3 * 10)
    for _ in range(3):
        for _ in range(5):
            whole.advance("block", 2)
    assert seen.starts == [10] and seen.advanced == 10


def test_the_rate_is_tokens_over_the_phase_time() -> None:
    """The bar's tokens/s is the summary line's definition (tokens / run seconds): the loading
    before the pass is not counted, nor only the last samples (rich's speed)."""
    now = [0.0]
    progress = Progress(*calibrate_console.columns(), get_time=lambda: now[0], disable=True)
    bar = calibrate_console._CalibrateProgress(progress)
    now[0] = 10.0  # loading took 10 s
    bar.start(1000)
    for t, n in [(11.0, 100), (13.0, 300), (14.0, 200)]:
        now[0] = t
        bar.advance("block 0", n)
    task = progress.tasks[0]
    rates = [str(c.render(task)) for c in progress.columns if not isinstance(c, str)]
    assert "150 tokens/s" in rates, rates  # 600 tokens in the 4 s since the pass began


def _summary(n: int) -> CalibrateSummary:
    return CalibrateSummary(
        model="m", output="o.gguf", architecture="LlamaForCausalLM",
        datasets=(DatasetInfo("t.txt", "ab" * 32, n),), ctx=n, windows=n, tokens=n, entries=n,
        blocks=n, device="cpu", load_seconds=0.1, run_seconds=0.5, peak_block_bytes=1 << 20,
        activation_bytes=1 << 20,
    )  # fmt: skip


_PLURAL_OF_ONE = re.compile(r"\b1 (tokens|windows|blocks|weights|chunks|tensors|block loads)\b")


def test_counts_of_one_are_singular(capsys: pytest.CaptureFixture[str]) -> None:
    """'1 tokens in 1 window of 1': every count calibrate prints agrees with its noun."""
    calibrate_console.print_calibrate(_summary(1))
    calibrate_console.print_merge(MergeSummary(("a", "b"), "c", (), 1, 32, 1))
    out = capsys.readouterr().out
    assert "1 token in 1 window of 1" in out and "1 block," in out and "1 chunk of" in out
    assert not _PLURAL_OF_ONE.search(out), out
    calibrate_console.print_calibrate(_summary(2))
    assert "2 tokens in 2 windows of 2" in capsys.readouterr().out


def test_device_help_says_the_default_it_shows(invoke: Invoke) -> None:
    """The help said 'auto picks CUDA when available' beside [default: cpu]: a reader took the
    default for auto. Help and default now say the CPU."""
    rc, out, _ = invoke("calibrate", "--help", env={"COLUMNS": "200"})
    assert rc == 0
    text = " ".join(out.replace("│", " ").split())
    assert "the CPU unless asked" in text and "[default: cpu]" in text, text


@pytest.mark.filterwarnings("always")  # shown as the CLI shows it, not raised by pytest
def test_merging_two_files_of_one_text_warns(tmp_path: Path, invoke: Invoke) -> None:
    """Two runs over the same text (the same SHA-256 recorded in both) counted its tokens twice
    without a word; files of different texts merge silently, and one file twice is warned of
    once (as the same file), not twice."""
    model = build(tmp_path / "llama", "llama")
    same, other = tmp_path / "calib.txt", tmp_path / "other.txt"
    same.write_text(TEXT)
    other.write_text(OTHER)
    files = {}
    for name, text in [("a", same), ("b", same), ("c", other)]:
        files[name] = tmp_path / f"{name}.gguf"
        rc, _, err = invoke("calibrate", str(model), "--text", str(text), "--tokens", "64",
                            "--ctx", "32", "--threads", "1", "-o", str(files[name]))  # fmt: skip
        assert rc == 0, err
    rc, out, err = invoke("calibrate", "--merge", str(files["a"]), str(files["b"]),
                          "-o", str(tmp_path / "ab.gguf"))  # fmt: skip
    assert rc == 0 and "merged 2 importance matrices" in out
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "a.gguf and " in err, err
    assert "b.gguf were both made from the same text" in err, err
    assert "counts its tokens twice" in err and "SameText" not in err, err

    rc, out, err = invoke("calibrate", "--merge", str(files["a"]), str(files["b"]),
                          "-o", str(tmp_path / "ab2.gguf"), "--json")  # fmt: skip
    assert rc == 0 and err.count("same text") == 1, err  # stderr as without --json
    (warned,) = json.loads(out)["warnings"]
    assert "b.gguf were both made from the same text" in warned, warned

    rc, out, err = invoke("calibrate", "--merge", str(files["a"]), str(files["c"]),
                          "-o", str(tmp_path / "ac.gguf"), "--json")  # fmt: skip
    assert rc == 0 and err == "" and json.loads(out)["warnings"] == [], err

    rc, out, err = invoke("calibrate", "--merge", str(files["a"]), f"{tmp_path}/./a.gguf",
                          "-o", str(tmp_path / "aa.gguf"))  # fmt: skip
    assert rc == 0 and len(err.strip().splitlines()) == 1 and "same file" in err, err


def test_one_idle_expert_of_a_block_is_singular() -> None:
    """'blk.1 experts 0' named one expert in the plural; two stay plural."""
    import numpy as np

    from qtool.engine.calibrate.run import UnroutedExperts, _warn_unrouted
    from qtool.numerics.imatrix import ImportanceMatrix, MatrixStats

    def stacked(counts: list[int]) -> MatrixStats:
        sums = np.outer(np.array(counts, np.float32), np.ones(8, np.float32))  # 0 where idle
        return MatrixStats(sums, np.array(counts, np.int64))

    entries = {"blk.0.ffn_up_exps.weight": stacked([3, 0, 1, 2]),
               "blk.1.ffn_up_exps.weight": stacked([0, 0, 4, 2])}  # fmt: skip
    with pytest.warns(UnroutedExperts) as caught:
        _warn_unrouted(ImportanceMatrix(entries, 32, 1))
    text = str(caught[0].message)
    assert "blk.0 expert 1;" in text and "blk.1 experts 0, 1" in text, text


@pytest.mark.filterwarnings("always")
def test_calibrates_warnings_are_in_its_json(tmp_path: Path, invoke: Invoke) -> None:
    """--json carried none of calibrate's warnings (stderr only): each line stderr shows (here the
    short text's) is in its `warnings` too, as quantize's JSON carries its own."""
    from tests.moe_models import build_moe

    model = build_moe(tmp_path / "m", "mixtral")
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 4)
    rc, out, err = invoke("calibrate", str(model), "--text", str(text), "--tokens", "4096",
                          "--ctx", "1", "--threads", "1", "-o", str(tmp_path / "x.gguf"),
                          "--json")  # fmt: skip
    assert rc == 0, err
    warned = json.loads(out)["warnings"]
    assert any("the calibration text gave" in w for w in warned), warned
    assert len(warned) == len(err.strip().splitlines()), (warned, err)


def test_refusals_count_one_token_in_the_singular(
    invoke: Invoke, monkeypatch: pytest.MonkeyPatch
) -> None:
    """'1 tokens do not fill one window of 2', 'gives 1 tokens': the refusals too."""
    from types import SimpleNamespace
    from typing import Any

    from qtool.engine.calibrate import data
    from qtool.engine.model.text import Text
    from qtool.errors import InputError

    rc, out, err = invoke("calibrate", "model", "--tokens", "1", "--ctx", "2", "-o", "x.gguf")
    assert rc == 2 and out == "" and "1 token does not fill one window of 2" in err, err
    monkeypatch.setattr(data, "leading_ids", lambda *_: [7])  # a text of one token
    tokenizer: Any = SimpleNamespace(backend=SimpleNamespace(bos_token_id=None))
    with pytest.raises(InputError, match="gives 1 token, fewer than one window of 4"):
        data.take_windows([Text("x", "one.txt")], tokenizer, 8, 4)
