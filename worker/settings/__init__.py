"""The one validated settings object, read from the environment (and an optional ``.env``).

Names, units and defaults of the ``AURA_QUEUE_MANAGER_*`` variables are those of the
ordered-response seed; orderly's own variables start with ``ORDERLY_``. Each section is a
module of its own; :class:`Settings` is all of them, checked together.
"""

from __future__ import annotations

from functools import lru_cache

from pydantic import model_validator

from orderly.models.keys import BridgeKeys
from orderly.worker.settings._base import CONFIG
from orderly.worker.settings.conversations import ConversationSettings
from orderly.worker.settings.dashboard import DashboardSettings
from orderly.worker.settings.http import HttpSettings
from orderly.worker.settings.pubsub import PubSubSettings
from orderly.worker.settings.ratelimits import RateLimitSettings
from orderly.worker.settings.reports import ReportSettings
from orderly.worker.settings.services import ServiceSettings
from orderly.worker.settings.tracking import TrackingSettings
from orderly.worker.settings.workers import WorkerSettings

SECTIONS = (
    ServiceSettings,
    HttpSettings,
    RateLimitSettings,
    ConversationSettings,
    PubSubSettings,
    TrackingSettings,
    DashboardSettings,
    ReportSettings,
    WorkerSettings,
)


class Settings(
    ServiceSettings,
    HttpSettings,
    RateLimitSettings,
    ConversationSettings,
    PubSubSettings,
    TrackingSettings,
    DashboardSettings,
    ReportSettings,
    WorkerSettings,
):
    model_config = CONFIG

    @model_validator(mode="after")
    def _tracking_times(self) -> Settings:
        if self.track_message_expire_ms <= self.track_message_timeout_ms:
            raise ValueError(
                "ORDERLY_TRACK_MESSAGE_EXPIRE_MS must be longer than "
                "ORDERLY_TRACK_MESSAGE_TIMEOUT_MS, or the monitor cannot see timeouts"
            )
        if self.service_expire_ms < 2 * self.heartbeat_interval_ms:
            raise ValueError(
                "ORDERLY_SERVICE_EXPIRE_MS must be at least twice ORDERLY_HEARTBEAT_INTERVAL, "
                "or a worker's key expires between two renewals"
            )
        return self

    @property
    def effective_track_redis_url(self) -> str:
        return self.track_redis_url or self.redis_url

    @property
    def bridge_keys(self) -> BridgeKeys:
        """The conversation keys of this prefix and shard count."""
        return BridgeKeys(self.bridge_prefix, self.shard_count(self.redis_cluster))


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
