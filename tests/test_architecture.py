"""The package's import graph follows the stage table in docs/architecture.md: no arrow runs back up."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "eogym_sft"
ENTRY = "entry points"


def stage_table() -> tuple[dict[str, str], dict[str, set[str]]]:
    """``{module or subpackage: stage}`` and ``{stage: stages it may import}`` from the doc's table."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    owner, allowed = {}, {}
    table = text.split("| stage | what lives there | may import |", 1)[1].split("\n\n", 1)[0]
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or cells[0].startswith("---"):
            continue
        head, _, imports = cells
        name = head.split(":")[0].strip("` ")
        members = re.findall(r"`([a-z_]+)`", head.split(":", 1)[1]) if ":" in head else [name]
        for member in members:
            owner[member] = name
        allowed[name] = {"*"} if imports == "every stage" else set(re.findall(r"`([a-z_ ]+)`", imports))
    return owner, allowed


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, root: Path = ROOT) -> set[str]:
    """Every ``eogym_sft`` module a file under ``root`` imports, at module level or inside functions."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:  # ``from .. import net`` imports the module eogym_sft.net
                sub = f"{target}.{alias.name}"
                as_file = root.joinpath(*sub.split("."))
                found.add(sub if as_file.with_suffix(".py").exists() or as_file.is_dir() else target)
    return {m for m in found if m == "eogym_sft" or m.startswith("eogym_sft.")}


def stage_of(module: str, owner: dict[str, str]) -> str | None:
    parts = module.split(".")
    return owner.get(parts[1]) if len(parts) > 1 else None  # None: the package's __init__


def test_the_table_names_every_module_of_the_package():
    owner, _ = stage_table()
    top_level = {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    top_level |= {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert top_level <= set(owner), f"not in docs/architecture.md's stage table: {sorted(top_level - set(owner))}"


def test_no_import_runs_against_the_stage_table():
    owner, allowed = stage_table()
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = stage_of(module_name(path), owner)
        for target in imported_modules(path):
            dest = stage_of(target, owner)
            if source is None:  # the package __init__: __version__, and EOGymCollator handed out lazily
                ok = dest in (None, "data")
            else:
                ok = dest is None or dest == source or "*" in allowed[source] or dest in allowed[source]
            if not ok:
                wrong.append(f"{path.relative_to(ROOT)} ({source}) imports {target} ({dest})")
    assert not wrong, "imports the stage table does not allow:\n" + "\n".join(wrong)


def test_the_checker_sees_an_arrow_back_up_inside_a_function(tmp_path):
    owner, allowed = stage_table()
    bad = tmp_path / "eogym_sft" / "models" / "x.py"
    bad.parent.mkdir(parents=True)
    bad.write_text("def f():\n    from ..training import grpo\n")
    assert imported_modules(bad, tmp_path) == {"eogym_sft.training"}
    assert stage_of("eogym_sft.training", owner) not in allowed[owner["models"]]


MAX_MODULE_LINES = 500  # a module has one job: past this it has taken on a second


def test_no_module_of_the_package_passes_500_lines():
    lengths = {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines()) for p in sorted(PACKAGE.rglob("*.py"))}
    long = {path: n for path, n in lengths.items() if n > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split each by job): {long}"


MAX_FUNCTION_LINES = 60  # a function is a few named steps: past this, name the steps and call them


def long_functions(path: Path, limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
    """``{qualified name: lines}`` of the functions and methods in ``path`` (nested ones included) longer than
    ``limit``, counted from the ``def`` line to the last line of the body, docstring included."""
    found = {}

    def visit(node, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = f"{prefix}{getattr(child, 'name', '')}"
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = child.end_lineno - child.lineno + 1
                if lines > limit:
                    found[name] = lines
                visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text()), "")
    return found


def test_no_function_of_the_package_passes_60_lines():
    long = {f"{p.relative_to(ROOT).as_posix()}::{name}": n for p in sorted(PACKAGE.rglob("*.py"))
            for name, n in long_functions(p).items()}
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split each into named steps): {long}"


def test_the_length_check_counts_def_to_last_line_in_methods_and_nested_functions(tmp_path):
    def body(n: int, indent: int) -> str:
        return "".join(f"{' ' * indent}x{i} = {i}\n" for i in range(n))

    source = tmp_path / "m.py"
    source.write_text("def fits():\n" + body(59, 4)  # 60 lines: at the limit, not past it
                      + "class C:\n    def over(self):\n" + body(58, 8)
                      + "        def inner():\n" + body(60, 12))  # inner: 61 lines; over: 1 + 58 + 61
    assert long_functions(source) == {"C.over": 120, "C.over.inner": 61}
    assert long_functions(source, limit=120) == {}


def import_circle(graph: dict[str, set[str]]) -> list[str]:
    """One circle of ``graph`` (``{module: modules it imports}``) as ``[a, b, ..., a]``, or ``[]`` if it has none."""
    done: set[str] = set()
    for start in sorted(graph):
        path, on_path, todo = [], set(), [(start, iter(sorted(graph.get(start, ()))))]
        path.append(start)
        on_path.add(start)
        while todo:
            node, children = todo[-1]
            child = next(children, None)
            if child is None:
                todo.pop()
                path.pop()
                on_path.discard(node)
                done.add(node)
            elif child in on_path:
                return path[path.index(child):] + [child]
            elif child not in done:
                todo.append((child, iter(sorted(graph.get(child, ())))))
                path.append(child)
                on_path.add(child)
    return []


def test_no_import_circle_inside_the_package():
    graph = {module_name(p): imported_modules(p) - {module_name(p)} for p in PACKAGE.rglob("*.py")}
    circle = import_circle(graph)
    assert not circle, "an import circle (function-level imports included): " + " -> ".join(circle)


def test_the_circle_finder_finds_one():
    assert import_circle({"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}) == ["a", "b", "c", "a"]
    assert import_circle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def upstream_rows() -> list[list[str]]:
    """The cells of docs/architecture.md's table of upstream behaviour we rely on."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text.split("| behaviour | where we use it | the test that pins it |", 1)[1].split("\n\n", 1)[0]
    rows = [re.split(r"(?<!\\)\|", line.strip().strip("|")) for line in table.splitlines()[1:] if line.startswith("|")]
    return [[c.strip() for c in row] for row in rows]


def test_the_upstream_table_names_modules_and_tests_that_exist():
    missing = []
    for _, where, tests in upstream_rows():
        for path in re.findall(r"`([a-z_/]+\.py)`", where) + re.findall(r"`([a-z_/]+\.py) ", where):
            if not (PACKAGE / path).is_file() and not (ROOT / path).is_file():
                missing.append(path)
        current = None
        for file, name in re.findall(r"`(tests/[\w/]+\.py)?::(\w+)`", tests):
            current = file or current
            if current is None or f"def {name}(" not in (ROOT / current).read_text():
                missing.append(f"{current}::{name}")
    assert not missing, f"docs/architecture.md's upstream table names what is not there: {missing}"
