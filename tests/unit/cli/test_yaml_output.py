"""`gpuguard mutate` writes YAML that YAML 1.1 (PyYAML, and kubectl's go-yaml for booleans), YAML 1.2
(ruamel.yaml) and Go's number syntax all read back as written: every string that one of them could take
for another type is quoted. (tests/e2e/test_yaml_round_trip.py does the same through kubectl.)"""

from __future__ import annotations

import io
from typing import Any

import yaml
from hypothesis import example, given, settings
from hypothesis import strategies as st
from ruamel.yaml import YAML

from tests.harness.manifests import EXAMPLES
from webhook import cli
from webhook.cli import yaml_output

TRICKY = [
    "0o17", "017", "0x1F", "0b101", "1e3", "1E3", "-1e-3", "1_000", "1_000.5", ".5", "5.", "+12", "-0",
    "1:30", "190:20:30", "2001-12-14", "2001-12-14t21:59:43.10-05:00", "2001-12-14 21:59:43.10 -5",
    ".inf", "-.Inf", ".NaN", "inf", "nan", "Infinity", "~", "null", "Null", "NULL", "", "y", "Y", "n", "N",
    "yes", "No", "ON", "off", "True", "FALSE", "<<", "=", "0", "00", "1.0", "0.0.1", "1.2.3", "v1",
    "\x85", "next\x85line", "line\u2028separator", "\u2029",  # folded into a space unless escaped
]  # fmt: skip
# Characters number and boolean syntaxes are made of, so that generated strings hit them often.
AMBIGUOUS = st.text(alphabet="0123456789+-._: eExXoObBjJaAnNfFiIyYsStTlLuUrRpP~<=", max_size=12)
STRINGS = st.one_of(st.sampled_from(TRICKY), AMBIGUOUS, st.text(max_size=20))

_YAML12 = YAML(typ="safe", pure=True)


def yaml12(text: str) -> Any:
    return _YAML12.load(io.StringIO(text))


def go_reads_a_number(value: str) -> bool:
    """Whether Go's strconv.ParseInt(s, 0, 64) or ParseFloat would read `value` (Python's int(s, 0) and
    float() accept the same literal forms), as go-yaml tries for plain scalars."""
    if not value.isascii():
        return False  # Python's int() and float() read any Unicode digit (U+06F0 is 0); Go's only ASCII ones
    for parse in (lambda s: int(s, 0), float):
        try:
            parse(value)
        except ValueError:
            continue
        return True
    return False


@settings(max_examples=600)
@given(STRINGS)
def test_every_string_reads_back_as_the_same_string(value: str) -> None:
    document = {"value": value, value: "as a key", "list": [value]}
    text = yaml_output.dump(document)

    assert yaml.safe_load(text) == document  # YAML 1.1
    assert yaml12(text) == document  # YAML 1.2


@settings(max_examples=600)
@given(STRINGS)
@example("\u06f0")  # an Arabic-Indic zero: a number to Python's float(), a string to Go's
def test_a_string_go_would_read_as_a_number_is_quoted(value: str) -> None:
    text = yaml_output.dump(value)
    if go_reads_a_number(value):
        assert text[0] in "'\"", text


def test_the_strings_pyyaml_leaves_bare_are_quoted() -> None:
    plain = yaml.safe_dump({"a": "0o17", "b": "1e3"})
    assert yaml12(plain) == {"a": 15, "b": 1000.0}  # what used to reach kubectl
    assert yaml_output.dump({"a": "0o17", "b": "1e3"}) == 'a: "0o17"\nb: "1e3"\n'


def test_ordinary_strings_stay_plain() -> None:
    text = yaml_output.dump({"image": "nvcr.io/nvidia/cuda:12.4.1-base", "name": "trainer", "gpus": 3})
    assert text == "image: nvcr.io/nvidia/cuda:12.4.1-base\nname: trainer\ngpus: 3\n"
    # `n` is a boolean to go-yaml (YAML 1.1), so as a key it is quoted like any other.
    assert yaml_output.dump({"n": 1}) == '"n": 1\n'


def test_mutate_output_keeps_user_strings(tmp_path: Any, capsys: Any) -> None:
    manifest = yaml.safe_load((EXAMPLES / "gpu-training-job.yaml").read_text())
    template = manifest["spec"]["template"]
    template["metadata"] = {"labels": {"release": "1e3", "mode": "off"}}
    template["spec"]["containers"][0]["env"] = [{"name": name, "value": name} for name in TRICKY if name]
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest))

    assert cli.main(["mutate", "-f", str(path)]) == 0
    out = capsys.readouterr().out
    for read in (yaml.safe_load, yaml12):
        mutated = read(out)["spec"]["template"]
        assert mutated["metadata"]["labels"] == {"release": "1e3", "mode": "off"}
        assert mutated["spec"]["containers"][0]["env"] == template["spec"]["containers"][0]["env"]
