"""Request templates: how a connection describes a target's requests in configuration (its method,
path and body per verb, and where an answer keeps what the engine needs).

Templates are Jinja2 expressions in a sandboxed environment, so a configuration file can never
reach a Python attribute: `{{ record.__class__ }}` is refused when the file is applied, and the
sandbox stands behind that check at run time. The placeholders, exactly:

- `{{ fields }}`: the body the rule maps (its `fields` mapping, or the whole payload);
- `{{ record.PATH }}`: a value of the mirrored payload, dotted for nesting;
- `{{ external_id }}`: the record's id in the source;
- `{{ remote_id }}`: the target's id of the record (update and delete only);
- `{{ collection }}`: the rule's collection;
- `{{ idempotency_key }}`: the create's key (create only);
- `{{ items }}`: the rendered items of a batch call (batch bodies only).

A string that is one placeholder and nothing else takes the value with its JSON type; inside a
longer string a placeholder renders as text. In a path each rendered value is percent-encoded as
one segment (`/ ? # %` and spaces escaped, `.` and `..` sent as `%2E` and `%2E%2E`), so no value
ever leaves its segment. Filters of Jinja2's own (`{{ record.age | string }}`) are allowed.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import jinja2
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

#: The placeholders every verb's template may use; `VERB_PLACEHOLDERS` says which where.
PLACEHOLDERS = ("fields", "record", "external_id", "remote_id", "collection", "idempotency_key", "items")
_COMMON = frozenset({"fields", "record", "external_id", "collection"})
VERB_PLACEHOLDERS: dict[str, frozenset[str]] = {
    "create": _COMMON | {"idempotency_key"},
    "update": _COMMON | {"remote_id"},
    "delete": _COMMON | {"remote_id"},
}
#: What a batch call's body may use: its items, and the collection.
BATCH_BODY_PLACEHOLDERS = frozenset({"items", "collection"})
METHODS: dict[str, tuple[str, ...]] = {
    "create": ("POST", "PUT", "PATCH"),
    "update": ("PATCH", "PUT", "POST"),
    "delete": ("DELETE", "POST", "PATCH"),
}

_ONE_PLACEHOLDER = re.compile(r"^\{\{(?P<expr>(?:(?!\}\}).)*)\}\}$", re.DOTALL)
_PLACEHOLDER = re.compile(r"\{\{(?P<expr>(?:(?!\}\}).)*)\}\}", re.DOTALL)
#: What the constant text of a path may hold: a relative path, no query, fragment or escape.
_PATH_TEXT = re.compile(r"^[A-Za-z0-9_\-.~/]*$")
_ALLOWED_NODES = (
    nodes.Template,
    nodes.Output,
    nodes.TemplateData,
    nodes.Name,
    nodes.Getattr,
    nodes.Getitem,
    nodes.Const,
    nodes.Filter,
    nodes.Tuple,
    nodes.List,
)


class MissingValue(Exception):
    """A record lacks a value its template needs: that record's refusal, as a 422 would be.
    `placeholder` is the template's text for it (`{{ record.email }}`)."""

    def __init__(self, placeholder: str) -> None:
        self.placeholder = placeholder
        super().__init__(f"the record has no value for {placeholder}")


def _segment(value: Any) -> str:
    """A rendered value as one path segment, whatever it holds."""
    text = "" if value is None else str(value)
    if text in (".", ".."):
        return "%2E" * len(text)
    return quote(text, safe="")


def _finalize_text(value: Any) -> Any:
    return "" if value is None else value


class _Environment(ImmutableSandboxedEnvironment):
    """Jinja2's immutable sandbox, where `record.items` is the payload's `items` field and never
    the mapping's method of that name (Jinja2 looks an attribute up before an item)."""

    def getattr(self, obj: Any, attribute: str) -> Any:
        if isinstance(obj, Mapping):
            try:
                return obj[attribute]
            except (KeyError, TypeError):
                return self.undefined(obj=obj, name=attribute)
        return super().getattr(obj, attribute)


_BODY_ENV = _Environment(undefined=jinja2.StrictUndefined, finalize=_finalize_text, autoescape=False)
_PATH_ENV = _Environment(undefined=jinja2.StrictUndefined, finalize=_segment, autoescape=False)


def problems(template: Any, where: str, allowed: frozenset[str], *, path: bool = False) -> list[str]:
    """Why `template` (a path string, or a body: strings, numbers, lists and mappings) cannot be
    used where only the placeholders `allowed` exist; each problem names its key path, from
    `where` on (`connections[1].requests.create.path`)."""
    found: list[str] = []
    for key_path, text in _strings(template, where):
        if path and not isinstance(template, str):
            found.append(f"{key_path}: a path is a string")
            continue
        try:
            tree = _BODY_ENV.parse(text)
        except jinja2.TemplateSyntaxError as exc:
            found.append(f"{key_path}: the template does not parse: {exc.message}")
            continue
        found.extend(f"{key_path}: {why}" for why in _node_problems(tree, allowed))
        if path:
            constant = _PLACEHOLDER.sub("x", text)
            if not _PATH_TEXT.fullmatch(constant) or constant.startswith("/"):
                found.append(
                    f"{key_path}: a path is relative to base_url and holds letters, digits, _ - . ~ and / "
                    "outside its placeholders (no leading /, query, fragment or % escape)"
                )
            elif any(part in (".", "..") for part in constant.split("/")):
                found.append(f"{key_path}: a path holds no . or .. segment")
    return found


def _strings(template: Any, where: str) -> Iterator[tuple[str, str]]:
    if isinstance(template, str):
        yield where, template
    elif isinstance(template, Mapping):
        for key, value in template.items():
            yield from _strings(value, f"{where}.{key}")
    elif isinstance(template, list):
        for index, value in enumerate(template):
            yield from _strings(value, f"{where}[{index}]")


def _node_problems(tree: nodes.Template, allowed: frozenset[str]) -> Iterator[str]:
    for node in tree.find_all(nodes.Node):
        if not isinstance(node, _ALLOWED_NODES):
            yield f"only placeholders and filters may be used ({type(node).__name__.lower()} found)"
            return
        if isinstance(node, nodes.Name):
            if node.name not in PLACEHOLDERS:
                yield f"unknown placeholder {{{{ {node.name} }}}} (known: {', '.join(PLACEHOLDERS)})"
            elif node.name not in allowed:
                yield f"{{{{ {node.name} }}}} is not known here (here: {', '.join(sorted(allowed))})"
        elif isinstance(node, nodes.Getattr) and node.attr.startswith("_"):
            yield f"a placeholder's path may not hold a segment starting with _ ({node.attr!r})"
        elif (
            isinstance(node, nodes.Getitem)
            and isinstance(node.arg, nodes.Const)
            and str(node.arg.value).startswith("_")
        ):
            yield f"a placeholder's path may not hold a segment starting with _ ({node.arg.value!r})"


@dataclass(frozen=True)
class Template:
    """A checked template (a path, or a body), rendered with a record's values."""

    source: Any
    path: bool = False

    def render(self, values: Mapping[str, Any]) -> Any:
        """The template with `values` in it. Raises `MissingValue` naming the first placeholder a
        value is missing for."""
        if self.path:
            path = _render_text(_PATH_ENV, self.source, values)
            if path.startswith("/") or any(part in ("", ".", "..") for part in path.split("/")):
                # A value rendered empty (a null, "") would address the collection, or join the
                # text around it into a dot segment: never sent.
                raise MissingValue(f"{self.source} (it renders {path!r}, a path with an empty or dot segment)")
            return path
        return _render(self.source, values)


def _render(template: Any, values: Mapping[str, Any]) -> Any:
    if isinstance(template, str):
        whole = _ONE_PLACEHOLDER.match(template)
        if whole is not None:
            return _evaluate(whole.group("expr"), template, values)
        return _render_text(_BODY_ENV, template, values)
    if isinstance(template, Mapping):
        return {key: _render(value, values) for key, value in template.items()}
    if isinstance(template, list):
        return [_render(value, values) for value in template]
    return template


def _evaluate(expression: str, text: str, values: Mapping[str, Any]) -> Any:
    try:
        value = _expression(expression)(**values)
    except jinja2.UndefinedError as exc:
        raise MissingValue(text.strip()) from exc
    if isinstance(value, jinja2.Undefined):
        raise MissingValue(text.strip())
    return value


def _render_text(env: jinja2.Environment, text: str, values: Mapping[str, Any]) -> str:
    try:
        return _compiled(env, text).render(**values)
    except jinja2.UndefinedError as exc:
        for match in _PLACEHOLDER.finditer(text):
            _evaluate(match.group("expr"), match.group(0), values)  # raises for the missing one
        raise MissingValue(text) from exc


_EXPRESSIONS: dict[str, Any] = {}
_TEMPLATES: dict[tuple[int, str], jinja2.Template] = {}


def _expression(source: str) -> Any:
    compiled = _EXPRESSIONS.get(source)
    if compiled is None:
        compiled = _EXPRESSIONS[source] = _BODY_ENV.compile_expression(source, undefined_to_none=False)
    return compiled


def _compiled(env: jinja2.Environment, text: str) -> jinja2.Template:
    key = (id(env), text)
    compiled = _TEMPLATES.get(key)
    if compiled is None:
        compiled = _TEMPLATES[key] = env.from_string(text)
    return compiled


def at_path(answer: Any, dotted: str) -> Any:
    """The value at a dotted path of a decoded answer (`results`, `data.id`, `items.0.id`), or
    None when the answer has nothing there."""
    value = answer
    for part in dotted.split("."):
        if isinstance(value, Mapping):
            value = value.get(part)
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return None
    return value
