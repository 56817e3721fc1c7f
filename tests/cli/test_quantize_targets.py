"""quantize --target-size/--target-bpw/--target-kl (engine/allocate.py): the plan fits its target
counted as the output writes it, is reproduced byte for byte by its saved recipe and by a
second run, follows the imatrix's sensitivities, and the targets' misuse is a one-line error."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import typer

from qtool.cli.quantize_options import parse_size
from qtool.formats.imatrix import write_imatrix
from qtool.formats.imatrix.sensitivity import Sensitivities, sensitivity_keys
from qtool.numerics.imatrix import ImportanceMatrix, MatrixStats
from tests.conftest import Invoke

TINY = Path(__file__).resolve().parents[2] / "sample_weights"


def _run(invoke: Invoke, *args: str) -> Any:
    code, out, err = invoke("quantize", *args, "--threads", "1", "--json")
    assert code == 0, err
    return json.loads(out)


def _note(doc: Any) -> str:
    notes = [n for n in doc["notes"] if str(n).startswith("allocation (")]
    assert len(notes) == 1
    assert not [w for w in doc["warnings"] if "allocation (" in w]  # a plan is no warning
    return str(notes[0])


def _find(pattern: str, text: str) -> str:
    found = re.search(pattern, text)
    assert found is not None, text
    return found.group(1)


def _files(path: Path) -> dict[str, bytes]:
    """The output's files by name (a lone file under '')."""
    if path.is_file():
        return {"": path.read_bytes()}
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


@pytest.mark.parametrize(
    ("src", "fmt", "target"),
    [
        ("tiny-llama", "qtool", ("--target-size", "60KiB")),
        ("tiny-llama", "compressed-tensors", ("--target-size", "0.09MB")),
        ("tiny-llama.gguf", "gguf", ("--target-bpw", "5")),
    ],
    ids=["qtool", "compressed-tensors", "gguf"],
)
def test_the_plan_fits_as_written_and_its_recipe_reproduces_it(
    invoke: Invoke, tmp_path: Path, src: str, fmt: str, target: tuple[str, str]
) -> None:
    """bytes_out (what the output holds: codes, scales, zero points, kept tensors) is the
    plan's own count and within the target; a second run and --recipe of the saved plan write
    the same bytes."""
    suffix = ".gguf" if fmt == "gguf" else ""
    out = [tmp_path / f"o{i}{suffix}" for i in range(3)]
    recipe = tmp_path / "plan.toml"
    common = [str(TINY / src), "--format", fmt]
    doc = _run(invoke, *common, *target, "-o", str(out[0]), "--save-recipe", str(recipe))
    totals = doc["totals"]
    assert isinstance(totals, dict)
    planned = int(_find(r"\((\d+) bytes\), [0-9.]+ bpw", _note(doc)))
    assert totals["bytes_out"] == planned
    # the note's breakdown counts tensors (fused siblings each), as the rows do
    decided = [t for t in doc["tensors"] if "allocation:" in t["decided_by"].get("reason", "")]
    assert sum(int(n) for n in re.findall(r" x(\d+) ", _note(doc))) == len(decided)
    limit = parse_size(target[1]) if target[0] == "--target-size" else 5 * _elements(doc) // 8
    assert planned <= limit
    _structured_plan_is_the_note(doc, target, len(decided))
    assert planned > 0.9 * limit  # it spends the budget (the ladder is fine enough here)
    _run(invoke, *common, *target, "-o", str(out[1]))
    any_type = ["--dtype", "Q8_0"] if fmt == "gguf" else []  # every decided tensor is pinned
    _run(invoke, *common, *any_type, "--recipe", str(recipe), "-o", str(out[2]))
    assert _files(out[0]) == _files(out[1]) == _files(out[2])


def _structured_plan_is_the_note(doc: Any, target: tuple[str, str], decided: int) -> None:
    """The JSON's `allocation` says what the console note says, as numbers (it was only the
    note's string in `warnings`)."""
    plan, note = doc["allocation"], _note(doc)
    kind = target[0].removeprefix("--target-")
    value = parse_size(target[1]) if kind == "size" else float(target[1])
    assert plan["target"] == {"kind": kind, "value": value}
    assert plan["bytes"] == doc["totals"]["bytes_out"] == int(_find(r"\((\d+) bytes\), ", note))
    assert f"{plan['bpw']:.3f} bpw" in note and f"{plan['predicted_loss']:.4g};" in note
    assert plan["loss"] == "relative_output_error"  # no sensitivities here
    unit = "byte" if plan["granularity_bytes"] == 1 else "bytes"
    assert f"(granularity {plan['granularity_bytes']} {unit})" in note
    assert sum(s["tensors"] for s in plan["by_spec"]) == decided
    assert sum(s["bytes"] for s in plan["by_spec"]) <= plan["bytes"]
    for s in plan["by_spec"]:
        assert f"{s['spec']} x{s['tensors']} " in note


def _elements(doc: Any) -> int:
    tensors = doc["tensors"]
    assert isinstance(tensors, list)
    return sum(int(np.prod(t["shape"])) for t in tensors)


def test_more_bytes_never_predict_more_loss(invoke: Invoke, tmp_path: Path) -> None:
    """The least loss within a size falls (weakly) as the size grows: an optimum, not a
    heuristic walk (a greedy by spec order can go up)."""
    losses = []
    for i, size in enumerate(("54KiB", "58KiB", "62KiB", "80KiB", "120KiB")):
        doc = _run(invoke, str(TINY / "tiny-llama"), "--target-size", size, "-o",
                   str(tmp_path / f"o{i}"))  # fmt: skip
        losses.append(float(_find(r"alpha = 1\) ([0-9.e-]+);", _note(doc))))
    assert losses == sorted(losses, reverse=True)
    assert losses[0] > losses[-1]


def _imatrix(
    path: Path, alpha: dict[str, float] | None, joint: tuple[float, float, float] | None = None
) -> None:
    """An imatrix for tiny-llama under llama.cpp's names (h = 1 everywhere), with sensitivities
    `alpha` (llama.cpp names) and their joint fit when given."""
    widths = {"attn_q": 64, "attn_k": 64, "attn_v": 64, "attn_output": 64, "ffn_gate": 64,
              "ffn_up": 64, "ffn_down": 128}  # fmt: skip
    entries = {
        f"blk.{b}.{k}.weight": MatrixStats(np.full((1, w), 3.0, np.float32), np.array([3]))
        for b in range(2)
        for k, w in widths.items()
    }
    extra = None
    if alpha is not None:
        extra = sensitivity_keys(Sensitivities(alpha, "test", 100, joint))
    write_imatrix(path, ImportanceMatrix(entries, 512, 1, ("t.txt",)), extra)


def test_sensitivities_move_bytes_to_the_sensitive_tensor(invoke: Invoke, tmp_path: Path) -> None:
    """With alpha large for one Linear (by its llama.cpp name in the imatrix, mapped to the
    checkpoint's) the allocation spends more on it than with no sensitivities at the same size."""
    _imatrix(tmp_path / "flat.gguf", None)
    alpha = _every_linear(1e-3)
    alpha["blk.1.ffn_down.weight"] = 1e3
    _imatrix(tmp_path / "steep.gguf", alpha)
    src = [str(TINY / "tiny-llama"), "--target-size", "56KiB"]
    specs = {}
    for name in ("flat", "steep"):
        doc = _run(invoke, *src, "--imatrix", str(tmp_path / f"{name}.gguf"), "-o",
                   str(tmp_path / name))  # fmt: skip
        rows = {t["name"]: t for t in doc["tensors"]}
        specs[name] = rows["model.layers.1.mlp.down_proj.weight"]
    # the reason names the candidate's bytes as written (codes and qparams)
    spent = {k: int(_find(r"(\d+) bytes$", v["decided_by"]["reason"])) for k, v in specs.items()}
    assert spent["steep"] > spent["flat"]


def _every_linear(value: float) -> dict[str, float]:
    """alpha `value` for each of tiny-llama's Linears, the embedding and the head."""
    kinds = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    alpha = {f"blk.{b}.{k}.weight": value for b in range(2) for k in kinds}
    return alpha | {"token_embd.weight": value, "output.weight": value}


def test_a_kl_target_without_sensitivities_is_refused(invoke: Invoke, tmp_path: Path) -> None:
    _imatrix(tmp_path / "flat.gguf", None)
    for extra in ([], ["--imatrix", str(tmp_path / "flat.gguf")]):
        code, out, err = invoke("quantize", str(TINY / "tiny-llama"), "--target-kl", "0.1",
                                "-o", str(tmp_path / "o"), *extra)  # fmt: skip
        assert code == 2 and out == ""
        assert "needs sensitivities" in err and len(err.strip().splitlines()) == 1
        assert not (tmp_path / "o").exists()


def _kl_run(invoke: Invoke, tmp_path: Path, name: str, kl: str = "0.002") -> Any:
    return _run(invoke, str(TINY / "tiny-llama"), "--target-kl", kl, "--imatrix",
                str(tmp_path / f"{name}.gguf"), "-o", str(tmp_path / name))  # fmt: skip


def _sum_alpha_r(doc: Any, alpha: dict[str, float]) -> float:
    """S recomputed from the output's rows: alpha (by llama.cpp name) x the r of the spec each
    decided tensor was written with (its trial's SQNR; 0 for one kept float)."""
    llama = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight"}
    kinds = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj":
             "attn_v", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}  # fmt: skip
    for b in range(2):
        for hf, ll in kinds.items():
            llama[f"model.layers.{b}.{hf}.weight"] = f"blk.{b}.{ll}.weight"
    total = 0.0
    for row in doc["tensors"]:
        decided = row["decided_by"]
        if decided["origin"] != "budget" or decided["action"] != "quantize":
            continue
        db = next(t["sqnr_db"] for t in decided["trials"] if t["spec"] == decided["spec"])
        total += alpha[llama[row["name"]]] * 10 ** (-db / 10)
    return total


def test_a_kl_target_with_sensitivities_is_met(invoke: Invoke, tmp_path: Path) -> None:
    """The predicted KL is the sum of alpha x r over what the output holds (recomputed from its
    rows, not the solver's own figure) and within the target."""
    alpha = _every_linear(0.5)
    _imatrix(tmp_path / "s.gguf", alpha)
    doc = _kl_run(invoke, tmp_path, "s")
    kl = float(_find(r"predicted KL ([0-9.e-]+) ", _note(doc)))
    found = doc["allocation"]
    assert found["loss"] == "kl" and not found["joint_fit"] and found["kept_without_alpha"] == 0
    assert 0 < kl <= 0.002 and found["predicted_loss"] == found["sum_alpha_r"]
    assert _sum_alpha_r(doc, alpha) == pytest.approx(found["sum_alpha_r"], rel=1e-6)
    assert found["sum_alpha_r"] <= 0.002


def test_the_embedding_and_head_alphas_reach_the_plan(invoke: Invoke, tmp_path: Path) -> None:
    """alpha stored under token_embd.weight / output.weight (no imatrix entry of theirs) weighs
    the checkpoint's embedding and head: a steep one buys them more bytes (they weighed 1)."""
    steep = _every_linear(0.5) | {"token_embd.weight": 1e3, "output.weight": 1e3}
    _imatrix(tmp_path / "flat.gguf", _every_linear(0.5))
    _imatrix(tmp_path / "steep.gguf", steep)
    spent = {}
    for name in ("flat", "steep"):
        doc = _kl_run(invoke, tmp_path, name, "0.01")
        rows = {t["name"]: t for t in doc["tensors"]}
        spent[name] = [int(_find(r"(\d+) bytes$", rows[t]["decided_by"]["reason"]))
                       for t in ("model.embed_tokens.weight", "lm_head.weight")]  # fmt: skip
        alpha = steep if name == "steep" else _every_linear(0.5)
        assert _sum_alpha_r(doc, alpha) == pytest.approx(doc["allocation"]["sum_alpha_r"])
    assert spent["steep"][0] > spent["flat"][0] and spent["steep"][1] > spent["flat"][1]


def test_a_tensor_without_alpha_is_kept_float(invoke: Invoke, tmp_path: Path) -> None:
    """Sensitivities that lack a decided tensor (here the embedding and head) leave it out of
    the allocation, kept float (no KL cost to weigh), not weighed as alpha 1 in KL units."""
    alpha = _every_linear(0.5)
    del alpha["token_embd.weight"], alpha["output.weight"]
    _imatrix(tmp_path / "s.gguf", alpha)
    doc = _kl_run(invoke, tmp_path, "s")
    rows = {t["name"]: t for t in doc["tensors"]}
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert rows[name]["decided_by"]["action"] == "keep"
        assert "no sensitivity" in rows[name]["decided_by"]["reason"]
    assert doc["allocation"]["kept_without_alpha"] == 2
    assert "2 tensor(s) with no alpha kept float" in _note(doc)
    assert _sum_alpha_r(doc, alpha) == pytest.approx(doc["allocation"]["sum_alpha_r"])


def test_a_linear_the_statistics_weigh_without_alpha_refuses_a_target(
    invoke: Invoke, tmp_path: Path
) -> None:
    """Sensitivities missing a Linear the imatrix has statistics for (the run saw it, its
    sensitivity pass measured nothing for it) refuse the target, naming the tensor: kept float
    it would be left out of the budget (a mixture of experts' experts, tests/engine)."""
    alpha = _every_linear(0.5)
    del alpha["blk.1.ffn_down.weight"]
    _imatrix(tmp_path / "s.gguf", alpha)
    for target in (["--target-kl", "0.01"], ["--target-size", "56KiB"]):
        code, out, err = invoke("quantize", str(TINY / "tiny-llama"), *target, "--imatrix",
                                str(tmp_path / "s.gguf"), "-o", str(tmp_path / "o"))  # fmt: skip
        said = " ".join(err.split())
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
        assert "measured for none of 1 tensors" in said
        assert "model.layers.1.mlp.down_proj.weight" in said
        assert not (tmp_path / "o").exists()


def test_sensitivities_of_another_model_refuse_a_kl_target(invoke: Invoke, tmp_path: Path) -> None:
    """alpha under names of no tensor of the input: no KL to predict (a sum of r is not one)."""
    _imatrix(tmp_path / "s.gguf", {f"blk.{b}.attn_q.weight": 0.5 for b in range(5, 9)})
    args = ["--target-kl", "0.01", "--imatrix", str(tmp_path / "s.gguf")]
    code, out, err = invoke("quantize", str(TINY / "tiny-llama"), *args, "-o", str(tmp_path / "o"))
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "name none of the tensors" in err and "s.gguf" in err
    assert not (tmp_path / "o").exists()


def test_the_joint_fit_bounds_the_plan(invoke: Invoke, tmp_path: Path) -> None:
    """With a joint fit (gain 4, saturation 50) the plan keeps S within sum_within(target),
    not the target itself, and reports gain S / (1 + saturation S) as its predicted KL."""
    alpha = _every_linear(0.5)
    _imatrix(tmp_path / "plain.gguf", alpha)
    _imatrix(tmp_path / "fit.gguf", alpha, (4.0, 50.0, 1.0))
    plain, fit = (_kl_run(invoke, tmp_path, n)["allocation"] for n in ("plain", "fit"))
    bound = 0.002 / (4.0 - 50.0 * 0.002)
    assert fit["joint_fit"] and 0 < fit["sum_alpha_r"] <= bound < plain["sum_alpha_r"]
    s = fit["sum_alpha_r"]
    assert fit["predicted_loss"] == pytest.approx(4 * s / (1 + 50 * s)) and s < 0.002
    assert fit["bytes"] > plain["bytes"]


def test_a_size_target_that_fits_nothing_reports_bytes_with_sensitivities(
    invoke: Invoke, tmp_path: Path
) -> None:
    """The least a size target's ladder reaches is bytes: sensitivities (a joint fit, whose
    predicted KL of a byte count is a small number) leave the refusal's figure as it is
    without them, not a KL added to the fixed bytes."""
    _imatrix(tmp_path / "flat.gguf", None)
    _imatrix(tmp_path / "fit.gguf", _every_linear(0.5), (4.0, 50.0, 1.0))
    said = {}
    for name in ("flat", "fit"):
        code, out, err = invoke("quantize", str(TINY / "tiny-llama"), "--target-size", "1KiB",
                                "--imatrix", str(tmp_path / f"{name}.gguf"),
                                "-o", str(tmp_path / name))  # fmt: skip
        assert code == 2 and out == "", err
        said[name] = " ".join(err.split())
    assert "the smallest the ladder makes is" in said["fit"]
    assert said["fit"] == said["flat"]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--target-size", "1KiB"], "no plan fits size 1.00 KiB"),
        (["--target-size", "10 parsecs"], "is no size"),
        (
            ["--target-size", "1MiB", "--target-sqnr", "20"],
            "give one target: --target-sqnr and --target-size both given",
        ),
        (
            ["--target-bpw", "5", "--target-size", "10KB"],
            "give one target: --target-size and --target-bpw both given",
        ),
        (
            ["--target-bpw", "1"],
            "no plan fits bpw 1 = 11.04 KiB (11304 bytes) for its 90432 weights: the smallest",
        ),
        (
            ["--target-kl", "0.1"],
            "(qtool calibrate --sensitivity, then --imatrix FILE; or --target-size)",
        ),
        (["--target-bpw", "0"], "must be a finite number above 0, not 0.0"),
        (["--target-kl", "inf"], "must be a finite number above 0, not inf"),
        (["--target-kl", "nan"], "must be a finite number above 0, not nan"),
        (["--save-recipe", "r.toml"], "writes an allocation's plan"),
        (["--target-bpw", "4", "--tensor-type-file", "t.txt"], "add --format gguf"),
        (["--target-bpw", "4", "--dry-run"], "add --estimate"),
    ],
    ids=[
        "too-small",
        "not-a-size",
        "two-targets",
        "bpw-and-size",
        "bpw-too-small-in-bytes",
        "kl-without-sensitivities",
        "bpw-0",
        "kl-inf",
        "kl-nan",
        "recipe-alone",
        "tt-not-gguf",
        "plain-dry-run",
    ],  # fmt: skip
)
def test_misuse_is_one_line(invoke: Invoke, tmp_path: Path, args: list[str], says: str) -> None:
    code, out, err = invoke("quantize", str(TINY / "tiny-llama"), "-o", str(tmp_path / "o"),
                            *args)  # fmt: skip
    assert code == 2 and out == "", err
    assert says in " ".join(err.split())
    assert not (tmp_path / "o").exists()


def test_parse_size() -> None:
    assert parse_size("100MiB") == 100 * 2**20
    assert parse_size("0.1GB") == 10**8
    assert parse_size("1.5 kib") == 1536
    assert parse_size("5000") == 5000
    assert parse_size("1e3KB") == 10**6
    for bad in ("", "MiB", "-1MiB", "1 MiBs", "0.1", "nan", "1e99GB"):
        with pytest.raises(typer.BadParameter):
            parse_size(bad)


def test_the_tensor_type_file_is_what_llama_quantize_parses(invoke: Invoke, tmp_path: Path) -> None:
    """Whitespace-separated name=type (quantize.cpp's parse_tensor_type_file); each name an
    anchored regex matching exactly its one tensor of the output GGUF (llama.cpp lowercases the
    name and regex_searches each in turn), each type a ggml type name."""
    out, tt = tmp_path / "o.gguf", tmp_path / "tt.txt"
    doc = _run(invoke, str(TINY / "tiny-llama.gguf"), "--format", "gguf", "--target-bpw", "5",
               "-o", str(out), "--tensor-type-file", str(tt))  # fmt: skip
    rows = {t["name"]: t for t in doc["tensors"]}
    names = list(rows)
    items = tt.read_text().split()
    assert len(items) == sum(1 for t in rows.values() if t["quantized"])
    for item in items:
        pattern, kind = item.split("=")
        hits = [n for n in names if re.search(pattern, n.lower())]
        assert len(hits) == 1
        assert kind == str(rows[hits[0]]["out_dtype"]).lower()


def test_a_recipe_narrows_the_ladder_and_pins_tensors(invoke: Invoke, tmp_path: Path) -> None:
    """A recipe's ladder replaces the default (float is still offered) and a tensor its rule
    fixes stays outside the allocation, its bytes counted against the size as written."""
    recipe = tmp_path / "r.toml"
    recipe.write_text(
        'ladder = ["int8", "int4 g32 mse"]\n\n'
        '[[rule]]\nmatch = "model.layers.0.mlp.down_proj.weight"\ndtype = "int8"\n'
    )
    doc = _run(invoke, str(TINY / "tiny-llama"), "--target-size", "70KiB", "--recipe",
               str(recipe), "-o", str(tmp_path / "o"))  # fmt: skip
    rows = {t["name"]: t for t in doc["tensors"]}
    pinned = rows["model.layers.0.mlp.down_proj.weight"]["decided_by"]
    assert pinned["origin"] == "recipe"
    labels = {
        _find(r"allocation: ([^,]+),", t["decided_by"]["reason"])
        for t in rows.values()
        if t["decided_by"]["origin"] == "budget"
    }
    assert labels and labels <= {"int8 channel", "int4 g32 mse", "float"}
    assert doc["totals"]["bytes_out"] <= 70 * 1024


@pytest.mark.parametrize(
    "target",
    [("--target-sqnr", "30"), ("--target-size", "60KiB"), ("--target-bpw", "5")],
    ids=["sqnr", "size", "bpw"],
)
def test_every_target_names_the_spec_options_it_overrides(
    invoke: Invoke, tmp_path: Path, target: tuple[str, str]
) -> None:
    """A target picks each tensor's spec from its ladder: spec options given with it are
    ignored, and one warning names them and the target (an allocation ignored them silently)."""
    src = [str(TINY / "tiny-llama"), *target, "--threads", "1"]
    spec = ["--scheme", "asym", "--dtype", "uint4", "--group-size", "32", "--range", "mse"]
    code, _, err = invoke("quantize", *src, *spec, "-o", str(tmp_path / "a"))
    warnings = [line for line in err.splitlines() if "ignored" in line]
    assert code == 0 and len(warnings) == 1, err
    assert f"--scheme, --dtype, --group-size, --range ignored: {target[0]} picks" in warnings[0]
    code, _, err = invoke("quantize", *src, "-o", str(tmp_path / "b"))
    assert code == 0 and "ignored" not in err


def test_a_tied_embedding_the_kl_allocation_chose_is_a_note_not_a_warning(
    invoke: Invoke, tmp_path: Path
) -> None:
    """An allocation with sensitivities weighs the tied embedding's KL (head included): when it
    picks 4 bits for it, a note says so, not the warning against a rule's 4 bits; and its
    missing imatrix entry (no imatrix has the embedding: a row lookup) is no warning either.
    The same 4 bits by a rule still warn."""
    alpha = _every_linear(0.5)
    del alpha["output.weight"]
    _imatrix(tmp_path / "s.gguf", alpha | {"token_embd.weight": 1e-9})
    embed, src = "model.embed_tokens.weight", str(TINY / "tiny-lm")
    doc = _run(invoke, src, "--target-kl", "0.01", "--imatrix", str(tmp_path / "s.gguf"),
               "-o", str(tmp_path / "kl"))  # fmt: skip
    row = next(t for t in doc["tensors"] if t["name"] == embed)
    assert row["quantized"] and row["decided_by"]["origin"] == "budget"
    assert doc["warnings"] == []
    assert [n for n in doc["notes"] if n.startswith(f"{embed} is also the output head")]
    assert "measured sensitivity" in " ".join(doc["notes"])
    ruled = _run(invoke, src, "--dtype", "int4", "--group-size", "32", "--include", "*embed*",
                 "--range", "mse",
                 "--imatrix", str(tmp_path / "s.gguf"), "-o", str(tmp_path / "rule"))  # fmt: skip
    assert [w for w in ruled["warnings"] if "keep it float or at 8 bits" in w]
    assert not [w for w in ruled["warnings"] if "no entry" in w]
