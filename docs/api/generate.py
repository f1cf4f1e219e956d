"""Writes the API reference as Markdown, one page per public module, into docs/reference/.

The Sphinx site (docs/api/) renders the same docstrings with autodoc; these pages are for
a reader without it: on the forge, in an editor, in a terminal. The public modules are
read from the package, not listed here: ``gc_jax`` and every module its ``__all__``
names, recursively (``gc_jax.losses``, ``gc_jax.compat``, ``gc_jax.compat.cachex``, ...);
a page documents the names of its module's ``__all__`` with their signatures and
docstrings. Regenerate after changing a public docstring or signature, from the
repository root::

    python docs/api/generate.py

``tests/test_api_reference.py`` fails while the pages differ from what this writes.
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
import textwrap
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

OUT = Path(__file__).resolve().parents[1] / "reference"
SECTIONS = {  # Google-style docstring sections
    "Args",
    "Arguments",
    "Attributes",
    "Returns",
    "Yields",
    "Raises",
    "Examples",
    "Example",
    "Notes",
    "Note",
    "Warning",
    "Warnings",
    "See Also",
    "References",
}
_ROLE = re.compile(r":(?:py:)?(?:func|class|mod|meth|attr|data|obj|exc|const):`~?([^`]+)`")
_LITERAL = re.compile(r"``([\s\S]+?)``")
_BORDER = re.compile(r"^=+( +=+)+$")  # a reStructuredText simple table's border
_SEE = re.compile(r"`([^`<]+?) <([^>]+)>`_")


def public_modules(package: ModuleType) -> list[ModuleType]:
    """``package`` and every module its ``__all__`` names, recursively, in a stable order."""
    found: dict[str, ModuleType] = {}

    def visit(module: ModuleType) -> None:
        if module.__name__ in found:
            return
        found[module.__name__] = module
        for name in getattr(module, "__all__", ()):
            value = getattr(module, name)
            if inspect.ismodule(value) and value.__name__.startswith(package.__name__ + "."):
                visit(value)

    visit(package)
    return [found[name] for name in sorted(found)]


def inline(text: str) -> str:
    """reStructuredText inline markup as Markdown: ``x`` and :func:`x` as `x`."""
    text = _ROLE.sub(lambda m: f"``{m.group(1)}``", text)
    text = _SEE.sub(r"[\1](\2)", text)
    return _LITERAL.sub(lambda m: f"`{m.group(1)}`", text)


def _paragraphs(lines: list[str]) -> list[str]:
    """Plain text, with doctests (``>>>``) fenced and ``::`` literal blocks fenced."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith(">>>"):
            block = []
            while i < len(lines) and lines[i].strip():
                block.append(lines[i])
                i += 1
            out += ["```pycon", *textwrap.dedent("\n".join(block)).splitlines(), "```"]
            continue
        if line.rstrip().endswith("::") and not line.strip().startswith(".."):
            text = line.rstrip()[:-1]  # "Usage::" -> "Usage:"
            out.append(inline(text.rstrip(":") + ":" if text.strip() != ":" else ""))
            i += 1
            while i < len(lines) and not lines[i].strip():
                i += 1
            block = []
            indent = len(line) - len(line.lstrip())
            while i < len(lines) and (
                not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > indent
            ):
                block.append(lines[i])
                i += 1
            while block and not block[-1].strip():
                block.pop()
            out += ["", "```text", *textwrap.dedent("\n".join(block)).splitlines(), "```", ""]
            continue
        if _BORDER.match(line.strip()):
            block, borders = [], 0
            while i < len(lines) and borders < 3:
                borders += bool(_BORDER.match(lines[i].strip()))
                block.append(lines[i])
                i += 1
            out += ["```text", *textwrap.dedent("\n".join(block)).splitlines(), "```"]
            continue
        start = i  # a run of plain lines: inline markup may span lines
        while i < len(lines) and _plain(lines, i, start):
            i += 1
        out += inline("\n".join(lines[start:i])).split("\n")
    return out


def _plain(lines: list[str], i: int, start: int) -> bool:
    line = lines[i]
    if line.lstrip().startswith(">>>") or _BORDER.match(line.strip()):
        return False
    return i == start or not (line.rstrip().endswith("::") and not line.strip().startswith(".."))


def _items(body: list[str]) -> list[str]:
    """An Args-like section: ``name: text`` items (continuations indented) as a list."""
    out: list[str] = []
    item: list[str] = []

    def flush() -> None:
        if item:
            name, _, rest = item[0].partition(":")
            text = " ".join(part.strip() for part in [rest, *item[1:]] if part.strip())
            out.append(f"- `{name.strip()}`: {inline(text)}")
            item.clear()

    for line in body:
        if not line.strip():
            continue
        if not line.startswith((" ", "\t")) and re.match(r"^\*{0,2}[\w.]+( \(.*?\))?:", line):
            flush()
            item.append(line)
        elif item:
            item.append(line)
        else:
            out.append(inline(line.strip()))
    flush()
    return out


def docstring(obj: Any) -> list[str]:
    """``obj``'s docstring as Markdown lines: sections as bold labels, Args-like
    sections as lists, doctests fenced."""
    doc = inspect.getdoc(obj) or ""
    lines = doc.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        header = lines[i].strip()
        if header.endswith(":") and header[:-1] in SECTIONS and not lines[i].startswith(" "):
            name = header[:-1]
            i += 1
            body = []
            while i < len(lines) and (not lines[i].strip() or lines[i].startswith((" ", "\t"))):
                body.append(lines[i])
                i += 1
            body = textwrap.dedent("\n".join(body)).splitlines()
            out += ["", f"**{name}:**", ""]
            if name in {"Args", "Arguments", "Attributes", "Raises"}:
                out += _items(body)
            else:
                out += _paragraphs(body)
            out.append("")
            continue
        start = i
        while i < len(lines):
            h = lines[i].strip()
            if h.endswith(":") and h[:-1] in SECTIONS and not lines[i].startswith(" "):
                break
            i += 1
        out += _paragraphs(lines[start:i])
    text = re.sub(r"\n{3,}", "\n\n", "\n".join(out)).strip("\n")
    return text.splitlines()


def _annotation(annotation: Any) -> str:
    if isinstance(annotation, str):
        return annotation
    if hasattr(annotation, "__forward_arg__"):
        return annotation.__forward_arg__
    return inspect.formatannotation(annotation)


def _parameter(p: inspect.Parameter) -> str:
    text = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name
    if p.annotation is not p.empty:
        text += f": {_annotation(p.annotation)}"
    if p.default is not p.empty:
        default = re.sub(r" at 0x[0-9a-f]+", "", repr(p.default))  # no addresses
        text += f" = {default}" if p.annotation is not p.empty else f"={default}"
    return text


def signature(name: str, obj: Any, method: bool = False) -> str:
    """``name(parameters) -> return``, one parameter a line where it is long; ``method``:
    the first parameter (``self``) left out."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return name
    params = list(sig.parameters.values())[1 if method else 0 :]
    parts, starred = [], False
    for i, p in enumerate(params):
        if p.kind is p.KEYWORD_ONLY and not starred:
            parts.append("*")
        if p.kind in (p.KEYWORD_ONLY, p.VAR_POSITIONAL):
            starred = True
        parts.append(_parameter(p))
        if p.kind is p.POSITIONAL_ONLY and (
            i + 1 == len(params) or params[i + 1].kind is not p.POSITIONAL_ONLY
        ):
            parts.append("/")
    returns = sig.return_annotation
    ret = "" if returns is inspect.Signature.empty else f" -> {_annotation(returns)}"
    one_line = f"{name}({', '.join(parts)}){ret}"
    if len(one_line) <= 88:
        return one_line
    return f"{name}(\n" + "".join(f"    {p},\n" for p in parts) + f"){ret}"


def _members(cls: type) -> list[tuple[str, Any]]:
    """A class's public methods and properties defined on it (not inherited), with a
    docstring of their own, in source order."""
    members = []
    for name, value in vars(cls).items():
        if name.startswith("_"):
            continue
        target = value.__func__ if isinstance(value, (classmethod, staticmethod)) else value
        if isinstance(value, property):
            target = value.fget
        if not (inspect.isfunction(target) or isinstance(value, property)):
            continue
        if not (getattr(target, "__doc__", None) or "").strip():
            continue
        members.append((name, value))
    return members


def entry(module: ModuleType, name: str) -> list[str]:
    obj = getattr(module, name)
    qualified = f"{module.__name__}.{name}"
    if inspect.ismodule(obj):
        summary = (inspect.getdoc(obj) or "").strip().splitlines()[:1]
        return [
            f"## `{name}`",
            "",
            f"Module: [`{obj.__name__}`]({obj.__name__}.md). {inline(''.join(summary))}",
            "",
        ]
    kind = "class" if inspect.isclass(obj) else "function" if callable(obj) else "value"
    lines = [f"## `{name}`", "", f"*{kind}* `{qualified}`", ""]
    if callable(obj):
        lines += ["```py", signature(name, obj), "```", ""]
    lines += [*docstring(obj), ""]
    if inspect.isclass(obj):
        for member, value in _members(obj):
            target = value.__func__ if isinstance(value, (classmethod, staticmethod)) else value
            label = "property" if isinstance(value, property) else "method"
            lines += [f"### `{name}.{member}`", "", f"*{label}*", ""]
            if not isinstance(value, property):
                method = not isinstance(value, staticmethod)  # self or cls left out
                lines += ["```py", signature(f"{name}.{member}", target, method), "```", ""]
            lines += [*docstring(value.fget if isinstance(value, property) else target), ""]
    return lines


def _first_sentence(obj: Any) -> str:
    doc = (inspect.getdoc(obj) or "").strip()
    first = doc.split("\n\n")[0].replace("\n", " ")
    return inline(first)


def page(module: ModuleType) -> str:
    names = list(getattr(module, "__all__", ()))
    lines = [
        f"# `{module.__name__}`",
        "",
        "<!-- Generated by docs/api/generate.py from the docstrings: do not edit by hand. -->",
        "",
        *docstring(module),
        "",
        "| name | |",
        "|---|---|",
    ]
    for name in names:
        anchor = name.lower()
        lines.append(f"| [`{name}`](#{anchor}) | {_first_sentence(getattr(module, name))} |")
    lines.append("")
    for name in names:
        lines += entry(module, name)
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).rstrip("\n") + "\n"


def index(modules: list[ModuleType]) -> str:
    lines = [
        "# API reference (Markdown)",
        "",
        "<!-- Generated by docs/api/generate.py from the docstrings: do not edit by hand. -->",
        "",
        "Every public module of gc_jax, its names (the module's `__all__`), their",
        "signatures and docstrings, generated from the package by",
        "`python docs/api/generate.py` (the Sphinx site renders the same docstrings:",
        "[Development](../development.md#the-documentation)). Start with",
        "[`gc_jax`](gc_jax.md): `cached_value_and_grad`, `make_train_step`,",
        "`chunked_encoder`.",
        "",
        "| module | |",
        "|---|---|",
    ]
    for module in modules:
        lines.append(f"| [`{module.__name__}`]({module.__name__}.md) | {_first_sentence(module)} |")
    return "\n".join(lines) + "\n"


def pages(package: ModuleType) -> dict[str, str]:
    """File name -> text of every page, for ``package``."""
    modules = public_modules(package)
    out = {f"{m.__name__}.md": page(m) for m in modules}
    out["README.md"] = index(modules)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT, help=f"default {OUT.name}/ in docs/")
    args = parser.parse_args(argv)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the 0.1 paths warn on import
        import gc_jax

        written = pages(gc_jax)
    args.out.mkdir(parents=True, exist_ok=True)
    for stale in set(p.name for p in args.out.glob("*.md")) - set(written):
        (args.out / stale).unlink()
    for name, text in written.items():
        (args.out / name).write_text(text)
    print(f"wrote {len(written)} pages to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
