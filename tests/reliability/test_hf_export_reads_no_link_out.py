"""quantize HF_DIR --format gguf reads every file of the model directory it takes (config.json,
the weights, tokenizer.json, tokenizer_config.json, tokenizer.model, added_tokens.json, the
chat templates, additional_chat_templates/, and README.md and generation_config.json, which
gguf-py's Metadata reads) once, through the directory's descriptor, as every
other model directory is read (docs/reliability.md, "Reading a model directory"): a symlink
leading out of the directory is refused in one line naming it, and the conversion (gguf-py's
SpecialVocab among it, which opens files by path) reads a private copy, so a file swapped
after qtool's check is never what it reads. Before, `chat_template.jinja -> /proc/self/environ`
put the environment into the GGUF's tokenizer.chat_template, links to elsewhere were followed
for every file, and a template swapped for a FIFO after the check was silently left out."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.conftest import Invoke
from tests.formats.gguf.sp_models import build

pytest.importorskip("sentencepiece")
gguf = pytest.importorskip("gguf")

TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
READ = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
        "tokenizer.model", "added_tokens.json", "chat_template.jinja",
        "additional_chat_templates", "README.md", "generation_config.json")  # fmt: skip


def _model(root: Path) -> Path:
    """A Llama 2 directory (tokenizer.model and tokenizer.json) with each file READ names: the
    chat template in chat_template.jinja (and a named one), not in tokenizer_config.json."""
    src = build(root, "llama2")
    config = json.loads((src / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (src / "tokenizer_config.json").write_text(json.dumps(config))
    (src / "chat_template.jinja").write_text(TEMPLATE)
    (src / "added_tokens.json").write_text("{}")
    (src / "README.md").write_text("---\nlicense: mit\n---\n# A model\n")
    (src / "generation_config.json").write_text('{"bos_token_id": 1}')
    (src / "additional_chat_templates").mkdir()
    (src / "additional_chat_templates" / "tool.jinja").write_text(TEMPLATE)
    return src


@pytest.mark.parametrize("name", READ)
def test_a_link_out_of_the_directory_is_refused(tmp_path: Path, invoke: Invoke, name: str) -> None:
    src = _model(tmp_path / "m")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.move(src / name, elsewhere / name)
    (src / name).symlink_to(elsewhere / name)
    out = tmp_path / "o.gguf"
    code, stdout, err = invoke("quantize", str(src), "--format", "gguf", "--dtype", "F16",
                               "-o", str(out))  # fmt: skip
    assert code == 1, err
    assert stdout == "" and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert f"{src / name}:" in err and "symlink" in err, err
    assert not out.exists()


def test_a_link_to_proc_never_reaches_the_gguf(tmp_path: Path, invoke: Invoke) -> None:
    src = _model(tmp_path / "m")
    (src / "chat_template.jinja").unlink()
    (src / "chat_template.jinja").symlink_to("/proc/self/environ")  # st_size 0: no size check
    out = tmp_path / "o.gguf"
    code, _, err = invoke("quantize", str(src), "--format", "gguf", "--dtype", "F16",
                          "-o", str(out))  # fmt: skip
    assert code == 1 and "chat_template.jinja" in err, err
    assert not out.exists()


def test_a_file_swapped_after_the_check_is_never_read(
    tmp_path: Path, invoke: Invoke, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The template is swapped for a FIFO (and config.json for a link out) right after qtool's
    checks of the tokenizer files ran: the GGUF holds what was checked."""
    from qtool.formats.gguf import hf_vocab

    src = _model(tmp_path / "m")
    checked = hf_vocab.check_files

    def check_then_swap(directory: Path) -> None:
        checked(directory)
        for name in ("chat_template.jinja", "config.json"):
            (src / name).rename(tmp_path / name)
        os.mkfifo(src / "chat_template.jinja")
        (src / "config.json").symlink_to(tmp_path / "config.json")

    monkeypatch.setattr(hf_vocab, "check_files", check_then_swap)
    out = tmp_path / "o.gguf"
    code, _, err = invoke("quantize", str(src), "--format", "gguf", "--dtype", "F16",
                          "-o", str(out))  # fmt: skip
    assert code == 0, err
    field = gguf.GGUFReader(out).fields["tokenizer.chat_template"]
    assert bytes(field.parts[field.data[0]]).decode() == TEMPLATE


def test_the_private_copy_changes_no_byte(tmp_path: Path, invoke: Invoke) -> None:
    """The GGUF written from the copy is the one the directory itself gives (general.name is
    the directory's name, the model card's license, every template) byte for byte."""
    from qtool.formats.gguf.hf_export import export_float
    from qtool.io.atomic import OutputSet

    src = _model(tmp_path / "m")
    direct = tmp_path / "direct.gguf"
    with OutputSet() as outputs:
        export_float(src, direct, outputs, "F16")
        outputs.commit()
    out = tmp_path / "o.gguf"
    code, _, err = invoke("quantize", str(src), "--format", "gguf", "--dtype", "F16",
                          "-o", str(out))  # fmt: skip
    assert code == 0, err
    assert out.read_bytes() == direct.read_bytes()


# An extra weights file that is a link qtool does not follow: what the one line says of it.
LINKS = {
    "out": ("{huge}", "a symlink to"),  # a 1 TiB sparse file: its size was the free space asked
    "dangling": ("/nonexistent", "a symlink to"),
    "loop": ("extra.safetensors", "a chain of more than"),
    "missing beside": ("other.safetensors", "no such file"),
}


@pytest.mark.parametrize("dtype", ["F16", "Q8_0"])
@pytest.mark.parametrize("kind", LINKS)
def test_a_weights_link_is_refused_before_anything_follows_it(
    tmp_path: Path, invoke: Invoke, kind: str, dtype: str
) -> None:
    """A quantized type sized the weights for its free-space check with a stat through each
    path, before the private copy's checks: a dangling or looping link was an internal error,
    a link out a claim of the target's size in free space. Every type refuses the link first."""
    src = _model(tmp_path / "m")
    huge = tmp_path / "huge.safetensors"
    with open(huge, "wb") as f:
        f.truncate(1 << 40)
    target, said = LINKS[kind]
    (src / "extra.safetensors").symlink_to(target.format(huge=huge))
    out = tmp_path / "o.gguf"
    code, stdout, err = invoke("quantize", str(src), "--format", "gguf", "--dtype", dtype,
                               "-o", str(out))  # fmt: skip
    assert code == 1, err
    assert stdout == "" and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert f"{src / 'extra.safetensors'}:" in err and said in err, err
    assert "internal error" not in err and "free" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["huge.safetensors", "m"]
