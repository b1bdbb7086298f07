"""The code's shape: product and tooling apart, mechanisms free of the faces' frameworks, each
mechanism written once, modules of one concern."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("worker", "beat", "models", "api", "reports")
# The faces: the only modules of worker/ that may import Celery.
FACES = {"worker/celery.py", "worker/tasks.py"}
FRAMEWORKS = ("celery", "kombu", "fastapi", "starlette", "pyspark", "py4j", "flower")


def _modules(*packages: str) -> list[Path]:
    return sorted(p for pkg in packages for p in (ROOT / pkg).rglob("*.py"))


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
    return found


def test_no_product_module_imports_the_tooling_package() -> None:
    offenders = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in _modules(*PRODUCT)
        for name in _imports(path)
        if name == "tooling" or name.startswith("tooling.")
    ]
    assert offenders == []


def test_every_import_of_orderly_goes_through_the_orderly_package() -> None:
    """The root folders are importable in a checkout under their bare names too (the working
    directory is on the path), but an installed orderly has only ``orderly``: an import of
    ``worker`` or ``api`` would work here and fail for every user."""
    bare = {*PRODUCT, "migrations", "orderly_client", "orderly_migrations"}
    offenders = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in _modules(*PRODUCT, "migrations", "orderly", "tooling", "tests", "benchmarks")
        for name in _imports(path)
        if name.split(".")[0] in bare
    ]
    assert offenders == []


def test_mechanism_modules_import_no_celery_fastapi_or_spark() -> None:
    offenders = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in _modules("worker", "models")
        if str(path.relative_to(ROOT)) not in FACES
        for name in _imports(path)
        if name.split(".")[0] in FRAMEWORKS
    ]
    assert offenders == []


def test_one_backoff_computation() -> None:
    """deliveryDelay * multiplier ^ attempt is computed in worker/core/retry.py alone."""
    power = re.compile(r"\*\*\s*\(?\s*\w*attempt|multiplier\s*\*\*")
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in _modules(*PRODUCT, "tooling")
        for n, line in enumerate(path.read_text().splitlines(), start=1)
        if power.search(line)
    ]
    assert found == [f"worker/core/retry.py:{_line_of('worker/core/retry.py', power)}"]


def _line_of(relative: str, pattern: re.Pattern[str]) -> int:
    lines = (ROOT / relative).read_text().splitlines()
    return next(n for n, line in enumerate(lines, start=1) if pattern.search(line))


_SQL = re.compile(r"^\s*(SELECT|INSERT INTO|UPDATE \w+|DELETE FROM|WITH \w+ AS|SET LOCAL)\b")
# Query-building from SQLAlchemy: the store's named queries replace it.
_BUILDERS = {"select", "insert", "update", "delete", "text", "Session"}


def test_every_sql_statement_is_a_named_query_of_the_store() -> None:
    """Product modules hold no SQL and build none: they run named queries (worker/db/sql).
    The reports' Spark aggregates and their SQL twins are the reports' own definitions."""
    found = []
    for path in _modules("worker", "beat", "models", "api"):
        relative = path.relative_to(ROOT)
        if relative.parts[:2] == ("worker", "db"):
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and _SQL.match(node.value)
            ):
                found.append(f"{relative}:{node.lineno} {node.value.strip()[:40]!r}")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sqlalchemy"):
                built = {alias.name for alias in node.names} & _BUILDERS
                if built and relative.parts[0] != "models":
                    found.append(f"{relative}:{node.lineno} imports {sorted(built)}")
    assert found == []


def test_product_modules_stay_small() -> None:
    long = {
        str(path.relative_to(ROOT)): size
        for path in _modules(*PRODUCT)
        if (size := len(path.read_text().splitlines())) > 520
    }
    assert long == {}
