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


# The Celery app module, and the one function that may import it: the runtime's broker
# factory, so that a process that sends nothing (``orderly --help``) never imports Celery.
CELERY_APP = "orderly.worker.celery"
CELERY_APP_FACTORY = ("worker/runtime.py", "_celery_broker")


def _names_celery_app(node: ast.AST) -> bool:
    """An import of the Celery app module, or its name given to ``importlib``."""
    if isinstance(node, ast.Import):
        return any(a.name == CELERY_APP or a.name.startswith(f"{CELERY_APP}.") for a in node.names)
    if isinstance(node, ast.ImportFrom) and not node.level:
        module = node.module or ""
        return module == CELERY_APP or (
            module == "orderly.worker" and any(a.name == "celery" for a in node.names)
        )
    return isinstance(node, ast.Constant) and node.value == CELERY_APP


def celery_app_imports_in_functions(source: str, filename: str) -> list[tuple[int, str]]:
    """(line, function) of each import of the Celery app module inside a function body."""
    found = []

    def visit(node: ast.AST, function: str | None) -> None:
        if function is not None and _names_celery_app(node):
            found.append((getattr(node, "lineno", 0), function))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            function = node.name
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(ast.parse(source, filename), None)
    return found


def test_no_function_imports_the_celery_app_module() -> None:
    """The broker is one object on the runtime (``get_runtime().broker``, worker/broker.py):
    a function takes it from there, never from a lazy import of the Celery app module. The
    runtime's broker factory is the one place that imports it on first use."""
    offenders = [
        f"{relative}:{line} in {function}()"
        for path in _modules(*PRODUCT)
        for line, function in celery_app_imports_in_functions(path.read_text(), str(path))
        if ((relative := str(path.relative_to(ROOT))), function) != CELERY_APP_FACTORY
    ]
    assert offenders == []


def test_the_celery_app_rule_finds_an_import_in_a_function() -> None:
    """The rule above can fail: each form of the import, at any depth of nesting."""
    source = """
import orderly.worker.celery

def module_level_is_fine() -> None: ...

def face() -> None:
    from orderly.worker.celery import enqueue_processing

async def route() -> None:
    def inner() -> None:
        from orderly.worker import celery

class Face:
    def method(self) -> None:
        import orderly.worker.celery as c
        importlib.import_module("orderly.worker.celery")
"""
    assert celery_app_imports_in_functions(source, "probe.py") == [
        (7, "face"),
        (11, "inner"),
        (15, "method"),
        (16, "method"),
    ]


def test_the_api_reaches_the_broker_through_the_runtime() -> None:
    """The HTTP API, the console and the CLI import no Celery app module, not even at the top:
    they send through ``get_runtime().broker``, and ``orderly --help`` stays free of Celery."""
    offenders = [
        f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
        for path in _modules("api")
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if _names_celery_app(node)
        or (isinstance(node, ast.Import | ast.ImportFrom) and _imports_celery(node))
    ]
    assert offenders == []


def _imports_celery(node: ast.Import | ast.ImportFrom) -> bool:
    if isinstance(node, ast.Import):
        return any(a.name.split(".")[0] == "celery" for a in node.names)
    return not node.level and (node.module or "").split(".")[0] == "celery"


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


# A script's KEYS, ARGV and reply are read in one place: its typed function in worker/lua/.
LUA_CALLS = ("worker/lua/", "worker/core/scripts.py")


def _scripts_run(tree: ast.AST) -> list[int]:
    """Lines that name a Lua script to run it (``Call("advance", ...)``,
    ``scripts.run("advance", ...)``, ``source("rate_take")``), or that run a script through
    a ``Scripts`` (``ctx.scripts.run(...)``, ``self._scripts.run_each(...)``)."""
    from orderly.worker.core.scripts import SCRIPT_NAMES

    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        first = node.args[0] if node.args else None
        func = node.func
        runner = getattr(func, "attr", None) or getattr(func, "id", None)
        named = (
            runner in ("Call", "run", "run_each", "source")
            and isinstance(first, ast.Constant)
            and first.value in SCRIPT_NAMES
        )
        through = (
            isinstance(func, ast.Attribute)
            and func.attr in ("run", "run_each")
            and (getattr(func.value, "attr", None) or getattr(func.value, "id", None))
            in ("scripts", "_scripts")
        )
        if named or through:
            found.append(node.lineno)
    return found


def test_only_the_lua_calls_name_a_script_to_run() -> None:
    offenders = [
        f"{relative}:{line}"
        for path in _modules(*PRODUCT, "tooling")
        if not (relative := str(path.relative_to(ROOT))).startswith(LUA_CALLS)
        for line in _scripts_run(ast.parse(path.read_text(), relative))
    ]
    assert offenders == []


def test_the_lua_calls_rule_sees_a_script_run_by_name() -> None:
    source = (
        'ctx.scripts.run("advance", [k], [1])\n'
        "self._scripts.run_each(calls)\n"
        'Call("wake", keys=(mark,), args=(1,))\n'
        'conn.run("conv_ok", ids, None)\n'  # a named query, not a script
        "lua.wake(scripts, mark=mark, ttl_ms=1)\n"
        'app.command("ack")\n'  # a command that shares a script's name
        'client.register_script(source("rate_take"))\n'
    )
    assert _scripts_run(ast.parse(source)) == [1, 2, 3, 7]
