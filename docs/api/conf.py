"""Sphinx configuration of dpfunc's API reference: ``make docs`` builds it into build/api.

autodoc imports the installed ``dpfunc``; napoleon reads the Google-style sections.
Each public module has a page (``automodule`` with ``:members:``, which follows the
module's ``__all__``), and its entries carry the module's name:
``dpfunc.clipping.clip_factors``. The first page lists what ``dpfunc`` itself exports,
each name linked to that entry, and a reference to ``dpfunc.clip_factors`` (or to a
bare ``clip_factors``) in a docstring resolves to it too: one entry per object, so no
object is described twice and no reference has two targets.
"""

import importlib
import inspect
import re
from pathlib import Path

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.ext import napoleon
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import nested_parse_with_titles

import dpfunc

project = "dpfunc"
release = version = dpfunc.__version__

extensions = ["sphinx.ext.autodoc", "sphinx.ext.autosummary", "sphinx.ext.napoleon"]

napoleon_google_docstring = True
napoleon_numpy_docstring = False

autodoc_member_order = "bysource"
autodoc_typehints = "description"  # signatures stay short; each argument's type sits by its text
autodoc_preserve_defaults = True  # defaults as written (``math.inf``), not their repr

html_title = f"dpfunc {release} API reference"
html_show_sourcelink = False

logger = logging.getLogger(__name__)
HERE = Path(__file__).resolve().parent
AUTO = re.compile(r"^\.\. auto(\w+)::\s*(\S+)\n((?:[ \t]+:.*\n)*)", re.M)


def documented() -> dict[str, object]:
    """Every object the pages document, by the name it is documented under.

    ``automodule`` with ``:members:`` documents a module's ``__all__`` when it has one,
    else the public functions and classes defined in it; ``autofunction`` and the like
    document one name.
    """
    names: dict[str, object] = {}
    for page in sorted(HERE.glob("*.rst")):
        for kind, target, options in AUTO.findall(page.read_text()):
            if kind != "module":
                module, _, attr = target.rpartition(".")
                names[target] = getattr(importlib.import_module(module), attr)
                continue
            module = importlib.import_module(target)
            names[target] = module
            if ":members:" not in options:
                continue
            public = getattr(module, "__all__", None)
            if public is None:
                public = [
                    name
                    for name, obj in vars(module).items()
                    if not name.startswith("_")
                    and (inspect.isfunction(obj) or inspect.isclass(obj))
                    and obj.__module__ == target
                ]
            names.update((f"{target}.{name}", getattr(module, name)) for name in public)
    return names


def canonical_names() -> dict[str, str | None]:
    """``dpfunc.X`` -> the name X's entry is documented under, for each X in ``dpfunc.__all__``.

    The page of the module that defines X comes first, then any page that documents it;
    an X that no page documents maps to None.
    """
    names = documented()
    result = {}
    for export in dpfunc.__all__:
        obj = getattr(dpfunc, export)
        home = obj.__name__ if inspect.ismodule(obj) else getattr(obj, "__module__", "")
        found = sorted(
            (name for name, other in names.items() if other is obj),
            key=lambda name: name != home and name.rpartition(".")[0] != home,
        )
        result[f"dpfunc.{export}"] = found[0] if found else None
    return result


CANONICAL: dict[str, str | None] = {}


class Exports(SphinxDirective):
    """``.. dpfunc-exports::``: a table of the functions and classes in ``dpfunc.__all__``.

    Each row links to the name's entry on its module's page. One that no page
    documents is documented right here, under its top-level name; an exported module
    without a page is an error (a warning, which ``-W`` turns into one).
    """

    def run(self):
        current = self.env.ref_context.get("py:module")
        rows, here = [], []
        for name, target in CANONICAL.items():
            obj = getattr(dpfunc, name.removeprefix("dpfunc."))
            if target is not None and not inspect.ismodule(obj):
                # autosummary wants a name relative to the current module
                rows.append(target.removeprefix(f"{current}.") if current else target)
            elif inspect.ismodule(obj) and target is None:
                message = f"{name} is exported but has no page in docs/api"
                logger.warning(message, location=self.get_location())
            elif target is None:
                here.append(f"{'class' if inspect.isclass(obj) else 'function'}:: {name}")
        lines = [".. autosummary::", "   :nosignatures:", "", *(f"   ~{t}" for t in rows), ""]
        for directive in here:
            lines += [f".. auto{directive}", ""]
        container = nodes.section()
        container.document = self.state.document
        source = self.get_source_info()[0]
        nested_parse_with_titles(self.state, StringList(lines, source), container)
        return container.children


def resolve_export(app, env, node, contnode):
    """``missing-reference``: ``dpfunc.X``, ``X`` and ``dpfunc.X.attr`` go to X's entry."""
    if node.get("refdomain") != "py":
        return None
    parts = node["reftarget"].split(".")
    if parts[0] != "dpfunc":
        parts.insert(0, "dpfunc")  # a bare name: resolved only when dpfunc exports it
    head = ".".join(parts[:2])
    target = CANONICAL.get(head)
    if target in (None, head):
        return None
    full = ".".join([target, *parts[2:]])
    domain = env.get_domain("py")
    return domain.resolve_xref(
        env, node["refdoc"], app.builder, node["reftype"], full, node, contnode
    )


FIELD = re.compile(r"^\s+(\w+)\s*:[^#=]*(?:=[^#]*)?(?:#\s*(.*))?$")
ALIAS = re.compile(r"^Alias for field number \d+$")


def field_comments(cls: type) -> dict[str, str]:
    """A NamedTuple's field comments: ``count: Tensor  # shape (), int64`` (or the lines above)."""
    try:
        source = inspect.getsource(cls).splitlines()[1:]
    except (OSError, TypeError):
        return {}
    comments, above = {}, []
    for line in source:
        stripped = line.strip()
        if stripped.startswith(("def ", "@")):
            break  # the fields come before the methods
        if stripped.startswith("#"):
            above.append(stripped.lstrip("#").strip())
            continue
        match = FIELD.match(line)
        if match and match[1] in cls._fields and (match[2] or above):
            comments[match[1]] = match[2] or " ".join(above)
        above = []
    return comments


def owner(name: str):
    """The class that ``module.Class.attr`` names an attribute of."""
    parts = name.split(".")[:-1]
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            obj = getattr(obj, part)
        return obj
    return None


def document_fields(app, what, name, obj, options, lines):
    """A NamedTuple field's doc is its source comment, not "Alias for field number 0"."""
    text = [line for line in lines if line.strip()]
    if what != "attribute" or len(text) != 1 or not ALIAS.match(text[0]):
        return
    cls = owner(name)
    comment = field_comments(cls).get(name.rpartition(".")[2]) if cls is not None else None
    lines[:] = [comment] if comment else []


def google_sections(app, what, name, obj, options, lines):
    """napoleon, reading an attribute's or a property's docstring as a function's.

    napoleon takes a first line ``text: more`` of an attribute's docstring for
    ``type: description`` (the Google guide's inline type). dpfunc writes no types
    there (they come from the annotations), only sentences that may hold a colon.
    """
    what = "function" if what in {"attribute", "data", "property"} else what
    napoleon._process_docstring(app, what, name, obj, options, lines)


def setup(app):
    CANONICAL.update(canonical_names())
    app.add_directive("dpfunc-exports", Exports)
    app.connect("missing-reference", resolve_export)
    app.connect("autodoc-process-docstring", document_fields, priority=400)
    listeners = app.events.listeners["autodoc-process-docstring"]
    found = [entry.id for entry in listeners if entry.handler is napoleon._process_docstring]
    if len(found) != 1:
        raise RuntimeError("napoleon's docstring handler not found: conf.py needs updating")
    app.disconnect(found[0])
    app.connect("autodoc-process-docstring", google_sections)
