"""docs/upstreaming.md must list every place the serving adapters touch an engine's internals.

The adapters' sources are parsed (``ast``), never imported, so this runs without any engine
installed. What is found mechanically (see ``_Module``):

* ``write``: an attribute assigned or deleted on anything but ``self`` / ``cls`` (a
  monkeypatch of an engine module or class, a field of an engine object, ...), ``setattr`` /
  ``delattr``, and the attributes a patch helper sets (a function that ``setattr``-s names it
  is given on one of its parameters: each call's keyword names);
* ``subclass``: a class whose base is imported from the engine's package;
* ``private``: an engine ``_name`` read or called (``x._name``, ``getattr(x, "_name")``; on
  ``self`` in an engine subclass when the class does not define it in its body or
  ``__init__``), and a private method an engine subclass defines that vattn never calls
  itself (an override of an engine method);
* ``loader``: import-system hooks (``importlib`` loader / finder subclasses, ``sys.meta_path``
  and ``sys.modules`` changes, ``.pth`` file names);
* ``import``: every name imported from the engine's package.

Each finding has a code key (``model_runner.GPUModelRunner.initialize_kv_cache``, aliases
resolved, an imported module named by its last component). The doc's tables (header cells
``kind``, ``file``, ``code``) must list the key in the same file with a kind that fits; a row of
a mechanical kind whose key is no longer found, or a file that no longer exists, fails too.
The summary table's counts must equal the rows.

When the adapters change, run this test: it names each missing or stale item; edit the doc.
"""

from __future__ import annotations

import ast
import os
import re
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "upstreaming.md"
ADAPTERS = ROOT / "adapters"

#: adapters/<dir> -> the engine's top-level packages
ENGINE_PACKAGES = {"vllm": ("vllm",), "sglang": ("sglang",), "tgi": ("text_generation_server",),
                   "transformers": ("transformers",)}
#: Harness modules (runners, GPU stages, reports, CPU stand-ins) drive engines for tests and
#: benchmarks; they are not serving code and are skipped wherever one of these names is present
#: under adapters/<engine>/ (a name that is absent is fine).
HARNESS = {"vllm": {"conformance.py", "worker.py", "gpu_run.py", "gpu_report.py", "gpu_modes.py",
                    "paired.py"},
           "tgi": {"drive.py", "cpu.py", "conformance.py"},
           "transformers": {"conformance.py"},
           "sglang": {"gpu_run.py", "engine_run.py", "conformance.py"}}

#: touch points (counted in the summary), official extension points, and vattn's own objects
TOUCH_KINDS = ("patch", "write", "subclass", "private", "import-hook", "internal", "mirror")
OFFICIAL_KINDS = ("entry-point", "registry", "platform-hook", "base-class", "hook-write", "api")
KINDS = set(TOUCH_KINDS) | set(OFFICIAL_KINDS) | {"own"}
#: kinds whose every code key must be found by the scan (the others: its names must occur in the file)
MECHANICAL = {"patch", "write", "subclass", "private", "import-hook", "base-class", "hook-write", "own"}
#: finding category -> the row kinds that may list it
FITS = {"write": {"patch", "write", "hook-write", "import-hook", "own"},
        "subclass": {"subclass", "base-class"},
        "private": {"private", "patch"},
        "loader": {"import-hook"}}   # an import fits any row of its file naming the imported name

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


# -- the scan ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Finding:
    category: str
    file: str          # relative to the repository root
    key: str
    line: int
    names: tuple = ()  # subclass: the methods a row must name; import: the imported name


def _chain(node) -> list[str] | None:
    """``a.b.c`` -> ``["a", "b", "c"]``; None for anything but names and attributes."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def _is_super(node) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _vattn_sources():
    """vattn's own Python files (no tests, no environments, no build output)."""
    for folder, dirs, files in os.walk(ROOT):
        here = Path(folder)
        dirs[:] = [d for d in dirs if not d.startswith((".", "__")) and d not in ("build", "dist")
                   and not (here == ROOT and d == "tests") and not d.endswith(".egg-info")]
        yield from (here / f for f in files if f.endswith(".py"))


def _own_private_names() -> set[str]:
    """``_names`` vattn defines itself (module level, in class bodies, as ``self._x``)."""
    own: set[str] = set()
    for path in _vattn_sources():
        tree = ast.parse(path.read_text(), str(path))
        bodies = [tree.body] + [n.body for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
        for body in bodies:
            for node in body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    own.add(node.name)
                elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    own.update(t.id for t in targets if isinstance(t, ast.Name))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                    and isinstance(node.value, ast.Name) and node.value.id == "self":
                own.add(node.attr)
    return {name for name in own if _private(name)}


class _Module:
    """One adapter source file and what it touches of its engine."""

    def __init__(self, engine: str, path: Path, own_private: set[str], source: str | None = None):
        self.packages = ENGINE_PACKAGES[engine]
        self.file = path.relative_to(ROOT).as_posix() if source is None else str(path)
        self.tree = ast.parse(path.read_text() if source is None else source)
        self.own_private = own_private
        self.parent = {child: node for node in ast.walk(self.tree)
                       for child in ast.iter_child_nodes(node)}
        self.imports: dict[str, tuple[str, str]] = {}   # local name -> (dotted path, original name)
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        self.imports[a.asname] = (a.name, a.name.rsplit(".", 1)[-1])
                    else:
                        top = a.name.split(".")[0]
                        self.imports[top] = (top, top)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:
                    self.imports[a.asname or a.name] = (f"{node.module}.{a.name}", a.name)
        self.consts = {t.id: n.value.value for n in self.tree.body if isinstance(n, ast.Assign)
                       and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
                       for t in n.targets if isinstance(t, ast.Name)}
        self.aliases = {scope: self._aliases(scope) for scope in ast.walk(self.tree)
                        if isinstance(scope, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef))}
        self.helpers = self._patch_helpers()
        #: attributes read on anything but ``super()`` (a private method vattn calls is its own)
        self.referenced = {n.attr for n in ast.walk(self.tree)
                           if isinstance(n, ast.Attribute) and not _is_super(n.value)}

    # -- name resolution ---------------------------------------------------------------------
    @staticmethod
    def _aliases(scope) -> dict[str, ast.expr]:
        """Names bound once in ``scope`` (not in nested functions) to a name / attribute chain."""
        seen: dict[str, list] = defaultdict(list)
        todo = list(ast.iter_child_nodes(scope))
        while todo:
            node = todo.pop()
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                continue
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                target, value = node.targets[0], node.value
                pairs = [(target, value)]
                if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) \
                        and len(target.elts) == len(value.elts):
                    pairs = list(zip(target.elts, value.elts))
                for t, v in pairs:
                    if isinstance(t, ast.Name):
                        seen[t.id].append(v)
            todo.extend(ast.iter_child_nodes(node))
        return {name: values[0] for name, values in seen.items()
                if len(values) == 1 and _chain(values[0]) is not None}

    def _scopes(self, node):
        while node in self.parent:
            node = self.parent[node]
            if node in self.aliases:
                yield node

    def _class_of(self, node) -> ast.ClassDef | None:
        while node in self.parent:
            node = self.parent[node]
            if isinstance(node, ast.ClassDef):
                return node
        return None

    def _function_of(self, node):
        while node in self.parent:
            node = self.parent[node]
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                return node
        return None

    def resolve(self, expr, at) -> str:
        """The code key of ``expr`` (a name chain, aliases followed, imports shortened)."""
        parts = _chain(expr)
        if parts is None:
            return ast.unparse(expr)
        seen = set()
        while parts[0] not in seen:
            seen.add(parts[0])
            alias = next((s[parts[0]] for s in (self.aliases[sc] for sc in self._scopes(at))
                          if parts[0] in s), None)
            if alias is None:
                break
            parts = _chain(alias) + parts[1:]
        if parts[0] in self.imports:
            parts = [self.imports[parts[0]][1], *parts[1:]]
        return ".".join(parts)

    def _imported_from(self, expr, packages) -> str | None:
        parts = _chain(expr)
        if parts is None or parts[0] not in self.imports:
            return None
        dotted = self.imports[parts[0]][0]
        return dotted if dotted.split(".")[0] in packages else None

    def _const(self, node) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Name):
            return self.consts.get(node.id)
        return None

    def engine_bases(self, cls: ast.ClassDef) -> list[str]:
        return [self.resolve(b, cls).rsplit(".", 1)[-1] for b in cls.bases
                if self._imported_from(b, self.packages)]

    # -- findings ----------------------------------------------------------------------------
    def _patch_helpers(self) -> dict[str, int]:
        """Functions that ``setattr`` a non-constant name on one of their parameters ->
        that parameter's position (their callers name the attributes as keywords)."""
        helpers = {}
        for fn in ast.walk(self.tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            params = [a.arg for a in fn.args.posonlyargs + fn.args.args]
            for call in ast.walk(fn):
                if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) \
                        and call.func.id in ("setattr", "delattr") and len(call.args) >= 2 \
                        and isinstance(call.args[0], ast.Name) and call.args[0].id in params \
                        and self._const(call.args[1]) is None:
                    helpers[fn.name] = params.index(call.args[0].id)
        return helpers

    def findings(self) -> list[Finding]:
        out: list[Finding] = []

        def add(category, key, node, names=()):
            out.append(Finding(category, self.file, key, getattr(node, "lineno", 0), tuple(names)))

        for node in ast.walk(self.tree):
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.Delete)):
                targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
                for target in self._flat(targets):
                    self._write_target(target, node, add)
            elif isinstance(node, ast.Call):
                self._call(node, add)
            elif isinstance(node, ast.Attribute) and _private(node.attr):
                on_self = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
                if isinstance(node.ctx, ast.Load) or on_self:   # other stores are writes
                    self._private(node.value, node.attr, node, add)
            elif isinstance(node, ast.ClassDef):
                self._class(node, add)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                module = node.module if isinstance(node, ast.ImportFrom) else None
                if isinstance(node, ast.ImportFrom) and (node.level or not module):
                    continue
                for a in node.names:
                    dotted = f"{module}.{a.name}" if module else a.name
                    if dotted.split(".")[0] in self.packages:
                        add("import", dotted, node, [a.name.rsplit(".", 1)[-1]])
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and re.fullmatch(r"[\w.-]+\.pth", node.value):
                add("loader", node.value, node)
        return out

    @staticmethod
    def _flat(targets):
        for t in targets:
            if isinstance(t, (ast.Tuple, ast.List)):
                yield from _Module._flat(t.elts)
            elif isinstance(t, ast.Starred):
                yield from _Module._flat([t.value])
            else:
                yield t

    def _write_target(self, target, node, add) -> None:
        if isinstance(target, ast.Attribute):
            parts = _chain(target)
            if parts is None or parts[0] not in ("self", "cls"):
                key = self.resolve(target, node)
                if key.split(".")[0] in ("self", "cls"):
                    return                          # an alias of self: the object's own state
                add("loader" if key.startswith("sys.") else "write", key, node)
        elif isinstance(target, ast.Subscript) and self.resolve(target.value, node) in (
                "sys.modules", "sys.meta_path", "sys.path_hooks"):
            add("loader", self.resolve(target.value, node), node)

    def _call(self, node: ast.Call, add) -> None:
        func = node.func
        if isinstance(func, ast.Attribute) and self.resolve(func.value, node) in (
                "sys.meta_path", "sys.path_hooks", "sys.modules") \
                and func.attr in ("insert", "append", "extend", "remove", "pop", "update",
                                  "setdefault"):
            add("loader", self.resolve(func.value, node), node)
            return
        if not isinstance(func, ast.Name):
            return
        if func.id in self.helpers:
            index = self.helpers[func.id]
            if len(node.args) > index:
                target = self.resolve(node.args[index], node)
                for kw in node.keywords:
                    add("write", f"{target}.{kw.arg if kw.arg else '<**>'}", node)
            return
        if func.id in ("setattr", "delattr", "getattr", "hasattr") and len(node.args) >= 2:
            name = self._const(node.args[1])
            if func.id in ("setattr", "delattr"):
                fn = self._function_of(node)
                params = [a.arg for a in fn.args.posonlyargs + fn.args.args] if fn else []
                if name is None and isinstance(node.args[0], ast.Name) and node.args[0].id in params \
                        and fn.name in self.helpers:
                    return                          # the helper itself: its callers are the findings
                shown = name if name is not None else f"<{ast.unparse(node.args[1])}>"
                add("write", f"{self.resolve(node.args[0], node)}.{shown}", node)
            elif name is not None and _private(name):
                self._private(node.args[0], name, node, add)

    def _private(self, owner, attr: str, node, add) -> None:
        if _is_super(owner):                        # the engine base's own method
            bases = self.engine_bases(self._class_of(node) or ast.ClassDef(name="", bases=[]))
            add("private", f"{bases[0] if bases else 'super()'}.{attr}", node)
            return
        if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
            cls = self._class_of(node)
            bases = self.engine_bases(cls) if cls is not None else []
            if bases and attr not in self._defined_in(cls):
                add("private", f"{bases[0]}.{attr}", node)
            return
        if attr in self.own_private:
            return
        add("private", f"{self.resolve(owner, node)}.{attr}", node)

    @staticmethod
    def _defined_in(cls: ast.ClassDef) -> set[str]:
        names = set()
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names.update(t.id for t in _Module._flat(targets) if isinstance(t, ast.Name))
            if isinstance(node, ast.FunctionDef) and node.name == "__init__":
                for sub in ast.walk(node):
                    if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store) \
                            and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                        names.add(sub.attr)
        return names

    def _class(self, cls: ast.ClassDef, add) -> None:
        loaders = [self.resolve(b, cls).rsplit(".", 1)[-1] for b in cls.bases
                   if self._imported_from(b, ("importlib",))]
        if loaders:
            add("loader", f"{cls.name}({', '.join(loaders)})", cls)
        bases = self.engine_bases(cls)
        if not bases:
            return
        methods = []
        for node in cls.body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if node.name.startswith("__") and node.name != "__init__":
                continue
            if _private(node.name):
                if node.name in self.referenced:
                    continue                        # a helper vattn calls itself
                add("private", f"{bases[0]}.{node.name}", node)   # an engine hook overridden
            methods.append(node.name)
        add("subclass", f"{cls.name}({', '.join(bases)})", cls, methods)


def adapter_modules() -> list[tuple[str, Path]]:
    out = []
    for engine_dir in sorted(p for p in ADAPTERS.iterdir() if p.is_dir() and p.name != "__pycache__"):
        for path in sorted(engine_dir.rglob("*.py")):
            if path.relative_to(engine_dir).as_posix() not in HARNESS.get(engine_dir.name, ()):
                out.append((engine_dir.name, path))
    return out


def scan() -> list[Finding]:
    own = _own_private_names()
    return [f for engine, path in adapter_modules() for f in _Module(engine, path, own).findings()]


# -- the doc -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Row:
    kind: str
    file: str
    keys: tuple
    path: str
    text: str
    line: int


def _cells(line: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def doc_tables(text: str) -> list[tuple[list[str], list[tuple[int, list[str], str]]]]:
    """Every markdown table: (header cells lower-cased, [(line number, cells, line)])."""
    tables, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        if lines[i].lstrip().startswith("|") and i + 1 < len(lines) \
                and re.fullmatch(r"\s*\|[\s:|-]+\|\s*", lines[i + 1]):
            header, rows = [c.lower() for c in _cells(lines[i])], []
            i += 2
            while i < len(lines) and lines[i].lstrip().startswith("|"):
                rows.append((i + 1, _cells(lines[i]), lines[i]))
                i += 1
            tables.append((header, rows))
        else:
            i += 1
    return tables


def doc_rows(text: str) -> list[Row]:
    rows = []
    for header, body in doc_tables(text):
        if not {"kind", "file", "code"} <= set(header):
            continue
        at = {name: header.index(name) for name in header}
        for line, cells, raw in body:
            cells += [""] * (len(header) - len(cells))
            keys = re.findall(r"`([^`]+)`", cells[at["code"]])
            rows.append(Row(kind=cells[at["kind"]].strip("`* "), file=cells[at["file"]].strip("` "),
                            keys=tuple(k.replace("\\|", "|") for k in keys),
                            path=cells[at["path"]].strip("` ") if "path" in at else "",
                            text=raw, line=line))
    return rows


def engine_of(row: Row) -> str | None:
    """Summary group of a touch-point row: ``<engine>`` or ``<engine>:<path>``."""
    parts = row.file.split("/")
    if len(parts) < 3 or parts[0] != "adapters":
        return None
    return f"{parts[1]}:{row.path}" if row.path in ("cpu", "gpu") else parts[1]


def _file_tokens(path: Path) -> set[str]:
    if path.suffix != ".py":
        return set()
    tokens = set()
    for node in ast.walk(ast.parse(path.read_text())):
        for field in ("id", "attr", "name", "arg", "asname", "module"):
            value = getattr(node, field, None)
            if isinstance(value, str):
                tokens.update(_IDENT.findall(value))
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            tokens.update(_IDENT.findall(node.value))
    return tokens


# -- the tests ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def findings() -> list[Finding]:
    return scan()


@pytest.fixture(scope="module")
def rows() -> list[Row]:
    return doc_rows(DOC.read_text())


def _rows_by_file(rows):
    by_file = defaultdict(list)
    for row in rows:
        by_file[row.file].append(row)
    return by_file


def test_every_adapter_directory_is_an_engine():
    unknown = sorted({p.parent.name for _, p in adapter_modules()} - set(ENGINE_PACKAGES)
                     - {"adapters"})
    assert not unknown, f"adapters/{unknown}: add the engine's package to ENGINE_PACKAGES"


def test_rows_are_well_formed(rows):
    assert rows, f"{DOC} has no table with kind / file / code columns"
    bad = [f"{DOC.name}:{r.line}: kind {r.kind!r} (one of {sorted(KINDS)})"
           for r in rows if r.kind not in KINDS]
    bad += [f"{DOC.name}:{r.line}: no `code` key" for r in rows if not r.keys]
    bad += [f"{DOC.name}:{r.line}: {r.file} does not exist"
            for r in rows if not (ROOT / r.file).is_file()]
    assert not bad, "\n".join(bad)


def test_every_touch_point_is_documented(findings, rows):
    by_file = _rows_by_file(rows)
    missing = []
    for f in findings:
        candidates = by_file.get(f.file, [])
        if f.category == "import":
            if not any(f.names[0] in _IDENT.findall(k) for r in candidates for k in r.keys):
                missing.append(f"{f.file}:{f.line}: import {f.key} (no row of this file names "
                               f"{f.names[0]!r} in its code cell)")
            continue
        listed = [r for r in candidates if f.key in r.keys]
        if not listed:
            missing.append(f"{f.file}:{f.line}: {f.category} `{f.key}` is not in {DOC.name}")
        elif not any(r.kind in FITS[f.category] for r in listed):
            missing.append(f"{f.file}:{f.line}: {f.category} `{f.key}` is listed as "
                           f"{[r.kind for r in listed]}, expected one of {sorted(FITS[f.category])}")
    assert not missing, "undocumented touch points:\n" + "\n".join(missing)


def test_subclass_rows_name_every_method(findings, rows):
    by_file = _rows_by_file(rows)
    missing = []
    for f in findings:
        if f.category != "subclass":
            continue
        for row in (r for r in by_file.get(f.file, []) if f.key in r.keys):
            absent = [m for m in f.names if not re.search(rf"\b{re.escape(m)}\b", row.text)]
            if absent:
                missing.append(f"{DOC.name}:{row.line}: `{f.key}` does not name {absent}")
    assert not missing, "\n".join(missing)


def test_every_documented_touch_point_exists(findings, rows):
    found = defaultdict(set)
    for f in findings:
        found[f.file].add(f.key)
    stale = []
    for row in rows:
        path = ROOT / row.file
        if not path.is_file():
            continue                                # reported by test_rows_are_well_formed
        if row.kind in MECHANICAL:
            stale += [f"{DOC.name}:{row.line}: `{k}` ({row.kind}) is no longer in {row.file}"
                      for k in row.keys if k not in found[row.file]]
        elif path.suffix == ".py":
            tokens = _file_tokens(path)
            for k in row.keys:
                gone = sorted(set(_IDENT.findall(k)) - tokens)
                if gone:
                    stale.append(f"{DOC.name}:{row.line}: `{k}` ({row.kind}) names {gone} that "
                                 f"{row.file} no longer has")
        else:
            text = path.read_text()
            stale += [f"{DOC.name}:{row.line}: `{k}` is not in {row.file}"
                      for k in row.keys if k not in text]
    assert not stale, "documented touch points that no longer exist:\n" + "\n".join(stale)


def test_summary_counts_match_the_rows(rows):
    counts = defaultdict(Counter)
    for row in rows:
        group = engine_of(row)
        if group is not None and row.kind in TOUCH_KINDS:
            counts[group][row.kind] += 1
            counts["all"][row.kind] += 1
    summary = [(header, body) for header, body in doc_tables(DOC.read_text())
               if header and header[0] == "engine" and "total" in header]
    assert len(summary) == 1, "the doc needs one summary table: header 'engine', ..., 'total'"
    header, body = summary[0]
    wrong, seen = [], set()
    for line, cells, _ in body:
        group = re.findall(r"`([^`]+)`", cells[0])
        if not group:
            continue
        group = group[0]
        seen.add(group)
        for kind, cell in zip(header[1:], cells[1:]):
            want = sum(counts[group].values()) if kind == "total" else counts[group][kind]
            if cell.strip("* ") != str(want):
                wrong.append(f"{DOC.name}:{line}: {group} {kind} says {cell}, the rows give {want}")
    wrong += [f"summary has no row for `{g}`" for g in sorted(set(counts) - seen)]
    assert not wrong, "\n".join(wrong)


def test_the_scan_sees_a_new_patch():
    """The detector itself: a monkeypatch, a setattr, a helper, a private read, a subclass."""
    source = (
        "import contextlib\n"
        "from vllm.v1.worker import gpu_model_runner as gmr\n"
        "from vllm.v1.worker.gpu_model_runner import GPUModelRunner\n"
        "def _swap(module, **names):\n"
        "    for name, value in names.items():\n"
        "        setattr(module, name, value)\n"
        "def install():\n"
        "    runner = gmr.GPUModelRunner\n"
        "    runner.execute_model = None\n"
        "    setattr(GPUModelRunner, 'flag', True)\n"
        "    _swap(gmr, BlockTable=None)\n"
        "    return runner._private_state\n"
        "class Mine(GPUModelRunner):\n"
        "    def __init__(self):\n"
        "        self._mine = 1\n"
        "    def _engine_hook(self):\n"
        "        return self._mine + self._theirs\n")
    module = _Module("vllm", ROOT / "adapters" / "vllm" / "fake.py", set(), source=source)
    got = {(f.category, f.key) for f in module.findings()}
    assert {("write", "gpu_model_runner.GPUModelRunner.execute_model"),
            ("write", "GPUModelRunner.flag"), ("write", "gpu_model_runner.BlockTable"),
            ("private", "gpu_model_runner.GPUModelRunner._private_state"),
            ("subclass", "Mine(GPUModelRunner)"), ("private", "GPUModelRunner._engine_hook"),
            ("private", "GPUModelRunner._theirs")} <= got, got
    assert ("private", "GPUModelRunner._mine") not in got
