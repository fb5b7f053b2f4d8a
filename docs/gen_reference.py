"""The docs site's generated references, built from the code each time the site is built so they cannot drift:
the CLI (the Typer app as click sees it), the configuration (the pydantic models), the HTTP API (the FastAPI
app's OpenAPI schema) and the Python API (``clarifier.api``'s exports, through mkdocstrings).

``command_tree()`` is also what ``tests/unit/test_docs.py`` parses every documented ``clarifier`` command with.
"""

from __future__ import annotations

import inspect
import json
import types
import typing
from typing import Any, Iterator

# ---- CLI ------------------------------------------------------------------------------------


def command_tree():
    """The ``clarifier`` command as click sees it (Typer builds it from ``clarifier.cli.app``; Typer carries a
    click of its own, so commands are told apart by what they have, not by click's classes)."""
    import typer.main

    from clarifier.cli import app

    return typer.main.get_command(app)


def context(cmd, name: str | None = None):
    return cmd.context_class(cmd, info_name=name)


def is_group(cmd) -> bool:
    return hasattr(cmd, "list_commands")


def subcommands(cmd) -> dict:
    """A group's visible subcommands by name."""
    if not is_group(cmd):
        return {}
    ctx = context(cmd)
    subs = {n: cmd.get_command(ctx, n) for n in cmd.list_commands(ctx)}
    return {n: c for n, c in subs.items() if c is not None and not c.hidden}


def walk_commands(cmd, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    yield path, cmd
    for name, sub in subcommands(cmd).items():
        yield from walk_commands(sub, (*path, name))


def _cell(text: str | None) -> str:
    return " ".join((text or "").split()).replace("|", "\\|").replace("<", "&lt;")


def _is_argument(p) -> bool:
    return p.param_type_name == "argument"


def _param_type(p) -> str:
    td = getattr(p, "type_descriptor", None)
    if td is not None:
        return _type_name(td.annotation).replace("PosixPath", "Path")
    t = getattr(p, "type", None)
    return getattr(t, "name", "text")


def _param_row(p) -> str:
    if _is_argument(p):
        name = f"`{(p.metavar or p.name).upper()}`" + (" ..." if p.nargs == -1 else "")
        kind = "argument" + (", required" if p.required else "")
    else:
        names = [*p.opts, *p.secondary_opts]
        name = " / ".join(f"`{n}`" for n in names)
        if not p.is_flag and p.metavar:
            name += f" `{p.metavar}`"
        kind = "flag" if getattr(p, "is_flag", False) else _cell(_param_type(p))
        kind += ", required" if p.required else ""
        if p.multiple:
            kind += ", repeatable"
    default = p.default
    if callable(default) or default in (None, (), []) or _is_argument(p):
        shown = ""
    elif isinstance(default, bool) and getattr(p, "secondary_opts", None):
        shown = f"`{(p.opts if default else p.secondary_opts)[0]}`"
    else:
        shown = f"`{default}`"
    return f"| {name} | {kind} | {shown} | {_cell(getattr(p, 'help', None))} |"


def cli_reference() -> str:
    """Markdown for every ``clarifier`` command: usage, help text and a table of its arguments and options."""
    root = command_tree()
    out: list[str] = []
    for path, cmd in walk_commands(root):
        full = " ".join(("clarifier", *path))
        level = "#" * min(2 + len(path), 4)
        out.append(f"{level} `{full}`\n")
        ctx = context(cmd, full)
        usage = " ".join(cmd.collect_usage_pieces(ctx))
        out.append(f"```text\n{full} {usage}\n```\n")
        help_text = inspect.cleandoc(cmd.help or "")
        if help_text:
            out.append(help_text.replace("\b\n", "") + "\n")
        params = [p for p in cmd.get_params(ctx) if p.name != "help" and not getattr(p, "hidden", False)]
        if params:
            out.append("| argument / option | type | default | description |\n|---|---|---|---|")
            out.extend(_param_row(p) for p in params)
            out.append("")
        if is_group(cmd):
            out.append("Subcommands: " + ", ".join(f"`{n}`" for n in subcommands(cmd)) + ".\n")
    return "\n".join(out)


# ---- configuration --------------------------------------------------------------------------


def _type_name(t: Any) -> str:
    origin = typing.get_origin(t)
    if t is type(None):
        return "null"
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in typing.get_args(t))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(t))
    if origin is typing.Annotated:
        return _type_name(typing.get_args(t)[0])
    if origin in (list, tuple, set, dict):
        args = ", ".join(_type_name(a) for a in typing.get_args(t) if a is not Ellipsis)
        return f"{origin.__name__}[{args}]" if args else origin.__name__
    return getattr(t, "__name__", str(t).replace("typing.", ""))


def _model_of(t: Any):
    """The pydantic model a field holds (itself, or inside Optional/list/dict), else None."""
    from pydantic import BaseModel

    if isinstance(t, type) and issubclass(t, BaseModel):
        return t, ""
    origin = typing.get_origin(t)
    if origin in (typing.Union, types.UnionType, typing.Annotated):
        for a in typing.get_args(t):
            m, suffix = _model_of(a)
            if m is not None:
                return m, suffix
    if origin is list:
        m, _ = _model_of(typing.get_args(t)[0]) if typing.get_args(t) else (None, "")
        return m, "[]"
    if origin is dict:
        m, _ = _model_of(typing.get_args(t)[-1]) if typing.get_args(t) else (None, "")
        return m, ".<name>"
    return None, ""


def _default(field) -> str:
    from pydantic import BaseModel
    from pydantic_core import PydanticUndefined

    if field.default_factory is not None:
        try:
            value = field.default_factory()
        except TypeError:
            return "(computed)"
    else:
        value = field.default
    if value is PydanticUndefined:
        return "required"
    if isinstance(value, BaseModel):
        return "(section)"
    text = json.dumps(value, default=str)
    return f"`{text}`" if len(text) <= 60 else f"`{text[:57]}...`"


def field_description(field) -> str:
    """A key's description: its own, else (for a section) the first paragraph of its model's docstring."""
    if field.description:
        return field.description
    sub, _ = _model_of(field.annotation)
    doc = inspect.cleandoc(sub.__doc__ or "") if sub is not None and sub.__doc__ else ""
    return doc.split("\n\n")[0].replace("\n", " ") if doc else ""


def anchor(section: str) -> str:
    return "config-" + section.replace(".", "-").replace("[]", "").replace("<name>", "name").strip("-")


def config_sections(model=None, prefix: str = "") -> list[tuple[str, Any]]:
    """Every (dotted prefix, pydantic model) of the configuration, depth first."""
    from clarifier.core.config import ClarifierConfig

    model = model or ClarifierConfig
    out = [(prefix, model)]
    for name, field in model.model_fields.items():
        sub, suffix = _model_of(field.annotation)
        if sub is not None:
            out.extend(config_sections(sub, f"{prefix}{name}{suffix}."))
    return out


def config_reference() -> str:
    """Markdown: one table per configuration section, every key with its type, default and description."""
    out: list[str] = []
    for prefix, model in config_sections():
        title = prefix.rstrip(".")
        if not title:
            out.append("Sections: " + ", ".join(f"[`{n}`](#{anchor(n)})" for n in model.model_fields) + ".\n")
            continue
        out.append(f"### `{title}` {{#{anchor(title)}}}\n")
        doc = inspect.cleandoc(model.__doc__ or "") if model.__doc__ and "BaseModel" not in (model.__doc__ or "") else ""
        if doc:
            out.append(doc + "\n")
        out.append("| key | type | default | description |\n|---|---|---|---|")
        for name, field in model.model_fields.items():
            sub, _ = _model_of(field.annotation)
            kind = _cell(_type_name(field.annotation))
            desc = field_description(field)
            if sub is not None:
                desc = (desc + " " if desc else "") + f"([section below](#{anchor(prefix + name)}))"
            checks = [f"{k} {v}" for m in field.metadata for k, v in
                      (("≥", getattr(m, "ge", None)), (">", getattr(m, "gt", None)), ("≤", getattr(m, "le", None)),
                       ("<", getattr(m, "lt", None))) if v is not None]
            if checks:
                desc += f" ({', '.join(checks)})"
            out.append(f"| `{prefix}{name}` | {kind} | {_default(field)} | {_cell(desc)} |")
        out.append("")
    return "\n".join(out)


# ---- HTTP -----------------------------------------------------------------------------------


def openapi_schema() -> dict:
    from clarifier.serving.ingress import fastapi_app

    return fastapi_app.openapi()


def _schema_type(s: dict) -> str:
    if "$ref" in s:
        name = s["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#{name.lower()})"
    if "anyOf" in s:
        return " \\| ".join(_schema_type(x) for x in s["anyOf"])
    if s.get("type") == "array":
        return f"array of {_schema_type(s.get('items', {}))}"
    if "enum" in s:
        return " \\| ".join(json.dumps(v) for v in s["enum"])
    if "const" in s:
        return json.dumps(s["const"])
    return s.get("type", "any")


def http_reference() -> str:
    """Markdown: every route of the serving app (method, path, body, responses) and every schema's fields."""
    spec = openapi_schema()
    out = [f"OpenAPI {spec.get('openapi')}; `{spec['info']['title']}` {spec['info'].get('version', '')}.\n"]
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            out.append(f"### `{method.upper()} {path}`\n")
            if op.get("summary"):
                out.append(f"**{op['summary']}**\n")
            if op.get("description"):
                out.append(inspect.cleandoc(op["description"]) + "\n")
            body = op.get("requestBody", {}).get("content", {})
            for ctype, c in body.items():
                out.append(f"Request body (`{ctype}`): {_schema_type(c.get('schema', {}))}\n")
            params = op.get("parameters", [])
            if params:
                out.append("| parameter | in | type | required | description |\n|---|---|---|---|---|")
                out.extend(f"| `{p['name']}` | {p['in']} | {_schema_type(p.get('schema', {}))} | "
                           f"{'yes' if p.get('required') else 'no'} | {_cell(p.get('description'))} |" for p in params)
                out.append("")
            responses = op.get("responses", {})
            if responses:
                out.append("| status | meaning | body |\n|---|---|---|")
                for code, r in responses.items():
                    schema = next(iter(r.get("content", {}).values()), {}).get("schema", {})
                    out.append(f"| {code} | {_cell(r.get('description'))} | {_schema_type(schema) if schema else ''} |")
                out.append("")
    out.append("## Schemas\n")
    for name, s in spec.get("components", {}).get("schemas", {}).items():
        out.append(f"### {name}\n")
        if s.get("description"):
            out.append(_cell(s["description"]) + "\n")
        props = s.get("properties", {})
        if props:
            req = set(s.get("required", []))
            out.append("| field | type | required | default | description |\n|---|---|---|---|---|")
            for f, fs in props.items():
                default = f"`{json.dumps(fs['default'])}`" if "default" in fs else ""
                out.append(f"| `{f}` | {_schema_type(fs)} | {'yes' if f in req else 'no'} | {default} | "
                           f"{_cell(fs.get('description'))} |")
            out.append("")
        elif "enum" in s:
            out.append("One of " + ", ".join(f"`{json.dumps(v)}`" for v in s["enum"]) + ".\n")
    return "\n".join(out)


# ---- Python API -----------------------------------------------------------------------------


def python_api() -> str:
    """mkdocstrings blocks for every name ``clarifier.api`` exports (it loads them lazily, so each is documented
    where it is defined)."""
    from clarifier import api

    return "\n".join(f"::: {api._EXPORTS[name]}.{name}\n" for name in api.__all__)
