"""A generated corpus of bad inputs: each case builds its files in a directory and says which
command line to run and what the one-line error must say."""

from __future__ import annotations

import json
import os
import pickle
import stat
import struct
import warnings
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

Setup = Callable[[Path], list[str]]  # builds files under the directory, returns CLI args


@dataclass(frozen=True)
class Case:
    id: str
    setup: Setup
    expect: str  # a substring of the error line
    code: int = 1


def raw_safetensors(doc: object, data: bytes = b"", *, length: int | None = None) -> bytes:
    text = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    n = len(text) if length is None else length
    return struct.pack("<Q", n) + text + data


def _f32(name: str = "w", shape: list[int] | None = None, offsets: list[int] | None = None) -> dict:
    shape = shape or [2, 2]
    n = 4
    for d in shape:
        n *= d if isinstance(d, int) else 1
    return {name: {"dtype": "F32", "shape": shape, "data_offsets": offsets or [0, n]}}


def _file(content: bytes, name: str = "bad.safetensors", *extra: str) -> Setup:
    def setup(d: Path) -> list[str]:
        (d / name).write_bytes(content)
        return ["quantize", str(d / name), "-o", str(d / "out" / "q.safetensors"), *extra]

    return setup


def _st(doc: object, data: bytes = b"", length: int | None = None) -> Setup:
    return _file(raw_safetensors(doc, data, length=length))


def _tensors(tensors: dict[str, torch.Tensor], *extra: str) -> Setup:
    def setup(d: Path) -> list[str]:
        save_file(tensors, d / "m.safetensors")
        return [
            "quantize",
            str(d / "m.safetensors"),
            "-o",
            str(d / "out" / "q.safetensors"),
            *extra,
        ]

    return setup


class _Exploit:
    def __init__(self, func: object, arg: str) -> None:
        self.func, self.arg = func, arg

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (self.func, (self.arg,))


def _pickle(obj_factory: Callable[[Path], object], name: str = "m.pt") -> Setup:
    def setup(d: Path) -> list[str]:
        torch.save(obj_factory(d), d / name)
        return ["quantize", str(d / name), "-o", str(d / "out" / "q.safetensors")]

    return setup


def _zip_bomb(d: Path) -> list[str]:
    torch.save({"w": torch.zeros(4096)}, d / "plain.pt")
    with (
        zipfile.ZipFile(d / "plain.pt") as zin,
        zipfile.ZipFile(d / "bomb.pt", "w", zipfile.ZIP_DEFLATED) as zout,
    ):
        for info in zin.infolist():
            zout.writestr(info.filename, zin.read(info))
    (d / "plain.pt").unlink()
    return ["quantize", str(d / "bomb.pt"), "-o", str(d / "out" / "q.safetensors")]


def _truncated_zip(d: Path) -> list[str]:
    torch.save({"w": torch.randn(1000)}, d / "m.pt")
    data = (d / "m.pt").read_bytes()
    (d / "m.pt").write_bytes(data[: len(data) // 2])
    return ["quantize", str(d / "m.pt"), "-o", str(d / "out" / "q.safetensors")]


def _legacy_pickle_exploit(d: Path) -> list[str]:
    payload = {"w": _Exploit(os.system, f"touch {d / 'pwned'}")}
    (d / "m.bin").write_bytes(pickle.dumps(payload, protocol=2))
    return ["quantize", str(d / "m.bin"), "-o", str(d / "out" / "q.safetensors")]


def _fifo(d: Path) -> list[str]:
    os.mkfifo(d / "pipe.safetensors")
    return ["quantize", str(d / "pipe.safetensors"), "-o", str(d / "out" / "q.safetensors")]


def _special_index(kind: str) -> Setup:
    """A sharded checkpoint whose index (or shard) is a FIFO or /dev/zero: refused, not read."""

    def setup(d: Path) -> list[str]:
        model = d / "model"
        model.mkdir()
        index = model / "model.safetensors.index.json"
        shard = model / "a.safetensors"
        if kind.endswith("index"):
            target = index
        else:
            target = shard
            index.write_text(json.dumps({"weight_map": {"w": "a.safetensors"}}))
        if kind.startswith("fifo"):
            os.mkfifo(target)
        else:
            target.symlink_to("/dev/zero")
        return ["quantize", str(model), "-o", str(d / "out" / "q")]

    return setup


def _expanded_bomb(d: Path) -> list[str]:
    """1.5 KB on disk, 10 GB claimed: a stride-0 view of one float."""
    torch.save({"w": torch.zeros(1).expand(50_000, 50_000)}, d / "bomb.pt")
    return ["quantize", str(d / "bomb.pt"), "--dry-run", "--estimate"]


def _repeated_storage(d: Path) -> list[str]:
    """One 4 MiB storage under 300 names: 1.2 GB claimed."""
    shared = torch.zeros(1 << 20)
    torch.save({f"layer.{i}.weight": shared.view(1024, 1024) for i in range(300)}, d / "m.pt")
    return ["quantize", str(d / "m.pt"), "-o", str(d / "out" / "q.safetensors")]


def _torchscript(d: Path) -> list[str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit is deprecated; files remain
        torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), d / "m.pt")
    return ["quantize", str(d / "m.pt"), "-o", str(d / "out" / "q.safetensors")]


def _non_utf8_output(d: Path) -> list[str]:
    save_file({"w": torch.randn(4, 4)}, d / "m.safetensors")
    return ["quantize", str(d / "m.safetensors"), "-o", str(d / "out" / "q\udcff.safetensors")]


def _quantized_pair(d: Path) -> Path:
    tensors = {"w": torch.randn(8, 4), "b": torch.randn(8)}
    tensors |= {"s": torch.randn(4, 4), "t": 10 * torch.randn(4, 4)}  # square, same shape
    save_file(tensors, d / "m.safetensors")
    from qtool import api
    from qtool.engine.plan import QuantizeOptions

    api.quantize(d / "m.safetensors", d / "q.safetensors", QuantizeOptions(), device="cpu")
    return d / "q.safetensors"


def _sidecar_edit(edit: Callable[[dict[str, torch.Tensor], dict[str, object]], None]) -> Setup:
    """Rewrite the sidecar of a fresh pair with `edit` applied to its tensors and manifest."""

    def setup(d: Path) -> list[str]:
        from safetensors.torch import load_file

        q = _quantized_pair(d)
        side = d / "q.qparams.safetensors"
        from qtool.io.stformat import read_header

        manifest = json.loads((read_header(side).metadata or {})["qtool.qparams"])
        tensors = load_file(side)
        edit(tensors, manifest)
        save_file(tensors, side, metadata={"qtool.qparams": json.dumps(manifest)})
        return ["dequantize", str(q), "-o", str(d / "out" / "r.safetensors")]

    return setup


def _keep_digest(d: Path, q: Path) -> None:
    """Re-bind q to its (edited) sidecar so that only the edit itself is under test."""
    from qtool.formats.qtool.manifest import BINDING_KEY, DIGEST_KEY, binding_digest, data_digest
    from qtool.io.stformat import read_header

    side = d / "q.qparams.safetensors"
    header = read_header(q)
    metadata = dict(header.metadata or {})
    metadata[DIGEST_KEY] = data_digest(side, read_header(side))
    metadata[BINDING_KEY] = binding_digest(header.tensors, side)
    from safetensors.torch import load_file

    save_file(load_file(q), q, metadata=metadata)


def _edit_header(path: Path, edit: Callable[[dict[str, dict[str, object]]], None]) -> None:
    """Rewrite a safetensors file's header JSON with `edit` applied; the data stays as it is."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    doc = json.loads(raw[8 : 8 + n])
    edit(doc)
    text = json.dumps(doc).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])


def _swap_offsets(a: str, b: str) -> Callable[[dict[str, dict[str, object]]], None]:
    def edit(doc: dict[str, dict[str, object]]) -> None:
        doc[a]["data_offsets"], doc[b]["data_offsets"] = (
            doc[b]["data_offsets"],
            doc[a]["data_offsets"],
        )

    return edit


def _swap(tensors: dict[str, torch.Tensor], a: str, b: str) -> None:
    tensors[a], tensors[b] = tensors[b], tensors[a]


def _bound_edit(edit: Callable[[dict[str, torch.Tensor], dict[str, object]], None]) -> Setup:
    inner = _sidecar_edit(edit)

    def setup(d: Path) -> list[str]:
        args = inner(d)
        _keep_digest(d, d / "q.safetensors")
        return args

    return setup


def _compare_setup(edit: Callable[[dict[str, torch.Tensor], dict[str, object]], None]) -> Setup:
    inner = _sidecar_edit(edit)

    def setup(d: Path) -> list[str]:
        inner(d)
        return ["compare", str(d / "m.safetensors"), str(d / "q.safetensors")]

    return setup


def _dequantize_setup(mutate: Callable[[Path], None]) -> Setup:
    def setup(d: Path) -> list[str]:
        q = _quantized_pair(d)
        mutate(d)
        return ["dequantize", str(q), "-o", str(d / "out" / "r.safetensors")]

    return setup


def _set(mapping: dict[str, object], key: str, value: object, tensor: str = "w") -> None:
    tensors = mapping["tensors"]
    assert isinstance(tensors, dict)
    tensors[tensor][key] = value


def _output_setup(kind: str) -> Setup:
    def setup(d: Path) -> list[str]:
        save_file({"w": torch.randn(4, 4)}, d / "m.safetensors")
        src = str(d / "m.safetensors")
        if kind == "missing-dir":
            return ["quantize", src, "-o", str(d / "out" / "nope" / "q.safetensors")]
        if kind == "same":
            return ["quantize", src, "-o", src, "--force"]
        if kind == "symlink":
            (d / "out" / "link.safetensors").symlink_to(d / "m.safetensors")
            return ["quantize", src, "-o", str(d / "out" / "link.safetensors"), "--force"]
        if kind == "exists":
            (d / "out" / "q.safetensors").write_bytes(b"precious")
            return ["quantize", src, "-o", str(d / "out" / "q.safetensors")]
        if kind == "is-dir":
            (d / "out" / "q.safetensors").mkdir()
            return ["quantize", src, "-o", str(d / "out" / "q.safetensors")]
        return _special_output(d, src, kind)

    return setup


def _special_output(d: Path, src: str, kind: str) -> list[str]:
    """-o naming something that is not a regular file, with --force: never replaced."""
    node = d / "out" / "node.safetensors"
    if kind == "fifo":
        os.mkfifo(node)
    elif kind == "socket":
        os.mknod(node, stat.S_IFSOCK | 0o600)
    elif kind == "link-to-fifo":
        os.mkfifo(d / "fifo")
        node.symlink_to(d / "fifo")
    else:
        raise AssertionError(kind)
    return ["quantize", src, "-o", str(node), "--force"]


def _plot_setup(kind: str) -> Setup:
    """--plot and `qtool plot -o` pass the same output checks as every other output."""

    def setup(d: Path) -> list[str]:
        q = _quantized_pair(d)
        m, out = str(d / "m.safetensors"), str(d / "out" / "q.safetensors")
        (d / "old.png").write_bytes(b"an older plot")
        args = {
            "quantize-plot-is-input": ["quantize", m, "-o", out, "--plot", m],
            "quantize-plot-is-output": ["quantize", m, "-o", out, "--plot", out],
            "quantize-plot-is-sidecar": [
                "quantize", m, "-o", out, "--plot", str(d / "out" / "q.qparams.safetensors")
            ],
            "quantize-plot-exists": ["quantize", m, "-o", out, "--plot", str(d / "old.png")],
            "quantize-plot-dir-missing": ["quantize", m, "-o", out, "--plot", str(d / "no/p.png")],
            "compare-plot-is-sidecar": ["compare", m, str(q), "--plot", str(side(q)), "--force"],
            "compare-plot-exists": ["compare", m, str(q), "--plot", str(d / "old.png")],
            "plot-is-input": ["plot", m, "-t", "w", "-o", m, "--force"],
            "plot-is-sidecar": ["plot", str(q), "-t", "w", "-o", str(side(q)), "--force"],
            "plot-exists": ["plot", m, "-t", "w", "-o", str(d / "old.png")],
            "plot-fifo": ["plot", m, "-t", "w", "-o", _mkfifo(d / "out" / "p.png"), "--force"],
            "quantize-plot-links-to-input": [
                "quantize", m, "-o", out, "--plot", _link(d / "p1.png", m), "--force"
            ],
            "compare-plot-links-to-sidecar": [
                "compare", m, str(q), "--plot", _link(d / "p2.png", str(side(q))), "--force"
            ],
            "plot-links-to-sidecar": [
                "plot", str(q), "-t", "w", "-o", _link(d / "p3.png", str(side(q))), "--force"
            ],
        }  # fmt: skip
        return args[kind]

    return setup


def _link(link: Path, target: str) -> str:
    link.symlink_to(target)
    return str(link)


def side(q: Path) -> Path:
    return q.with_name(f"{q.stem}.qparams.safetensors")


def _mkfifo(path: Path) -> str:
    os.mkfifo(path)
    return str(path)


def _sharded_setup(kind: str) -> Setup:
    """A sharded checkpoint whose output names collide, or whose shards or index are symlinks
    leading out of the checkpoint directory."""

    def setup(d: Path) -> list[str]:
        model = d / "model"
        model.mkdir()
        names = ["a.safetensors", "a.qparams.safetensors" if kind == "collide" else "b.safetensors"]
        weight_map = {}
        for i, name in enumerate(names):
            save_file({f"w{i}": torch.randn(4, 4)}, model / name)
            weight_map[f"w{i}"] = name
        index = model / "model.safetensors.index.json"
        index.write_text(json.dumps({"weight_map": weight_map}))
        elsewhere = d / "elsewhere"
        elsewhere.mkdir()
        if kind == "shard-link-out":
            (model / "b.safetensors").rename(elsewhere / "b.safetensors")
            (model / "b.safetensors").symlink_to(elsewhere / "b.safetensors")
        if kind == "index-link-out":
            index.rename(elsewhere / "index.json")
            index.symlink_to(elsewhere / "index.json")
        if kind == "shard-hardlink-force":
            (d / "out" / "o").mkdir()
            os.link(model / "a.safetensors", d / "out" / "o" / "a.safetensors")
            return ["quantize", str(model), "-o", str(d / "out" / "o"), "--force"]
        return ["quantize", str(model), "-o", str(d / "out" / "o")]

    return setup


def _index(doc: object, *, shard_bytes: bytes | None = None) -> Setup:
    def setup(d: Path) -> list[str]:
        model = d / "model"
        model.mkdir()
        save_file({"w": torch.randn(4, 4)}, model / "a.safetensors")
        if shard_bytes is not None:
            (model / "a.safetensors").write_bytes(shard_bytes)
        text = doc if isinstance(doc, str) else json.dumps(doc)
        (model / "model.safetensors.index.json").write_text(text)
        return ["quantize", str(model), "-o", str(d / "out" / "q")]

    return setup


def _nan(value: float) -> dict[str, torch.Tensor]:
    w = torch.randn(4, 4)
    w[2, 3] = value
    return {"w": w}


OK_WEIGHT = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}

CASES: list[Case] = [
    # --- safetensors container -------------------------------------------------------------
    Case("S01-empty-file", _file(b""), "shorter than the 8-byte header"),
    Case("S01-one-byte", _file(b"\x01"), "shorter than the 8-byte header"),
    Case("S01-seven-bytes", _file(b"\x01" * 7), "shorter than the 8-byte header"),
    Case("S02-length-past-end", _st(b"{}", length=1000), "runs past the end"),
    Case("S03-length-2^64-1", _file(b"\xff" * 8 + b"{}"), "exceeds the 100000000-byte limit"),
    Case("S03-length-100MB+1", _st(b"{}", length=100_000_001), "exceeds the 100000000-byte limit"),
    Case("S04-zero-length", _st(b""), "not valid JSON"),
    Case("S04-empty-object-trailing", _st(b"{}", b"xx"), "2 trailing bytes"),
    Case("S05-not-utf8", _st(b"\xff\xfe{}"), "not UTF-8"),
    Case("S06-truncated-json", _st(b'{"w": {"dtype": "F32"'), "not valid JSON"),
    Case("S06-trailing-garbage", _st(b"{} garbage"), "not valid JSON"),
    Case("S06-nul-padding", _st(b"{}\x00\x00\x00\x00\x00\x00"), "not valid JSON"),
    Case("S07-array", _st([1, 2, 3]), "not a JSON object"),
    Case("S07-number", _st(b"42"), "not a JSON object"),
    Case("S07-entry-string", _st({"w": "F32"}), "entry is not an object"),
    Case("S07-entry-list", _st({"w": [1, 2]}), "entry is not an object"),
    Case("S08-duplicate-key", _st(b'{"w": {}, "w": {}}'), "duplicate key 'w'"),
    Case("S09-metadata-int", _st({"__metadata__": {"k": 1}}), "__metadata__ must map"),
    Case("S09-metadata-nested", _st({"__metadata__": {"k": {"a": "b"}}}), "__metadata__ must map"),
    Case("S09-metadata-list", _st({"__metadata__": ["a"]}), "__metadata__ must map"),
    Case("S10-dtype-F128", _st({"w": {**OK_WEIGHT, "dtype": "F128"}}, b"\0" * 8), "unknown dtype"),
    Case("S10-dtype-Q4_0", _st({"w": {**OK_WEIGHT, "dtype": "Q4_0"}}, b"\0" * 8), "unknown dtype"),
    Case("S10-dtype-number", _st({"w": {**OK_WEIGHT, "dtype": 7}}, b"\0" * 8), "unknown dtype"),
    Case("S11-shape-negative", _st(_f32(shape=[-2, 2], offsets=[0, 16]), b"\0" * 16), "shape"),
    Case("S11-shape-float", _st(_f32(shape=[2.0, 2], offsets=[0, 16]), b"\0" * 16), "shape"),
    Case("S11-shape-null", _st(_f32(shape=[None], offsets=[0, 4]), b"\0" * 4), "shape"),
    Case("S11-shape-not-list", _st({"w": {**OK_WEIGHT, "shape": 2}}, b"\0" * 8), "shape"),
    Case(
        "S11-shape-huge-int",
        _st(b'{"w": {"dtype": "F32", "shape": [' + b"9" * 5000 + b"]}}"),
        "not valid JSON",
    ),  # fmt: skip
    Case("S12-shape-overflow", _st(_f32(shape=[2, 2**63 - 1], offsets=[0, 0])), "overflows"),
    Case("S12-shape-wraps-to-zero", _st(_f32(shape=[2**32, 2**32], offsets=[0, 0])), "overflows"),
    Case("S13-offsets-one", _st({"w": {**OK_WEIGHT, "data_offsets": [0]}}, b"\0" * 8), "offsets"),
    Case(
        "S13-offsets-three",
        _st({"w": {**OK_WEIGHT, "data_offsets": [0, 4, 8]}}, b"\0" * 8),
        "offsets",
    ),  # fmt: skip
    Case("S13-offsets-negative", _st({"w": {**OK_WEIGHT, "data_offsets": [-8, 0]}}), "offsets"),
    Case("S13-offsets-reversed", _st({"w": {**OK_WEIGHT, "data_offsets": [8, 0]}}), "before begin"),
    Case(
        "S13-offsets-strings",
        _st({"w": {**OK_WEIGHT, "data_offsets": ["0", "8"]}}, b"\0" * 8),
        "offsets",
    ),  # fmt: skip
    Case("S14-size-mismatch", _st(_f32(shape=[1000, 1000], offsets=[0, 4]), b"\0" * 4), "needs"),
    Case(
        "S15-aliased-tensors",
        _st({**_f32("a", [2], [0, 8]), **_f32("b", [2], [0, 8])}, b"\0" * 8),
        "overlaps",
    ),  # fmt: skip
    Case(
        "S16-gap-between",
        _st({**_f32("a", [1], [0, 4]), **_f32("b", [1], [8, 12])}, b"\0" * 12),
        "gap",
    ),  # fmt: skip
    Case("S16-first-offset-not-zero", _st(_f32("a", [1], [4, 8]), b"\0" * 8), "gap"),
    Case("S17-trailing-bytes", _st(_f32("a", [1], [0, 4]), b"\0" * 9), "5 trailing bytes"),
    Case("S18-truncated-data", _st(_f32("a", [4], [0, 16]), b"\0" * 10), "truncated"),
    Case("S22-lone-surrogate-name", _st(b'{"\\ud800": {}}'), "lone surrogate"),
    Case("S24-fifo", _fifo, "not a regular file"),
    Case("S24-missing", lambda d: ["quantize", str(d / "none.safetensors")], "no such file"),
    Case(
        "S26-pickle-named-safetensors",
        _pickle(lambda d: {"w": torch.ones(2)}, "m.safetensors"),
        "pickles are only read from .pt/.pth/.bin",
    ),  # fmt: skip
    Case(
        "S26-text-named-pt",
        _file(b"hello, world, this is text", "m.pt"),
        "not a checkpoint: plain text",
    ),
    # --- torch pickles -------------------------------------------------------------------
    Case(
        "P01-os-system",
        _pickle(lambda d: {"x": _Exploit(os.system, f"touch {d}/pwned")}),
        "refused",
    ),  # fmt: skip
    Case("P01-eval", _pickle(lambda d: {"x": _Exploit(eval, "1+1")}), "refused"),
    Case("P01-exec", _pickle(lambda d: {"x": _Exploit(exec, "import os")}), "refused"),
    Case("P01-legacy-pickle", _legacy_pickle_exploit, "m.bin"),
    Case("P04-zip-bomb", _zip_bomb, "compressed"),
    Case("P10-truncated-zip", _truncated_zip, "corrupt"),
    Case("P11-list", _pickle(lambda d: [torch.ones(2)]), "expected a state dict"),
    Case("P11-no-tensors", _pickle(lambda d: {"epoch": 3, "lr": 0.1}), "no tensors"),
    Case("P11-int-keys", _pickle(lambda d: {1: torch.ones(2)}), "not a string"),
    Case("P07-sparse", _pickle(lambda d: {"w": torch.eye(3).to_sparse()}), "layout"),
    Case("P12-expanded-view-bomb", _expanded_bomb, "claim 10,000,000,000 bytes"),
    Case("P12-repeated-storage", _repeated_storage, "expanded (stride-0) or repeated views"),
    Case("P13-torchscript", _torchscript, "TorchScript archive"),
    Case("P14-metadata-key", _pickle(lambda d: {"__metadata__": torch.ones(2, 2)}), "reserves"),
    Case(
        "P14-lone-surrogate-key",
        _pickle(lambda d: {"\ud800": torch.ones(2, 2)}),
        "lone surrogate",
    ),  # fmt: skip
    # --- numerics --------------------------------------------------------------------------
    Case("T01-nan", _tensors(_nan(float("nan"))), "1 NaN/Inf values"),
    Case("T02-inf", _tensors(_nan(float("inf"))), "1 NaN/Inf values"),
    Case("T02-minus-inf", _tensors(_nan(float("-inf"))), "1 NaN/Inf values"),
    Case(
        "T08-affine-overflow",
        _tensors({"w": torch.tensor([[-3e38, 3e38]])}, "--scheme", "asym"),
        "overflows float32",
    ),  # fmt: skip
    Case(
        "T15-float64-beyond-float32",
        _tensors({"w": torch.tensor([[1e300, 2.0], [3.0, 4.0]], dtype=torch.float64)}),
        "beyond float32's range",
    ),  # fmt: skip
    Case("T14-axis-out-of-range", _tensors({"w": torch.ones(2, 2)}, "--axis", "3"), "out of range"),
    # --- dequantize ---------------------------------------------------------------------------
    Case(
        "D01-missing-sidecar",
        _dequantize_setup(lambda d: (d / "q.qparams.safetensors").unlink()),
        "no qparams sidecar",
    ),
    Case("D01-other-run", _sidecar_edit(lambda t, m: t["w.scale"].mul_(2)), "does not belong"),
    Case(
        "D01-truncated-sidecar",
        _dequantize_setup(
            lambda d: (d / "q.qparams.safetensors").write_bytes(
                (d / "q.qparams.safetensors").read_bytes()[:-4]
            )
        ),
        "truncated",
    ),  # fmt: skip
    Case(
        "D01-no-digest",
        _dequantize_setup(
            lambda d: save_file({"w": torch.ones(8, 4, dtype=torch.int8)}, d / "q.safetensors")
        ),
        "not a quantized file",
    ),  # fmt: skip
    Case("D02-zero-scale", _bound_edit(lambda t, m: t["w.scale"].zero_()), "scale holds zero"),
    Case(
        "D02-nan-scale", _bound_edit(lambda t, m: t["w.scale"].fill_(float("nan"))), "scale holds"
    ),  # fmt: skip
    Case("D02-negative-scale", _bound_edit(lambda t, m: t["w.scale"].neg_()), "scale holds"),
    Case("D03-zero-point-range", _bound_edit(lambda t, m: _set(m, "qmin", -100)), "does not match"),
    Case(
        "D04-wrong-scale-count",
        _bound_edit(lambda t, m: t.update({"w.scale": torch.ones(3)})),
        "shapes",
    ),  # fmt: skip
    Case("D04-axis-out-of-range", _bound_edit(lambda t, m: _set(m, "axis", 5)), "axis 5"),
    Case("D05-shape-mismatch", _bound_edit(lambda t, m: _set(m, "shape", [4, 8])), "holds"),
    Case(
        "D05-dtype-mismatch", _bound_edit(lambda t, m: _set(m, "dtype", "uint8")), "does not match"
    ),  # fmt: skip
    Case(
        "D06-manifest-nan",
        _bound_edit(lambda t, m: _set(m, "qmin", float("nan"))),
        "damaged manifest",
    ),  # fmt: skip
    Case(
        "D07-unknown-version",
        _bound_edit(lambda t, m: m.update({"format_version": 99})),
        "version 99 is not supported",
    ),  # fmt: skip
    Case(
        "D07-unknown-semantics",
        _bound_edit(lambda t, m: m.update({"semantics": "onnx"})),
        "unknown semantics",
    ),  # fmt: skip
    # An edit of the sidecar (manifest, names, data) or of the quantized file's tensor table
    # that leaves the pair self-consistent still breaks the binding digest (issue 9.5).
    Case("D08-edited-axis-square", _sidecar_edit(lambda t, m: _set(m, "axis", 1, "s")), "belong"),
    Case(
        "D08-edited-orig-dtype", _sidecar_edit(lambda t, m: _set(m, "orig_dtype", "BF16")), "belong"
    ),
    Case(
        "D08-edited-version", _sidecar_edit(lambda t, m: m.update({"qtool_version": "9"})), "belong"
    ),
    Case(
        "D08-swapped-scales", _sidecar_edit(lambda t, m: _swap(t, "s.scale", "t.scale")), "belong"
    ),
    Case(
        "D08-quantized-header-swap",
        _dequantize_setup(lambda d: _edit_header(d / "q.safetensors", _swap_offsets("s", "t"))),
        "belong",
    ),  # fmt: skip
    Case(
        "D08-sidecar-header-swap",
        _dequantize_setup(
            lambda d: _edit_header(d / "q.qparams.safetensors", _swap_offsets("s.scale", "t.scale"))
        ),
        "belong",
    ),  # fmt: skip
    Case(
        "D08-compare-edited-axis",
        _compare_setup(lambda t, m: _set(m, "axis", 1, "s")),
        "belong",
    ),  # fmt: skip
    # --- outputs -----------------------------------------------------------------------------
    Case("O01-output-is-input", _output_setup("same"), "would overwrite the input"),
    Case("O01-output-symlink-to-input", _output_setup("symlink"), "would overwrite the input"),
    Case("O02-output-exists", _output_setup("exists"), "pass --force"),
    Case("O03-output-dir-missing", _output_setup("missing-dir"), "does not exist"),
    Case("O03-output-is-directory", _output_setup("is-dir"), "is a directory"),
    Case("O04-output-fifo-force", _output_setup("fifo"), "is a FIFO, not a regular file"),
    Case("O04-output-socket-force", _output_setup("socket"), "is a socket, not a regular file"),
    Case("O04-output-link-to-fifo-force", _output_setup("link-to-fifo"), "is a FIFO"),
    *[
        # A plot path that is not a .png is a usage error before anything is read; a .png that
        # is (a link to) an input, a sidecar or another output of the run meets the preflight.
        Case(f"O05-{kind}", _plot_setup(kind), expect, code)
        for kind, expect, code in [
            ("quantize-plot-is-input", "--plot writes .png files", 2),
            ("quantize-plot-links-to-input", "would overwrite the input", 1),
            ("quantize-plot-is-output", "--plot writes .png files", 2),
            ("quantize-plot-is-sidecar", "--plot writes .png files", 2),
            ("quantize-plot-exists", "pass --force", 1),
            ("quantize-plot-dir-missing", "does not exist", 1),
            ("compare-plot-is-sidecar", "--plot writes .png files", 2),
            ("compare-plot-links-to-sidecar", "would overwrite the input", 1),
            ("compare-plot-exists", "pass --force", 1),
            ("plot-is-input", "plot writes .png files", 2),
            ("plot-links-to-sidecar", "would overwrite the input", 1),
            ("plot-is-sidecar", "plot writes .png files", 2),
            ("plot-exists", "pass --force", 1),
            ("plot-fifo", "is a FIFO", 1),
        ]
    ],
    Case("O06-sharded-names-collide", _sharded_setup("collide"), "two outputs of this run"),
    Case(
        "O07-sharded-output-hardlinks-input",
        _sharded_setup("shard-hardlink-force"),
        "is not a qtool export",
    ),  # fmt: skip
    Case("I08-shard-symlink-out", _sharded_setup("shard-link-out"), "outside the checkpoint"),
    Case("I08-index-symlink-out", _sharded_setup("index-link-out"), "outside the checkpoint"),
    Case("O05-output-name-not-utf8", _non_utf8_output, "not valid UTF-8"),
    # --- sharded indexes ---------------------------------------------------------------------
    Case("I01-index-not-json", _index("{nope"), "not a valid index"),
    Case("I01-index-nan", _index('{"weight_map": {"w": NaN}}'), "not a valid index"),
    Case("I01-index-no-weight-map", _index({"metadata": {}}), "weight_map"),
    Case("I02-index-traversal", _index({"weight_map": {"w": "../a.safetensors"}}), "escapes"),
    Case("I03-index-names-pickle", _index({"weight_map": {"w": "a.bin"}}), "never names pickles"),
    Case("I04-index-missing-shard", _index({"weight_map": {"w": "b.safetensors"}}), "missing"),
    Case(
        "I05-index-extra-tensor",
        _index({"weight_map": {"w": "a.safetensors", "v": "a.safetensors"}}),
        "missing from the shard",
    ),  # fmt: skip
    Case(
        "I07-index-corrupt-shard",
        _index({"weight_map": {"w": "a.safetensors"}}, shard_bytes=b"\x05" + b"\0" * 7 + b"{}"),
        "runs past the end",
    ),  # fmt: skip
    Case("I08-index-is-fifo", _special_index("fifo-index"), "not a regular file (a FIFO)"),
    Case("I08-index-is-dev-zero", _special_index("zero-index"), "a symlink to /dev/zero"),
    Case("I08-shard-is-fifo", _special_index("fifo-shard"), "not a regular file (a FIFO)"),
    Case("I08-shard-is-dev-zero", _special_index("zero-shard"), "a symlink to /dev/zero"),
    # --- usage -------------------------------------------------------------------------------
    Case("C01-bad-scheme", lambda d: ["quantize", "x.safetensors", "--scheme", "fp4"], "", 2),
    Case("C01-unknown-option", lambda d: ["quantize", "x.safetensors", "--frobnicate"], "", 2),
    Case("C01-missing-argument", lambda d: ["quantize"], "", 2),
    Case(
        "C02-threads-too-many",
        lambda d: ["quantize", "x.safetensors", "--threads", "100000"],
        "",
        2,
    ),  # fmt: skip
]
