"""The token windows a `qtool quantize --method` run calibrates on, written as JSON, so that a
peer (llm-compressor's GPTQ or AWQ) can be calibrated on exactly the same tokens.

Usage: python scripts/method_windows.py MODEL_DIR OUT.json [--text FILE]... [--tokens N]
                                        [--ctx N] [--check-text FILE]...
The options are `quantize --method`'s, with its defaults; the windows come from the function
the run itself calls (engine/methods/run.py _streams), so they are the run's, token for token.
OUT.json: {"fit": [[ids...], ...], "held": [...], "check": [...], "ctx": N}. qtool fits on
`fit` and judges on `held` and `check`; give a peer `fit` + `held` (every calibration window),
or `fit` alone to match what qtool's solve saw. By hand only (needs transformers' tokenizer).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from qtool.calibration import DEFAULT_TOKENS, Calibration
from qtool.engine.calibrate.run import MODEL
from qtool.engine.methods import run
from qtool.engine.model.config import float_source
from qtool.engine.model.models import float_parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--text", type=Path, action="append", default=[])
    parser.add_argument("--tokens", type=int, default=DEFAULT_TOKENS)
    parser.add_argument("--ctx", type=int, default=None)
    parser.add_argument("--check-text", type=Path, action="append", default=[])
    args = parser.parse_args()
    calibration = Calibration(
        texts=tuple(args.text), tokens=args.tokens, ctx=args.ctx, check_texts=tuple(args.check_text)
    )
    found, config = float_source(args.model, MODEL)
    _, hf_config, tokenizer = float_parts(found, config, args.model, MODEL)
    found_streams: Any = run._streams(
        calibration, tokenizer, hf_config, args.model, torch.device("cpu")
    )
    streams: dict[str, list[list[int]]] = (
        found_streams[0] if isinstance(found_streams, tuple) else found_streams
    )  # (streams, the texts' records) where the run records its texts
    ctx = len(streams["fit"][0])
    args.out.write_text(json.dumps({**streams, "ctx": ctx}))
    sizes = ", ".join(f"{len(ws)} {name}" for name, ws in streams.items())
    print(f"{args.out}: windows of {ctx} tokens: {sizes}")


if __name__ == "__main__":
    main()
