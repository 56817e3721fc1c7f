from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from qtool.engine.plan import QuantizeOptions, plan_tensors
from qtool.errors import InputError, QtoolError, RecipeError
from qtool.io.stformat import TensorEntry, read_header
from qtool.recipe.file import load_recipe, parse_recipe
from qtool.recipe.rules import (
    Keep,
    Recipe,
    Resolution,
    Rule,
    RuleKind,
    resolve,
    rules_from_cli,
    unmatched,
)
from qtool.spec import (
    PerChannel,
    PerGroup,
    PerTensor,
    QSpec,
    RangeMethod,
    Scheme,
    SpecPatch,
    StorageDtype,
    parse_spec_label,
    spec_label,
)

ROOT = Path(__file__).parents[2]
SAMPLES = ROOT / "sample_weights"
INT4_G32 = QSpec(Scheme.SYM, StorageDtype.INT4, PerGroup(32))


def entry(name: str, shape: tuple[int, ...] = (64, 256), dtype: str = "F32") -> TensorEntry:
    return TensorEntry(name, dtype, shape, 0, 0)


def recipe_rules(text: str) -> tuple[Rule, ...]:
    return parse_recipe(text, "r.toml").rules


def fails(text: str) -> str:
    with pytest.raises(RecipeError) as info:
        parse_recipe(text, "r.toml")
    return str(info.value)


# -- matching and order ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pattern", "name", "expected"),
    [
        ("layers.*", "layers.0.fc1.weight", True),  # * crosses dots
        ("*.fc?.weight", "layers.0.fc2.weight", True),
        ("*.fc[12].weight", "layers.0.fc3.weight", False),
        ("Layers.*", "layers.0.fc1.weight", False),  # case-sensitive on every platform
        ("fc1", "layers.0.fc1.weight", False),  # a glob names the whole name
        (r"re:layers\.\d+\.fc1\.weight", "layers.12.fc1.weight", True),
        (r"re:fc1", "layers.0.fc1.weight", False),  # fullmatch, not search
        (r"re:.*(q|k|v)_proj.*", "model.layers.0.self_attn.k_proj.weight", True),
        (r"re:.*(q|k|v)_proj.*", "model.layers.0.self_attn.o_proj.weight", False),
    ],
    ids=["glob-dots", "glob-?", "glob-class", "glob-case", "glob-whole", "re", "re-whole",
         "re-alt", "re-alt-miss"],
)  # fmt: skip
def test_rule_matching(pattern: str, name: str, expected: bool) -> None:
    assert Rule(1, pattern, Keep("x")).matches(name) is expected


def test_first_matching_rule_wins() -> None:
    rules = recipe_rules(
        '[[rule]]\nmatch = "*.fc1.*"\nkeep = "first"\n'
        '[[rule]]\nmatch = "layers.*"\ndtype = "int4"\ngroup_size = 32\n'
        '[[rule]]\nmatch = "*.weight"\nkeep = "third"\n'
    )
    fc1, fc2, head = (entry(n) for n in ("layers.0.fc1.weight", "layers.0.fc2.weight", "head.w"))
    assert resolve(rules, fc1, QSpec()) == Resolution(rules[0], Keep("first"), by_rule=True)
    assert resolve(rules, fc2, QSpec()).action == INT4_G32
    assert resolve(rules, fc2, QSpec()).rule == rules[1]
    assert resolve(rules, fc2, QSpec()).by_rule
    assert resolve(rules, head, QSpec()).rule is None  # no rule: the command-line spec
    assert resolve(rules, head, QSpec()).action == QSpec()
    assert not resolve(rules, head, QSpec()).by_rule


@pytest.mark.parametrize(
    ("keys", "expected"),
    [
        ('dtype = "int4"', QSpec(Scheme.ASYM, StorageDtype.INT4, PerChannel(1), RangeMethod.MSE)),
        ('scheme = "sym"', QSpec(Scheme.SYM, StorageDtype.UINT8, PerChannel(1), RangeMethod.MSE)),
        ('range = "minmax"', QSpec(Scheme.ASYM, StorageDtype.UINT8, PerChannel(1))),
        ("group_size = 64", QSpec(Scheme.ASYM, StorageDtype.UINT8, PerGroup(64), RangeMethod.MSE)),
        ('granularity = "channel"', QSpec(Scheme.ASYM, StorageDtype.UINT8, PerChannel(0),
                                          RangeMethod.MSE)),
        ("axis = -1", QSpec(Scheme.ASYM, StorageDtype.UINT8, PerChannel(1), RangeMethod.MSE)),
        ('granularity = "tensor"', QSpec(Scheme.ASYM, StorageDtype.UINT8, PerTensor(),
                                         RangeMethod.MSE)),
    ],
    ids=["dtype", "scheme", "range", "group", "channel-axis-0", "axis-normalised", "tensor"],
)  # fmt: skip
def test_partial_rule_takes_the_rest_from_the_command_line(keys: str, expected: QSpec) -> None:
    base = QSpec(Scheme.ASYM, StorageDtype.UINT8, PerChannel(1), RangeMethod.MSE)
    rules = recipe_rules(f'[[rule]]\nmatch = "*"\n{keys}\n')
    assert resolve(rules, entry("w", (64, 256)), base).action == expected


def test_cli_rules_order_exclude_recipe_include() -> None:
    recipe = recipe_rules('[[rule]]\nmatch = "layers.*"\ndtype = "int4"\ngroup_size = 32\n')
    rules = rules_from_cli(("layers.*", "head.*"), ("*.fc2.*",), recipe)
    assert [r.kind for r in rules] == [RuleKind.EXCLUDE, RuleKind.RECIPE, *[RuleKind.INCLUDE] * 2]
    fate = {n: resolve(rules, entry(n, s), QSpec()) for n, s in [
        ("layers.0.fc2.weight", (64, 256)), ("layers.0.fc1.weight", (64, 256)),
        ("head.weight", (10, 64)), ("head.bias", (10,)), ("embed.weight", (256, 64)),
        ("layers.0.fc1.bias", (128,))]}  # fmt: skip
    assert fate["layers.0.fc2.weight"].action == Keep("excluded by --exclude '*.fc2.*'")
    assert fate["layers.0.fc1.weight"].action == INT4_G32  # the recipe beats --include
    assert fate["head.weight"].action == QSpec()
    assert fate["head.bias"].action == QSpec(granularity=PerTensor())  # --include selects 1-D
    not_matched = Resolution(None, Keep("not matched by --include"), by_rule=True)
    assert fate["embed.weight"] == not_matched
    # a recipe rule does not quantize 1-D tensors: only --include does
    assert fate["layers.0.fc1.bias"].action == Keep("1-D (bias/norm)")
    assert fate["layers.0.fc1.bias"].rule == recipe[0]
    assert [fate[n].from_command_line for n in ("head.weight", "head.bias")] == [True, True]
    assert not fate["layers.0.fc1.weight"].from_command_line


@pytest.mark.parametrize(
    ("tensor", "reason"),
    [
        (entry("w.step", (), "I64"), "integer tensor"),
        (entry("w.mask", (4, 4), "BOOL"), "bool tensor"),
        (entry("w.fp8", (4, 4), "F8_E4M3"), "already low-precision (F8_E4M3)"),
        (entry("w.empty", (0, 4)), "empty tensor"),
        (entry("w.scalar", ()), "0-d scalar"),
        (entry("w.bias", (4,)), "1-D (bias/norm)"),
    ],
    ids=["int", "bool", "fp8", "empty", "0-d", "1-D"],
)
def test_recipe_spec_rule_keeps_what_cannot_be_quantized(tensor: TensorEntry, reason: str) -> None:
    rules = recipe_rules('[[rule]]\nmatch = "w.*"\ndtype = "int4"\n')
    assert resolve(rules, tensor, QSpec()).action == Keep(reason)


def test_group_longer_than_a_row_is_per_channel_with_a_note() -> None:
    rules = recipe_rules('[[rule]]\nmatch = "*"\ngroup_size = 128\n')
    res = resolve(rules, entry("w", (10, 64)), QSpec())
    assert res.action == QSpec(granularity=PerChannel(0))
    assert res.note == "group 128 >= row length 64: per channel"


def test_rule_axis_the_tensor_lacks_is_a_recipe_error_naming_rule_line_and_tensor() -> None:
    rules = recipe_rules('# axis 2\n\n[[rule]]\nmatch = "*"\naxis = 2\n')
    with pytest.raises(RecipeError) as info:
        resolve(rules, entry("fc.weight", (10, 64)), QSpec())
    assert str(info.value) == (
        "r.toml: tensor 'fc.weight': line 3: rule 1 '*': axis 2 is out of range for this 2-D "
        "tensor; choose an axis in [-2, 1]; narrow its match or change its axis"
    )
    assert info.value.usage and info.value.hints == ("recipe",)


def test_command_line_axis_error_is_the_planners() -> None:
    options = QuantizeOptions(QSpec(granularity=PerChannel(2)))
    e = entry("fc.weight", (10, 64))
    with pytest.raises(InputError) as planned:
        plan_tensors(Path("m.safetensors"), (e,), options)
    with pytest.raises(InputError) as resolved:
        resolve((), e, options.spec, checkpoint="m.safetensors")
    assert str(resolved.value) == str(planned.value)
    assert resolved.value.hints == planned.value.hints == ("axis", "exclude")
    assert not resolved.value.usage


# -- the same decisions as today's planner --------------------------------------------------

SAMPLE_HEADERS = sorted(SAMPLES.glob("**/*.safetensors"))
SELECTIONS = [
    ((), ()),
    (("layers.*", "head.*"), ("*.fc2.*",)),
    (("*.bias", "step", "position_ids"), ()),
    ((), ("embed.*", "*norm*")),
    (("*",), ("*.weight",)),
    (("conv*", "bn1.*", "nothing.*"), ("*.running_*",)),
]
BASE_SPECS = [
    QSpec(),
    QSpec(Scheme.ASYM, StorageDtype.UINT8, PerTensor()),
    QSpec(granularity=PerChannel(-1)),
    QSpec(granularity=PerChannel(3)),  # out of range for 2-D tensors: an error in both
    INT4_G32,
    QSpec(Scheme.SYM, StorageDtype.INT4, PerGroup(128), RangeMethod.MSE),
]


@pytest.mark.parametrize("base", BASE_SPECS, ids=spec_label)
@pytest.mark.parametrize("selection", SELECTIONS, ids=lambda s: repr(s).replace(" ", ""))
@pytest.mark.parametrize("path", SAMPLE_HEADERS, ids=lambda p: p.name)
def test_resolve_reproduces_the_planner(
    path: Path, selection: tuple[tuple[str, ...], tuple[str, ...]], base: QSpec
) -> None:
    include, exclude = selection
    rules = rules_from_cli(include, exclude)
    for e in read_header(path).tensors:
        options = QuantizeOptions(base, include, exclude)
        try:
            (plan,) = plan_tensors(path, (e,), options)
        except InputError as planned:
            with pytest.raises(InputError) as resolved:
                resolve(rules, e, base, checkpoint=path)
            assert str(resolved.value) == str(planned)
            continue
        res = resolve(rules, e, base, checkpoint=path)
        assert (res.spec, res.note) == (plan.spec, plan.decision.note), e.name
        if plan.spec is None:
            assert res.action == Keep(plan.decision.reason), e.name


# -- loading: errors name the file, the line and the key ------------------------------------

RULE = '[[rule]]\nmatch = "x.*"\n'
ERRORS = [
    # (id, text, expected message start)
    ("unknown-rule-key", RULE + 'dtyp = "int4"\n', "line 3: rule 1: key 'dtyp': unknown key"),
    ("unknown-top-key", '# recipe\nrules = []\n', "line 2: key 'rules': unknown key"),
    ("unknown-table", RULE + '[options]\nx = 1\n', "line 3: key 'options': unknown key"),
    ("rule-not-array", '[rule]\nmatch = "x"\n', "line 1: key 'rule': write each rule as"),
    ("rule-not-table", 'rule = ["x"]\n', "line 1: rule 1: must be a table"),
    ("bad-scheme", RULE + 'scheme = "symmetric"\n', "line 3: rule 1: key 'scheme': 'symmetric'"),
    ("bad-dtype", RULE + 'dtype = "int3"\n', "line 3: rule 1: key 'dtype': 'int3' is not one"),
    ("dtype-not-str", RULE + "dtype = 8\n", "line 3: rule 1: key 'dtype': 8 is not one of"),
    ("bad-range", RULE + 'range = "percentile"\n', "line 3: rule 1: key 'range':"),
    ("bad-granularity", RULE + 'granularity = "row"\n', "line 3: rule 1: key 'granularity':"),
    ("axis-not-int", RULE + 'axis = "0"\n', "line 3: rule 1: key 'axis': '0' is not an integer"),
    ("axis-bool", RULE + "axis = true\n", "line 3: rule 1: key 'axis': True is not an integer"),
    ("group-float", RULE + "group_size = 32.0\n", "line 3: rule 1: key 'group_size': 32.0 is"),
    ("group-1", RULE + "group_size = 1\n", "line 3: rule 1: key 'group_size': 1 is too small"),
    ("keep-and-spec", RULE + 'keep = "f"\n\nrange = "mse"\n',
     "line 5: rule 1: key 'range': a rule that keeps a tensor takes no spec keys"),
    ("keep-empty", RULE + 'keep = " "\n', "line 3: rule 1: key 'keep': must say why"),
    ("keep-bool", RULE + "keep = true\n", "line 3: rule 1: key 'keep': must say why"),
    ("group-and-tensor", RULE + 'granularity = "tensor"\ngroup_size = 32\n',
     "line 4: rule 1: key 'group_size': needs granularity = \"group\", not \"tensor\""),
    ("group-and-channel", RULE + 'group_size = 32\ngranularity = "channel"\n',
     "line 3: rule 1: key 'group_size': needs granularity = \"group\", not \"channel\""),
    ("group-and-axis", RULE + "group_size = 32\naxis = 1\n",
     "line 4: rule 1: key 'axis': groups run along the rows of axis 0"),
    ("axis-and-tensor", RULE + 'granularity = "tensor"\naxis = 0\n',
     "line 4: rule 1: key 'axis': has no meaning with granularity = \"tensor\""),
    ("group-without-size", RULE + 'granularity = "group"\n',
     "line 3: rule 1: key 'granularity': \"group\" needs group_size = N"),
    ("invalid-regex", '[[rule]]\nmatch = "re:(a|b"\nkeep = "f"\n',
     "line 2: rule 1: key 'match': invalid regular expression: missing ), unterminated"),
    ("empty-match", '[[rule]]\nmatch = ""\nkeep = "f"\n', "line 2: rule 1: key 'match': must be"),
    ("empty-regex", '[[rule]]\nmatch = "re:"\nkeep = "f"\n', "line 2: rule 1: key 'match': must"),
    ("match-not-str", '[[rule]]\nmatch = ["a"]\nkeep = "f"\n', "line 2: rule 1: key 'match':"),
    ("missing-match", '\n[[rule]]\nkeep = "f"\n', "line 2: rule 1: key 'match': missing"),
    ("no-action", RULE, "line 1: rule 1: a rule needs keep = \"reason\" or at least one of"),
    ("ladder-empty", "ladder = []\n", "line 1: key 'ladder': must be a non-empty list"),
    ("ladder-not-list", 'ladder = "int4"\n', "line 1: key 'ladder': must be a non-empty list"),
    ("ladder-bad-word", 'ladder = [\n  "int8",\n  "int4 g32 fast",\n]\n',
     "line 3: ladder entry 2: unknown word 'fast'"),
    ("ladder-no-dtype", 'ladder = ["g32 mse"]\n', "line 1: ladder entry 1: 'g32 mse' names no"),
    ("ladder-twice", 'ladder = ["int4 int8"]\n', "line 1: ladder entry 1: 'int4 int8' names the"),
    ("ladder-axis", 'ladder = ["int8 axis1"]\n', "line 1: ladder entry 1: ladder channels are"),
    ("ladder-axis-key", 'ladder = [\n {dtype = "int8", axis = 1},\n]\n',
     "line 2: ladder entry 1: key 'axis': unknown key"),
    ("ladder-keep", 'ladder = [{dtype = "int8", keep = "x"}]\n', "line 1: ladder entry 1: key"),
    ("ladder-bad-value", 'ladder = [\n"int8",\n{ dtype = "int2" }]\n',
     "line 3: ladder entry 2: key 'dtype': 'int2' is not one of"),
    ("ladder-not-table", "ladder = [8]\n", "line 1: ladder entry 1: must be a table"),
]  # fmt: skip


@pytest.mark.parametrize(("text", "message"), [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_recipe_errors_name_file_line_and_key(text: str, message: str) -> None:
    assert fails(text).startswith(f"r.toml: {message}")


def test_error_lines_survive_comments_strings_and_inline_tables() -> None:
    text = (
        "# [[rule]] in a comment\n"  # 1
        'ladder = [ "int8",  # dtype = "int3" in a comment\n'  # 2
        '  { dtype = "int4", group_size = 32 },\n'  # 3
        "]\n"  # 4
        "[[rule]] # first\n"  # 5
        "match = '''\n"  # 6: a multi-line literal string holding fake keys
        "[[rule]]\n"  # 7
        "dtype = 'x'\n"  # 8
        "x.*'''\n"  # 9
        'keep = "a # not a comment"\n'  # 10
        "[[rule]]\n"  # 11
        '"match" = "y.*"\n'  # 12: a quoted key
        '\tdtype = "int4"   \n'  # 13
        "\n"  # 14
        "group_size = 1 # too small\n"  # 15
    )
    assert fails(text) == "r.toml: line 15: rule 2: key 'group_size': 1 is too small; use 2 or more"
    inline = 'rule = [\n  {match = "a", keep = "x"},\n  {match = "b", dtype = "int9"},\n]\n'
    assert fails(inline).startswith("r.toml: line 3: rule 2: key 'dtype': 'int9' is not one of")
    crlf = '[[rule]]\r\nmatch = "a"\r\n\r\ngroup_size = 0\r\n'
    assert fails(crlf).startswith("r.toml: line 4: rule 1: key 'group_size': 0 is too small")


def test_toml_syntax_error_keeps_tomllibs_line_and_column() -> None:
    message = fails('[[rule]]\nmatch = "a"\ndtype = int4\n')
    assert message.startswith("r.toml: not valid TOML: Invalid value (at line 3, column 9)")


def test_load_recipe_errors_are_usage_errors(tmp_path: Path) -> None:
    missing = tmp_path / "none.toml"
    with pytest.raises(RecipeError, match="none.toml: cannot read the recipe"):
        load_recipe(missing)
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes(b'[[rule]]\nmatch = "caf\xe9"\nkeep = "x"\n')
    with pytest.raises(RecipeError, match="latin1.toml: the recipe is not UTF-8 text") as info:
        load_recipe(latin1)
    assert isinstance(info.value, QtoolError)
    assert info.value.usage is True and info.value.code == "recipe"
    assert info.value.hints == ("recipe",)
    assert QtoolError(None, "x").usage is False


def test_load_recipe_reads_rules_lines_and_ladder(tmp_path: Path) -> None:
    path = tmp_path / "r.toml"
    path.write_text(
        'ladder = ["int4 g128 mse", { dtype = "int8", granularity = "channel" }]\n\n'
        '[[rule]]\nmatch = "embed.*"\nkeep = "embeddings stay float"\n\n'
        "[[rule]]\nmatch = 're:.*\\.fc1\\.weight'\nscheme = \"asym\"\n"
    )
    recipe = load_recipe(path)
    assert recipe == Recipe(
        str(path),
        (
            Rule(1, "embed.*", Keep("embeddings stay float"), 3, RuleKind.RECIPE, str(path)),
            Rule(2, r"re:.*\.fc1\.weight", SpecPatch(Scheme.ASYM), 7, RuleKind.RECIPE, str(path)),
        ),
        (QSpec(Scheme.SYM, StorageDtype.INT4, PerGroup(128), RangeMethod.MSE), QSpec()),
    )
    assert parse_recipe("# nothing yet\n").rules == () and parse_recipe("").ladder is None


# -- unmatched rules and labels -------------------------------------------------------------


def test_unmatched_rules_are_the_ones_matching_no_name() -> None:
    rules = recipe_rules(
        '[[rule]]\nmatch = "embed.*"\nkeep = "f"\n'
        '[[rule]]\nmatch = "re:.*lm_head.*"\nkeep = "f"\n'
        '[[rule]]\nmatch = "*.fc?.weight"\ndtype = "int4"\n'
    )
    names = [e.name for e in read_header(SAMPLES / "mlp.safetensors").tensors]
    assert unmatched(rules, names) == [rules[1]]
    assert unmatched(rules, iter(names)) == [rules[1]]  # any iterable, read once
    assert rules[1].describe() == "rule 2 're:.*lm_head.*'"
    assert rules_from_cli((), ("a.*",))[0].describe() == "--exclude 'a.*'"


SPECS = [
    QSpec(s, d, g, r)
    for s, d, g, r in itertools.product(
        Scheme,
        StorageDtype,
        [PerTensor(), PerChannel(0), PerChannel(2), PerChannel(-1), PerGroup(2), PerGroup(128)],
        RangeMethod,
    )
]


@pytest.mark.parametrize("spec", SPECS, ids=spec_label)
def test_spec_labels_round_trip(spec: QSpec) -> None:
    assert parse_spec_label(spec_label(spec)) == spec


@given(st.permutations(["asym", "uint4", "g64", "mse"]))
def test_label_words_in_any_order(words: list[str]) -> None:
    expected = QSpec(Scheme.ASYM, StorageDtype.UINT4, PerGroup(64), RangeMethod.MSE)
    assert parse_spec_label(" ".join(words)) == expected


def test_labels_read_like_the_issue() -> None:
    labels = ["int4 g128 mse", "int8 channel", "asym uint8 tensor", "int8 axis1"]
    assert [spec_label(parse_spec_label(t)) for t in labels] == labels
    assert parse_spec_label("int8") == QSpec()


# -- the example recipes --------------------------------------------------------------------

LLAMA_NAMES = [
    "model.embed_tokens.weight",
    "model.norm.weight",
    "lm_head.weight",
    *(
        f"model.layers.{i}.{part}"
        for i in range(2)
        for part in (
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
            *(f"self_attn.{p}_proj.weight" for p in "qkvo"),
            *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
        )
    ),
]
MINILM_NAMES = [
    "embeddings.word_embeddings.weight",
    "embeddings.position_embeddings.weight",
    "embeddings.token_type_embeddings.weight",
    "embeddings.LayerNorm.weight",
    "pooler.dense.weight",
    *(
        f"encoder.layer.{i}.{part}"
        for i in range(2)
        for part in (
            "attention.self.query.weight",
            "attention.self.key.weight",
            "attention.self.value.weight",
            "attention.output.dense.weight",
            "attention.output.LayerNorm.weight",
            "intermediate.dense.weight",
            "output.dense.weight",
            "output.LayerNorm.weight",
        )
    ),
]


def _fate(recipe: Recipe, name: str) -> QSpec | Keep:
    shape = (4096,) if "norm" in name.lower() else (4096, 4096)
    return resolve(recipe.rules, entry(name, shape), QSpec()).action


def test_llm_example_recipe() -> None:
    recipe = load_recipe(ROOT / "examples" / "llm.toml")
    assert unmatched(recipe.rules, LLAMA_NAMES) == []
    int4 = QSpec(Scheme.SYM, StorageDtype.INT4, PerGroup(64), RangeMethod.MINMAX)
    int4_g32 = QSpec(Scheme.SYM, StorageDtype.INT4, PerGroup(32), RangeMethod.MINMAX)
    expected = {
        "model.embed_tokens.weight": Keep,
        "lm_head.weight": Keep,
        "model.norm.weight": Keep,
        "model.layers.1.input_layernorm.weight": Keep,
        "model.layers.0.self_attn.k_proj.weight": int4,
        "model.layers.1.self_attn.o_proj.weight": int4,
        "model.layers.0.mlp.gate_proj.weight": int4,
        "model.layers.1.mlp.down_proj.weight": int4_g32,
    }
    for name, want in expected.items():
        got = _fate(recipe, name)
        assert isinstance(got, Keep) if want is Keep else got == want, name
    # the command-line spec does not leak into the recipe's choices
    base = QSpec(Scheme.ASYM, StorageDtype.UINT8, PerTensor())
    attn = entry("model.layers.0.self_attn.q_proj.weight")
    assert resolve(recipe.rules, attn, base).action == int4


def test_encoder_example_recipe() -> None:
    recipe = load_recipe(ROOT / "examples" / "bert.toml")
    assert unmatched(recipe.rules, MINILM_NAMES) == []
    assert recipe.ladder is not None and len(recipe.ladder) >= 2
    assert isinstance(_fate(recipe, "embeddings.position_embeddings.weight"), Keep)
    assert _fate(recipe, "embeddings.word_embeddings.weight") == QSpec()
    for name in (
        "encoder.layer.1.attention.self.query.weight",
        "encoder.layer.0.output.dense.weight",
    ):
        res = resolve(recipe.rules, entry(name), QSpec())
        assert res.from_command_line  # left to --target-sqnr and the ladder


def test_recipe_file_must_be_a_small_regular_utf8_file(tmp_path: Path) -> None:
    """A FIFO is refused unread (no hang), a device or a huge file is not slurped, a BOM is
    fine, deep nesting is a recipe error (tomllib recurses)."""
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    with pytest.raises(RecipeError, match="not a regular file"):
        load_recipe(fifo)
    with pytest.raises(RecipeError, match="not a regular file"):
        load_recipe("/dev/zero")
    big = tmp_path / "big.toml"
    big.write_text("# padding\n" * 200_000)
    with pytest.raises(RecipeError, match="over 1,048,576 bytes"):
        load_recipe(big)
    bom = tmp_path / "bom.toml"
    bom.write_bytes(b'\xef\xbb\xbf[[rule]]\nmatch = "a"\nkeep = "x"\n')
    assert len(load_recipe(bom).rules) == 1
    with pytest.raises(RecipeError, match="nested too deeply"):
        parse_recipe("x = " + "[" * 3000 + "]" * 3000)


def test_a_ladder_table_names_its_dtype() -> None:
    with pytest.raises(RecipeError, match="line 1: .*names its dtype"):
        parse_recipe("ladder = [{}]\n", "r.toml")
