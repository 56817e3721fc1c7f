"""What a user probably meant: an unknown option spelled as another tool spells it (`--bits 4`:
`--dtype int4`), or a near miss of a real one (`--shceme`: `--scheme`).

Click's own suggestion compares spellings only (difflib), so `--bits` got `--axis`. ALIASES
come first; a near miss after them; only options the command has are ever suggested.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence

# Spellings from other quantization tools and habits -> qtool's option (with a value, where the
# spelling implies one). Keys are long options as typed.
ALIASES: dict[str, str] = {
    **dict.fromkeys(
        ("--bits", "--nbits", "--n-bits", "--wbits", "--w-bits", "--weight-bits", "--bit"),
        "--dtype",
    ),
    **dict.fromkeys(("--precision", "--qtype", "--quant-type", "--type"), "--dtype"),
    **dict.fromkeys(
        ("--output", "--outfile", "--out-file", "--output-file", "--outdir", "--out-dir"),
        "--out",
    ),
    **dict.fromkeys(("--output-dir", "--save", "--save-path", "--dest"), "--out"),
    **dict.fromkeys(("--sym", "--symmetric"), "--scheme sym"),
    **dict.fromkeys(("--asym", "--asymmetric", "--affine"), "--scheme asym"),
    **dict.fromkeys(
        ("--group", "--groupsize", "--gs", "--block-size", "--blocksize"), "--group-size"
    ),
    **dict.fromkeys(("--per-group", "--group-wise", "--groupwise"), "--group-size"),
    **dict.fromkeys(("--channel-axis", "--ch-axis", "--dim"), "--axis"),
    **dict.fromkeys(("--channelwise", "--channel-wise", "--per-axis"), "--per-channel"),
    **dict.fromkeys(("--tensorwise", "--tensor-wise"), "--per-tensor"),
    **dict.fromkeys(("--method", "--observer", "--calibration"), "--range"),
    **dict.fromkeys(("--clip", "--clipping", "--search"), "--range mse"),
    **dict.fromkeys(("--skip", "--ignore"), "--exclude"),
    **dict.fromkeys(("--only", "--select", "--filter"), "--include"),
    **dict.fromkeys(("--fmt", "--output-format", "--export"), "--format"),
    **dict.fromkeys(("--sidecar", "--scales"), "--qparams"),
    **dict.fromkeys(("--torch-dtype", "--out-dtype", "--output-dtype"), "--to"),
    **dict.fromkeys(("--name", "--layer", "--param"), "--tensor"),
    **dict.fromkeys(("--snr", "--min-snr"), "--min-sqnr"),
    **dict.fromkeys(("--mse", "--max-error", "--max-err"), "--max-mse"),
    **dict.fromkeys(("--target-snr", "--budget"), "--target-sqnr"),
    **dict.fromkeys(("--overwrite", "--yes", "--replace"), "--force"),
    **dict.fromkeys(("--cpu",), "--device cpu"),
    **dict.fromkeys(("--gpu", "--cuda"), "--device cuda"),
    **dict.fromkeys(("--jobs", "--num-threads", "--nthreads", "--workers"), "--threads"),
    **dict.fromkeys(("--dryrun", "--plan", "--what-if"), "--dry-run"),
    **dict.fromkeys(("--limit", "--head", "--first"), "--top"),
    **dict.fromkeys(("--order", "--sort-by", "--order-by"), "--sort"),
    **dict.fromkeys(("--every", "--full", "--no-limit"), "--all"),
}

# The code type a value given to a bit-width alias stands for (`--bits 4`: int4).
_BITS = {"4": "int4", "8": "int8", **{d: d for d in ("int4", "int8", "uint4", "uint8")}}


def suggestion(option: str, value: str | None, offered: Sequence[str]) -> str | None:
    """What to type instead of the unknown `option` (given `value`, the word after it, if any),
    among the options the command `offered`; None when nothing fits."""
    name, _, inline = option.partition("=")
    value = inline or value
    meant = ALIASES.get(name.lower().replace("_", "-"))
    if meant is not None and meant.split()[0] in offered:
        return _with_value(meant, value)
    close = difflib.get_close_matches(name, [o for o in offered if o.startswith("--")], n=1)
    return close[0] if close else None


def _with_value(meant: str, value: str | None) -> str:
    if meant == "--dtype" and value is not None and value.lower() in _BITS:
        return f"--dtype {_BITS[value.lower()]}"
    return meant


def value_after(args: Sequence[str], option: str) -> str | None:
    """The value given to `option` in `args` (`--bits 4` or `--bits=4`), unless the word after
    it is another option."""
    for i, arg in enumerate(args):
        if arg.startswith(option + "="):
            return arg.partition("=")[2]
        if arg == option and i + 1 < len(args) and not args[i + 1].startswith("-"):
            return args[i + 1]
    return None
