from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import settings
from typer.testing import CliRunner

from qtool.cli import app

SAMPLES = Path(__file__).parent.parent / "sample_weights"

settings.register_profile("ci", max_examples=200, deadline=None)
settings.register_profile("exhaustive", max_examples=5000, deadline=None)
settings.load_profile("exhaustive" if os.environ.get("QTOOL_EXHAUSTIVE") == "1" else "ci")

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


SLOW_DIRECTORIES = ("interop",)
"""Every test below these loads real consumers (transformers, compressed-tensors, gguf-py)."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if set(SLOW_DIRECTORIES) & set(item.path.relative_to(Path(__file__).parent).parts):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def private_cache(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Path:
    """Each test starts with an empty user cache of its own (io/usercache.py): no test sees
    what another cached, and none writes to the home directory."""
    directory = tmp_path_factory.mktemp("cache")
    monkeypatch.setenv("QTOOL_CACHE_DIR", str(directory))
    return directory


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    """Every available device: CPU always, CUDA when there is one."""
    return str(request.param)


@pytest.fixture
def model(tmp_path: Path) -> Path:
    """A private copy of the tiny-llama sample model directory."""
    dest = tmp_path / "m"
    shutil.copytree(SAMPLES / "tiny-llama", dest)
    return dest


@pytest.fixture
def samples(tmp_path: Path) -> Path:
    """A private copy of sample_weights/, so tests can write beside the inputs."""
    dest = tmp_path / "samples"
    shutil.copytree(SAMPLES, dest)
    return dest


Invoke = Callable[..., tuple[int, str, str]]
"""invoke("quantize", SRC, "-o", OUT, env={...}) -> (exit code, stdout, stderr)."""


def run_qtool(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """`qtool ARGS` run in-process through Typer's CliRunner (stdout and stderr apart);
    `env`: environment variables for the run."""
    result = CliRunner().invoke(app, list(args), env=env)
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture
def invoke() -> Invoke:
    """run_qtool, for tests that take it as a fixture."""
    return run_qtool
