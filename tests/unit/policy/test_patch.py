"""webhook.policy.patch: RFC 6901 escaping and a JSON Patch that always applies, checked against jsonpatch."""

from __future__ import annotations

import json
from typing import Any

import jsonpatch
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.harness.manifests import apply, assert_same_json, canonical
from webhook.policy import patch


@pytest.mark.parametrize(
    ("token", "escaped"),
    [
        pytest.param("nvidia.com/gpu", "nvidia.com~1gpu", id="slash"),
        pytest.param("a~b", "a~0b", id="tilde"),
        pytest.param("~1", "~01", id="literal-tilde-one"),
        pytest.param("~01", "~001", id="literal-tilde-zero-one"),
        pytest.param("/~", "~1~0", id="slash-then-tilde"),
        pytest.param("~/", "~0~1", id="tilde-then-slash"),
        pytest.param("plain", "plain", id="plain"),
        pytest.param("", "", id="empty"),
    ],
)
def test_escape_follows_rfc6901(token: str, escaped: str) -> None:
    assert patch.escape(token) == escaped
    # jsonpatch's pointer decoding is the reference: the escaped token must name the original key.
    assert jsonpatch.JsonPointer("/" + escaped).parts == [token]


@pytest.mark.parametrize(
    "key",
    [
        pytest.param("nvidia.com/gpu", id="slash"),
        pytest.param("~0", id="tilde-zero"),
        pytest.param("~1", id="tilde-one"),
        pytest.param("~01", id="tilde-zero-one"),
        pytest.param("a/b~c/~1", id="mixed"),
    ],
)
def test_keys_with_slash_and_tilde_round_trip(key: str) -> None:
    original = {"limits": {key: 1, "cpu": "1"}, "annotations": {key: "x"}}
    target = {"limits": {key: 2}, "annotations": {key: "x", f"{key}/new": "y"}}
    operations = patch.diff(original, target)
    assert_same_json(apply(original, operations), target)
    assert {"op": "replace", "path": f"/limits/{patch.escape(key)}", "value": 2} in operations


def test_gpu_resource_path_is_escaped() -> None:
    original = {"spec": {"containers": [{"resources": {"limits": {"nvidia.com/gpu": 1}}}]}}
    target = {"spec": {"containers": [{"resources": {"limits": {"nvidia.com/gpu": 2}}}]}}
    assert patch.diff(original, target) == [
        {"op": "replace", "path": "/spec/containers/0/resources/limits/nvidia.com~1gpu", "value": 2}
    ]


def test_missing_parent_is_added_whole() -> None:
    # RFC 6902 `add` needs the parent to exist: a pod without annotations gets the whole map.
    original: dict[str, Any] = {"metadata": {"name": "p"}}
    target = {"metadata": {"name": "p", "annotations": {"gpuguard.io/rules": "priority"}}}
    assert patch.diff(original, target) == [
        {"op": "add", "path": "/metadata/annotations", "value": {"gpuguard.io/rules": "priority"}}
    ]


@pytest.mark.parametrize(
    ("before", "after"),
    [
        pytest.param(1, True, id="int-to-bool"),
        pytest.param(True, 1, id="bool-to-int"),
        pytest.param(1, 1.0, id="int-to-float"),
        pytest.param(0, False, id="zero-to-false"),
        pytest.param("1", 1, id="string-to-int"),
        pytest.param(None, 0, id="null-to-zero"),
        pytest.param({}, [], id="object-to-array"),
        pytest.param([1], {"0": 1}, id="array-to-object"),
    ],
)
def test_type_changes_are_replaced(before: Any, after: Any) -> None:
    operations = patch.diff({"v": before}, {"v": after})
    assert operations == [{"op": "replace", "path": "/v", "value": after}]
    assert_same_json(apply({"v": before}, operations), {"v": after})


def test_list_shrink_removes_from_the_end_backwards() -> None:
    assert patch.diff({"l": [1, 2, 3, 4]}, {"l": [1, 9]}) == [
        {"op": "replace", "path": "/l/1", "value": 9},
        {"op": "remove", "path": "/l/3"},
        {"op": "remove", "path": "/l/2"},
    ]


def test_list_growth_adds_the_tail_in_order() -> None:
    assert patch.diff({"l": [1]}, {"l": [1, 2, 3]}) == [
        {"op": "add", "path": "/l/1", "value": 2},
        {"op": "add", "path": "/l/2", "value": 3},
    ]


def test_equal_documents_give_no_operations() -> None:
    document = {"a": [1, {"b": None}], "c": {"d/e": "~"}}
    assert patch.diff(document, {"a": [1, {"b": None}], "c": {"d/e": "~"}}) == []


def test_only_add_remove_replace_in_sorted_key_order() -> None:
    original = {"z": 1, "a": 1, "m": 1}
    target = {"y": 2, "a": 2, "n": 2}
    operations = patch.diff(original, target)
    assert [op["path"] for op in operations] == ["/a", "/m", "/n", "/y", "/z"]
    assert {op["op"] for op in operations} <= {"add", "remove", "replace"}


def test_root_replacement() -> None:
    operations = patch.diff({"a": 1}, [1, 2])
    assert operations == [{"op": "replace", "path": "", "value": [1, 2]}]
    assert apply({"a": 1}, operations) == [1, 2]


# --- property: every patch applies and yields exactly the target ------------------------------------

# Keys that stress pointer escaping, mixed with ordinary ones.
KEYS = st.one_of(
    st.sampled_from(["nvidia.com/gpu", "~", "~0", "~1", "~01", "/", "a/b", "", "0", "-", "spec"]),
    st.text(alphabet="ab~/.-0", max_size=4),
)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-3, max_value=3),
    st.sampled_from([0.0, 1.0, -1.5, 1e300]),
    st.text(max_size=3),
)
DOCUMENTS = st.recursive(
    SCALARS,
    lambda children: st.one_of(st.lists(children, max_size=5), st.dictionaries(KEYS, children, max_size=5)),
    max_leaves=25,
)


def _tweak(document: Any) -> st.SearchStrategy[Any]:
    """A document near `document`, so diffs exercise shared structure, not only whole replacement."""
    if isinstance(document, dict):
        return st.fixed_dictionaries(
            {}, optional={key: st.one_of(st.just(value), DOCUMENTS) for key, value in document.items()}
        ).flatmap(lambda kept: st.dictionaries(KEYS, DOCUMENTS, max_size=2).map(lambda extra: extra | kept))
    if isinstance(document, list):
        return st.lists(DOCUMENTS, max_size=3).map(lambda tail: document[: len(document) // 2] + tail)
    return st.one_of(st.just(document), SCALARS)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_patch_applies_to_original_and_gives_target(data: st.DataObject) -> None:
    original = data.draw(DOCUMENTS, label="original")
    target = data.draw(st.one_of(DOCUMENTS, _tweak(original)), label="target")
    operations = patch.diff(original, target)
    assert_same_json(apply(original, operations), target)
    assert all(op["op"] in {"add", "remove", "replace"} for op in operations)
    assert patch.diff(original, target) == operations  # deterministic


@settings(max_examples=200, deadline=None)
@given(DOCUMENTS)
def test_identical_documents_need_no_patch(document: Any) -> None:
    assert patch.diff(document, json.loads(canonical(document))) == []
