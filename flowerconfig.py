"""Flower's options from orderly's settings: basic auth, address and port.

``celery -A worker flower`` reads ``flowerconfig.py`` from its working directory (run it from
the repository's root, or pass ``--conf=/path/to/flowerconfig.py``). Every module-level name
that matches a Flower option becomes that option, so helpers here start with an underscore.
"""

from __future__ import annotations

from worker.settings import get_settings

_settings = get_settings()
_password = _settings.flower_password.get_secret_value()
if not _password:
    # Flower without basic auth would let anyone revoke tasks and shut workers down.
    raise SystemExit(
        "orderly: Flower refuses to start without a password: set ORDERLY_FLOWER_PASSWORD "
        f"(the user is ORDERLY_FLOWER_USER, now {_settings.flower_user!r})"
    )

basic_auth: list[str] = [f"{_settings.flower_user}:{_password}"]
address: str = _settings.flower_address
port: int = _settings.flower_port
