"""An output name qtool cannot write is refused before torch is imported (issue 33 polish: the
`-o mlp.pt` usage error took 4 s where the others take 0.5 s, because quantize set torch's
thread count, importing torch, before the run checked its output). Not timed: what a fresh
process imported before the error is counted (tests/cli/test_startup.py's probe)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.cli.test_startup import checkpoint, loaded_by  # noqa: F401  (a fixture)

pytestmark = pytest.mark.slow  # every test starts a fresh interpreter


@pytest.mark.parametrize("name", ["mlp.pt", "mlp", "mlp.gguf"])
@pytest.mark.parametrize("threads", [[], ["--threads", "1"]], ids=["default", "threads"])
def test_an_output_name_quantize_cannot_write_loads_no_torch(
    checkpoint: Path,  # noqa: F811
    tmp_path: Path,
    name: str,
    threads: list[str],
) -> None:
    code, loaded = loaded_by("quantize", str(checkpoint), "-o", str(tmp_path / name), *threads)
    assert code == 2 and "torch" not in loaded, loaded
    assert not list(tmp_path.iterdir())


def test_threads_still_reach_torch_once_the_checks_passed(
    checkpoint: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    from qtool.engine import loop
    from tests.conftest import run_qtool

    seen: list[int] = []
    real = loop.write_shard

    def spy(*args: Any) -> Any:
        seen.append(torch.get_num_threads())
        return real(*args)

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.setattr(loop, "write_shard", spy)
        code, _, err = run_qtool("quantize", str(checkpoint), "-o", str(tmp_path / "q.safetensors"),
                                 "--threads", "1")  # fmt: skip
        assert code == 0, err
        assert seen == [1]  # in the run; the caller's count comes back after it
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
