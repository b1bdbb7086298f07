"""What every settings section shares: the environment (and an optional ``.env``) it reads."""

from __future__ import annotations

from pydantic import AliasChoices
from pydantic_settings import BaseSettings, SettingsConfigDict

CONFIG = SettingsConfigDict(
    env_file=".env", env_file_encoding="utf-8", extra="ignore", populate_by_name=True
)


class Section(BaseSettings):
    model_config = CONFIG


def queue_var(name: str) -> AliasChoices:
    """The seed spells some variables AURA_QUEUE_QUEUE_MANAGER_*; both spellings are read."""
    return AliasChoices(f"AURA_QUEUE_MANAGER_{name}", f"AURA_QUEUE_QUEUE_MANAGER_{name}")
