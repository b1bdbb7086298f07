"""Freeze ``functions.sql`` for the migration being written: ``python -m tooling.freeze_functions
<revision>`` copies worker/db/sql/functions.sql, byte for byte, to
migrations/sql/<revision>_functions.sql and prints the lines the migration holds::

    FUNCTIONS_SHA256 = "<the copy's sha256>"
    ...
    apply_frozen(op.execute, "<revision>")  # in upgrade()

A copy is the text its migration was released with: a revision with a frozen copy after it is
refused, and an existing copy is replaced only with ``--replace`` (while the migration is still
being written and functions.sql still changes).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

from alembic.script import ScriptDirectory

from orderly.worker.db.queries import FUNCTIONS_FILE
from orderly.worker.db.schema import alembic_config, frozen_functions_file


class FreezeError(ValueError):
    """The revision may not get a frozen copy (nothing is written)."""


def freeze(revision: str, target: Path | None = None, replace: bool = False) -> tuple[Path, str]:
    """Write functions.sql as the frozen copy of migration ``revision`` to ``target`` (default:
    its place among the migrations); its path and sha256."""
    script = ScriptDirectory.from_config(alembic_config(""))
    newest_first = [rev.revision for rev in script.walk_revisions()]
    if revision not in newest_first:
        raise FreezeError(f"{revision!r} is no migration")
    at = newest_first.index(revision)
    later = [rev for rev in newest_first[:at] if frozen_functions_file(rev).is_file()]
    if later:
        raise FreezeError(
            f"{later[-1]} after {revision} has a frozen copy: the newest functions.sql is its"
        )
    own = frozen_functions_file(revision)
    if own.is_file() and not replace:
        raise FreezeError(f"{revision} has a frozen copy ({own.name}): --replace to write it anew")
    text = FUNCTIONS_FILE.read_bytes()
    earlier = [rev for rev in newest_first[at + 1 :] if frozen_functions_file(rev).is_file()]
    if earlier and frozen_functions_file(earlier[0]).read_bytes() == text:
        raise FreezeError(
            f"functions.sql is the text {earlier[0]} froze: nothing new for {revision} to apply"
        )
    path = target or own
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text)
    return path, hashlib.sha256(text).hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tooling.freeze_functions",
        description="Freeze worker/db/sql/functions.sql for a new migration.",
    )
    parser.add_argument("revision", help="the migration's revision id, e.g. 0018")
    parser.add_argument(
        "--replace", action="store_true", help="write anew a copy the revision already has"
    )
    args = parser.parse_args(argv)
    try:
        path, digest = freeze(args.revision, replace=args.replace)
    except FreezeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {path} (sha256 {digest})")
    print(f"migration {args.revision} holds:")
    print(f'    FUNCTIONS_SHA256 = "{digest}"')
    print(f'    apply_frozen(op.execute, "{args.revision}")  # in upgrade()')
    return 0


if __name__ == "__main__":
    sys.exit(main())
