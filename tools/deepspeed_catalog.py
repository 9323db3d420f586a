"""Generate engine/integrations/deepspeed_catalog.json: every public module path and top-level
name of a DeepSpeed release, read from the release's own source files (never imported).

    pip download deepspeed==0.19.8 --no-deps -d /tmp/ds
    python tools/deepspeed_catalog.py /tmp/ds/deepspeed-0.19.8.tar.gz

The argument is DeepSpeed's sdist (.tar.gz), a wheel (.whl) or an unpacked directory holding a
`deepspeed/` package. Each .py file under deepspeed/ whose directories are all regular packages
(they have an __init__.py) is a module path; a file is parsed with `ast` and never run. The
doorway (zero.integrations.deepspeed) serves every path and name listed: the names zero implements
map to zero's objects, the others are placeholders that fail when used.

A module's public names are what a program can import from it: top-level functions, classes
and assignments (inside `if` / `try` / `with` blocks too, but not under `if TYPE_CHECKING:` or
`if __name__ == "__main__":`), names imported from another DeepSpeed
module (`from deepspeed.utils import logger`), the names of `from deepspeed.x import *`, and
`__all__`; names starting with "_" are left out, except assigned dunders (`__version__`). Child
module paths are not names (they are paths). Each name is in exactly one of:
- "imports": name -> "deepspeed.module:name" for a name imported from another DeepSpeed
  module, or -> "deepspeed.module" for a module imported under a name (`from .runtime import
  zero`), so the doorway serves one object under both names;
- "constants": name -> value for a name bound once to a None, bool, int, finite float or short
  one-line str literal (DeepSpeed's config key names and defaults), served as it is;
- "defined": every other name (functions, classes, computed values).
"package" is true for an __init__.py.
"""

import argparse
import ast
import json
import math
import os
import sys
import tarfile
import zipfile

DEFAULT_OUTPUT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    "engine",
    "integrations",
    "deepspeed_catalog.json",
)


def read_sources(archive: str) -> tuple[dict[str, str], str]:
    """{path relative to the package root ("deepspeed/x.py"): text} and the release version."""
    files: dict[str, bytes] = {}
    if os.path.isdir(archive):
        for root, _, names in os.walk(archive):
            for name in names:
                full = os.path.join(root, name)
                with open(full, "rb") as handle:
                    files[os.path.relpath(full, archive)] = handle.read()
    elif archive.endswith(".whl"):
        with zipfile.ZipFile(archive) as wheel:
            files = {n: wheel.read(n) for n in wheel.namelist() if n.endswith(".py")}
    else:
        with tarfile.open(archive) as sdist:
            for member in sdist.getmembers():
                if member.isfile() and member.name.endswith(".py"):
                    files[member.name] = sdist.extractfile(member).read()
    sources = {}
    for name, raw in files.items():
        parts = name.replace(os.sep, "/").split("/")
        if "deepspeed" not in parts or not name.endswith(".py"):
            continue
        # An sdist nests the package one level down (deepspeed-0.19.8/deepspeed/...).
        rel = "/".join(parts[parts.index("deepspeed") :])
        sources[rel] = raw.decode("utf-8")
    version = _version(sources)
    return sources, version


def _version(sources: dict[str, str]) -> str:
    text = sources.get("deepspeed/git_version_info_installed.py", "")
    for node in ast.parse(text).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "version":
            return ast.literal_eval(node.value).strip()
    return "unknown"


def module_paths(sources: dict[str, str]) -> dict[str, str]:
    """module path -> file, for files inside regular packages only."""
    packages = {os.path.dirname(f) for f in sources if f.endswith("/__init__.py")}
    paths = {}
    for file in sorted(sources):
        directory = os.path.dirname(file)
        parts = directory.split("/")
        if not all("/".join(parts[: i + 1]) in packages for i in range(len(parts))):
            continue
        stem = os.path.basename(file)[: -len(".py")]
        path = directory.replace("/", ".") + ("" if stem == "__init__" else "." + stem)
        if all(part.isidentifier() for part in path.split(".")):
            paths[path] = file
    return paths


def _absolute(module: str | None, level: int, path: str, package: bool) -> str | None:
    """The module a from-import names, absolute; None outside deepspeed."""
    if level:
        base = path.split(".")
        base = base if package else base[:-1]
        base = base[: len(base) - (level - 1)]
        module = ".".join(base + ([module] if module else []))
    return module if module and module.partition(".")[0] == "deepspeed" else None


def _statements(body):
    """Top-level statements, looking inside if / try / with blocks (not into functions)."""
    for node in body:
        yield node
        if isinstance(node, ast.If) and _never_at_import(node.test):
            yield from _statements(node.orelse)
        elif isinstance(node, (ast.If, ast.With, ast.For, ast.While)):
            yield from _statements(node.body)
            yield from _statements(getattr(node, "orelse", []))
        elif isinstance(node, ast.Try):
            yield from _statements(node.body)
            for handler in node.handlers:
                yield from _statements(handler.body)
            yield from _statements(node.orelse)
            yield from _statements(node.finalbody)


def _never_at_import(test) -> bool:
    """`if TYPE_CHECKING:` and `if __name__ == "__main__":` bodies bind nothing an import sees."""
    text = ast.unparse(test)
    return text in ("TYPE_CHECKING", "typing.TYPE_CHECKING") or text in (
        "__name__ == '__main__'",
        '__name__ == "__main__"',
    )


def _targets(target):
    if isinstance(target, ast.Name):
        yield target.id
    elif isinstance(target, (ast.Tuple, ast.List)):
        for element in target.elts:
            yield from _targets(element)


_MAX_CONSTANT_TEXT = 80


def _literal(node):
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None, False
    if isinstance(value, str):
        # Key names and short values; long texts (messages, formats) are not API.
        return value, len(value) <= _MAX_CONSTANT_TEXT and "\n" not in value
    if value is None or isinstance(value, (bool, int)):
        return value, True
    if isinstance(value, float) and math.isfinite(value):
        return value, True
    return None, False


def _public(name: str) -> bool:
    return not name.startswith("_") or (
        name.startswith("__") and name.endswith("__") and name != "__all__"
    )


def scan(path: str, text: str, package: bool) -> dict:
    """One module's defined names, imports, star imports, literal constants and __all__."""
    tree = ast.parse(text)
    defined: set[str] = set()
    imports: dict[str, str] = {}
    stars: list[str] = []
    constants: dict = {}
    assigned: dict[str, int] = {}
    listed: list[str] = []
    for node in _statements(tree.body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if not node.name.startswith("__"):  # a module's own __getattr__ is no name
                defined.add(node.name)
            assigned[node.name] = assigned.get(node.name, 0) + 2
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for name in _targets(target):
                    defined.add(name)
                    assigned[name] = assigned.get(name, 0) + 1
                    value, ok = _literal(node.value) if node.value is not None else (None, False)
                    if ok and isinstance(target, ast.Name):
                        constants[name] = value
                    if name == "__all__" and isinstance(node.value, (ast.List, ast.Tuple)):
                        listed = [e.value for e in node.value.elts if isinstance(e, ast.Constant)]
        elif isinstance(node, ast.Import):
            for alias in node.names:  # binds a name, so it is no constant
                bound = alias.asname or alias.name.partition(".")[0]
                assigned[bound] = assigned.get(bound, 0) + 1
        elif isinstance(node, ast.ImportFrom):
            origin = _absolute(node.module, node.level, path, package)
            for alias in node.names:
                bound = alias.asname or alias.name
                assigned[bound] = assigned.get(bound, 0) + 1
            if origin is None:
                continue
            for alias in node.names:
                if alias.name == "*":
                    stars.append(origin)
                else:
                    imports[alias.asname or alias.name] = f"{origin}:{alias.name}"
    # A constant is a name bound exactly once, to a literal.
    constants = {n: v for n, v in constants.items() if assigned.get(n) == 1 and _public(n)}
    return {
        "defined": {n for n in defined if _public(n)},
        "imports": {n: o for n, o in imports.items() if _public(n)},
        "stars": stars,
        "constants": constants,
        "all": [n for n in listed if isinstance(n, str)],
    }


def build(sources: dict[str, str]) -> dict[str, dict]:
    """module path -> {"package", "names", "imports", "constants"} for every module path."""
    paths = module_paths(sources)
    scanned = {p: scan(p, sources[f], f.endswith("__init__.py")) for p, f in paths.items()}
    names = {p: s["defined"] | set(s["imports"]) | set(s["all"]) for p, s in scanned.items()}
    # Star imports, to a fixed point (a star of a star).
    changed = True
    while changed:
        changed = False
        for path, info in scanned.items():
            for origin in info["stars"]:
                if origin not in names:
                    continue
                exported = set(scanned[origin]["all"]) or names[origin]
                for name in exported - names[path]:
                    names[path].add(name)
                    info["imports"].setdefault(name, f"{origin}:{name}")
                    changed = True
    catalog = {}
    for path in sorted(paths):
        info = scanned[path]
        imports = {}
        for name, origin in sorted(info["imports"].items()):
            module, _, attribute = origin.partition(":")
            submodule = f"{module}.{attribute}"
            if submodule in paths:
                if submodule != f"{path}.{name}":  # a child is served as a path anyway
                    imports[name] = submodule
            else:
                imports[name] = origin
        constants = info["constants"]
        children = {c.rpartition(".")[2] for c in _children(path, paths)}
        catalog[path] = {
            "package": paths[path].endswith("__init__.py"),
            "defined": sorted(names[path] - children - set(imports) - set(constants)),
            "imports": {n: o for n, o in imports.items() if n not in children},
            "constants": dict(sorted(constants.items())),
        }
    return catalog


def _children(path: str, paths) -> list[str]:
    return [p for p in paths if p.rpartition(".")[0] == path]


def dumps(catalog: dict) -> str:
    """JSON with one line per module path, so a new release's changes read as a line diff."""
    head = {k: v for k, v in catalog.items() if k != "modules"}
    lines = [json.dumps(head)[:-1] + ', "modules": {']
    modules = catalog["modules"]
    for i, (path, entry) in enumerate(modules.items()):
        comma = "," if i + 1 < len(modules) else ""
        lines.append(f"{json.dumps(path)}: {json.dumps(entry, ensure_ascii=True)}{comma}")
    return "\n".join(lines) + "\n}}\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("archive", help="DeepSpeed's sdist (.tar.gz), wheel (.whl) or directory")
    parser.add_argument("--output", default=DEFAULT_OUTPUT, help="the JSON file to write")
    args = parser.parse_args(argv)
    sources, version = read_sources(args.archive)
    if "deepspeed/__init__.py" not in sources:
        print(f"{args.archive}: no deepspeed/__init__.py inside", file=sys.stderr)
        return 1
    catalog = {
        "deepspeed_version": version,
        "generated_by": "tools/deepspeed_catalog.py",
        "modules": build(sources),
    }
    with open(args.output, "w") as handle:
        handle.write(dumps(catalog))
    modules = catalog["modules"]
    count = sum(
        len(m["defined"]) + len(m["imports"]) + len(m["constants"]) for m in modules.values()
    )
    print(f"DeepSpeed {version}: {len(modules)} module paths, {count} names -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
