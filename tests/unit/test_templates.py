"""Request templates (delivery/templates.py): what is refused when a file is applied, how values are
rendered (their JSON type kept for a placeholder alone, text inside a string, one percent-encoded
segment in a path), and, over generated payloads, that any value renders to a path under the base
URL and a body that is the template with the values in it, or is that record's `MissingValue`."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import unquote, urljoin

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from delivery.templates import VERB_PLACEHOLDERS, MissingValue, Template, at_path, problems

CREATE = VERB_PLACEHOLDERS["create"]
UPDATE = VERB_PLACEHOLDERS["update"]


@pytest.mark.parametrize(
    ("template", "allowed", "path", "why"),
    [
        ("x/{{ remote_id }}", CREATE, True, "{{ remote_id }} is not known here"),
        ("x/{{ idempotency_key }}", UPDATE, True, "{{ idempotency_key }} is not known here"),
        ("x/{{ nope }}", CREATE, True, "unknown placeholder {{ nope }}"),
        ("x/{{ record.__class__ }}", CREATE, True, "segment starting with _ ('__class__')"),
        ("{{ record['_x'] }}", CREATE, False, "segment starting with _ ('_x')"),
        ("x/{{ external_id ", CREATE, True, "the template does not parse"),
        ("{{ record.keys() }}", CREATE, False, "only placeholders and filters may be used (call found)"),
        ("{% for x in record %}{% endfor %}", CREATE, False, "only placeholders and filters may be used"),
        ("/contacts/{{ external_id }}", CREATE, True, "a path is relative to base_url"),
        ("contacts?x={{ external_id }}", CREATE, True, "a path is relative to base_url"),
        ("../contacts/{{ external_id }}", CREATE, True, "no . or .. segment"),
    ],
)
def test_what_is_refused_when_applied(template: str, allowed: frozenset[str], path: bool, why: str) -> None:
    found = problems(template, "connections[1].requests.create.path", allowed, path=path)
    assert len(found) == 1 and found[0].startswith("connections[1].requests.create.path: "), found
    assert why in found[0], found


def test_a_body_problem_names_its_key_path() -> None:
    body = {"properties": "{{ fields }}", "associations": [{"to": "{{ remote_id }}"}]}
    assert problems(body, "c.body", CREATE) == [
        "c.body.associations[0].to: {{ remote_id }} is not known here "
        "(here: collection, external_id, fields, idempotency_key, record)"
    ]


def test_a_placeholder_alone_keeps_its_json_type_and_inside_text_renders_as_text() -> None:
    body = Template(
        {
            "properties": "{{ fields }}",
            "age": "{{ record.profile.age }}",
            "age_text": "{{ record.profile.age | string }}",
            "label": "contact {{ external_id }} ({{ record.profile.age }})",
            "associations": [],
            "role": "user",
            "n": 3,
        }
    )
    rendered = body.render(
        {"fields": {"email": "a@x.io", "gone": None}, "record": {"profile": {"age": 41}}, "external_id": "c-1"}
    )
    assert rendered == {
        "properties": {"email": "a@x.io", "gone": None},
        "age": 41,
        "age_text": "41",
        "label": "contact c-1 (41)",
        "associations": [],
        "role": "user",
        "n": 3,
    }


@pytest.mark.parametrize(
    ("template", "placeholder"),
    [
        ("{{ record.email }}", "{{ record.email }}"),
        ("mailto:{{ record.email }}", "{{ record.email }}"),
        ("{{ record.a.b }}", "{{ record.a.b }}"),
    ],
)
def test_a_missing_value_names_its_placeholder(template: str, placeholder: str) -> None:
    with pytest.raises(MissingValue) as caught:
        Template(template).render({"record": {"name": "x"}})
    assert caught.value.placeholder == placeholder
    assert str(caught.value) == f"the record has no value for {placeholder}"


@pytest.mark.parametrize(
    ("value", "segment"), [("a/b", "a%2Fb"), ("..", "%2E%2E"), (".", "%2E"), ("a b?#%", "a%20b%3F%23%25"), (7, "7")]
)
def test_a_path_value_is_one_percent_encoded_segment(value: Any, segment: str) -> None:
    assert Template("crm/{{ external_id }}/x", path=True).render({"external_id": value}) == f"crm/{segment}/x"


def test_at_path() -> None:
    answer = {"id": "1", "data": {"id": "2"}, "results": [{"id": "3"}]}
    assert [at_path(answer, p) for p in ("id", "data.id", "results.0.id", "missing", "results.9")] == [
        "1",
        "2",
        "3",
        None,
        None,
    ]


# -- generated: whatever a payload holds ---------------------------------------------------------

texts = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",)),
    max_size=20,
) | st.sampled_from(["", ".", "..", "/", "%", "?", "#", "../..", "%2e%2e", "a/../../b"])
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | texts,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=8,
)
BASE = "https://api.example.com/crm/v3/"


@given(external_id=texts, payload=st.dictionaries(texts, json_values, max_size=4))
def test_any_value_renders_to_a_path_under_the_base_url_and_its_body(external_id: str, payload: dict[str, Any]) -> None:
    path_template = Template("objects/{{ collection }}/{{ external_id }}/{{ record.key }}", path=True)
    body_template = Template({"properties": "{{ fields }}", "id": "{{ external_id }}", "text": "x-{{ external_id }}"})
    values = {"collection": "contacts", "external_id": external_id, "record": payload, "fields": payload}
    try:
        path = path_template.render(values)
    except MissingValue as missing:
        assert "key" not in payload and missing.placeholder == "{{ record.key }}"
        return
    # As the REST writer sends it: relative to the client's base URL, through httpx.
    url = httpx.Client(base_url=BASE).build_request("POST", path).url
    assert str(url).startswith(BASE), (path, str(url))
    segments = path.split("/")
    assert len(segments) == 4 and [unquote(s) for s in segments[:3]] == ["objects", "contacts", external_id]
    assert urljoin(BASE, path).startswith(BASE)
    body = body_template.render(values)
    assert body["properties"] == payload and body["id"] == external_id
    assert body["text"] == f"x-{external_id}"
    json.dumps(body)  # still JSON


def test_a_payload_field_named_like_a_mapping_method_is_the_field() -> None:
    record = {"items": [1, 2], "values": "v", "update": "u", "keys": {"k": 1}}
    assert Template({"i": "{{ record.items }}", "t": "x-{{ record.values }}-{{ record.update }}"}).render(
        {"record": record}
    ) == {"i": [1, 2], "t": "x-v-u"}
    with pytest.raises(MissingValue):
        Template("{{ record.get }}").render({"record": {}})


@pytest.mark.parametrize("value", [None, ""])
def test_a_path_value_rendering_an_empty_or_dot_segment_is_the_records_refusal(value: Any) -> None:
    with pytest.raises(MissingValue):
        Template("contacts/{{ record.crm_id }}", path=True).render({"record": {"crm_id": value}})
    with pytest.raises(MissingValue):  # the text around it would make a dot segment
        Template("a/{{ record.x }}../b", path=True).render({"record": {"x": value}})
    # A value that is itself a dot is escaped, never a dot segment.
    assert Template("a/{{ record.x }}../b", path=True).render({"record": {"x": "."}}) == "a/%2E../b"
