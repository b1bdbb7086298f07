"""The outbound address policy: where orderly may send a request on a user's behalf.

Channel URLs, push subscriptions and confirmation URLs are registered through the API, and
orderly then POSTs to them from inside the deployment. Without a policy that is a
server-side request to any address the caller chooses: a database's admin port, a cloud
metadata service, a neighbour's internal API. So by default an address that is loopback,
private, shared (carrier-grade NAT), link-local (the metadata services live there),
multicast, reserved or unspecified is refused. ``ORDERLY_OUTBOUND_ALLOW`` admits chosen
hosts (by name, as written in the URL) or networks (CIDR, or one address).

A URL is checked when it is registered (a literal address, or every address its host
resolves to now; a name that does not resolve yet is left to the send) and again at send
time, by the connection itself: the name is resolved, every address checked, and the socket
connects to a checked address, so a name that resolves elsewhere later (DNS rebinding)
gains nothing. Through a proxy (ORDERLY_HTTP_PROXY) the target is checked before the request,
but the proxy resolves it again: there the proxy's own egress rules are the last word.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Iterable
from dataclasses import dataclass, field

from orderly.worker.core.errors import InvalidMessage

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

_SHARED = ipaddress.ip_network("100.64.0.0/10")  # carrier-grade NAT (RFC 6598)
_HOST_RE = re.compile(
    r"^(?=.{1,253}$)[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*$"
)


class OutboundRefused(OSError):
    """A request to an address the policy refuses (an OSError: no connection was made)."""


def _kind(address: IPAddress) -> str | None:
    """Why an address is internal, or None for a public one."""
    if isinstance(address, ipaddress.IPv6Address):
        # An IPv4 address inside an IPv6 one (mapped, 6to4, Teredo) is judged as itself.
        embedded = address.ipv4_mapped or address.sixtofour
        if embedded is None and address.teredo is not None:
            embedded = address.teredo[1]
        if embedded is not None:
            return _kind(embedded)
        if address.is_site_local:
            return "site-local"
    if address.is_loopback:
        return "loopback"
    if address.is_link_local:
        return "link-local (cloud metadata services live there)"
    if address.is_unspecified:
        return "unspecified"
    if address.is_multicast:
        return "multicast"
    if isinstance(address, ipaddress.IPv4Address) and address in _SHARED:
        return "shared (carrier-grade NAT)"
    if address.is_private:
        return "private"
    if address.is_reserved:
        return "reserved"
    return None


@dataclass(frozen=True)
class AddressPolicy:
    """Refuses internal addresses except the hosts and networks allowed."""

    hosts: frozenset[str] = frozenset()
    networks: tuple[IPNetwork, ...] = field(default=())

    @classmethod
    def parse(cls, spec: str | Iterable[str]) -> AddressPolicy:
        """``127.0.0.1, 10.0.0.0/8, sink.internal``: addresses, networks and host names.
        Raises ValueError naming an entry that is none of these."""
        entries = spec.split(",") if isinstance(spec, str) else list(spec)
        hosts: set[str] = set()
        networks: list[IPNetwork] = []
        for raw in entries:
            entry = raw.strip().lower()
            if not entry:
                continue
            try:
                networks.append(ipaddress.ip_network(entry, strict=False))
                continue
            except ValueError:
                pass
            if not _HOST_RE.match(entry):
                raise ValueError(f"{raw.strip()!r} is not an address, a network or a host name")
            hosts.add(entry)
        return cls(frozenset(hosts), tuple(networks))

    def refusal(self, address: IPAddress) -> str | None:
        """Why this address may not be reached, or None."""
        kind = _kind(address)
        if kind is None or any(address in net for net in self.networks):
            return None
        return f"{address} is an internal address ({kind})"

    def allows_host(self, host: str) -> bool:
        return host.strip("[]").lower() in self.hosts

    def resolve(self, host: str, port: int) -> list[tuple[int, str]]:
        """The addresses a connection to ``host`` may use: (family, address), each checked.
        Raises OutboundRefused when any address the host resolves to is refused."""
        bare = host.strip("[]")
        try:
            literal: IPAddress | None = ipaddress.ip_address(bare)
        except ValueError:
            literal = None
        infos: list[tuple[int, str]]
        if literal is not None:
            infos = [(int(socket.AF_INET6 if literal.version == 6 else socket.AF_INET), bare)]
        else:
            found = socket.getaddrinfo(bare, port, type=socket.SOCK_STREAM)
            infos = list(dict.fromkeys((int(fam), str(sa[0])) for fam, _, _, _, sa in found))
        for _, addr in infos:
            why = self.refusal(ipaddress.ip_address(addr.split("%")[0]))
            if why is not None:
                named = "" if literal is not None else f"{bare} resolves to "
                raise OutboundRefused(
                    f"refused by the outbound address policy: {named}{why}"
                    " (ORDERLY_OUTBOUND_ALLOW admits hosts and networks)"
                )
        return infos

    def check_url(self, field_name: str, url: str) -> None:
        """At registration: refuse a URL whose host is, or now resolves to, an address the
        policy refuses (InvalidMessage naming the field). A name that does not resolve is
        accepted: the send checks it again."""
        import httpx

        try:
            parsed = httpx.URL(url)
        except (httpx.InvalidURL, ValueError) as exc:
            raise InvalidMessage(field_name, f"{url!r} is not a URL: {exc}") from None
        host = parsed.raw_host.decode("ascii")  # IDNA: the name that is resolved and sent
        if not host or self.allows_host(host):
            return
        try:
            self.resolve(host, parsed.port or (443 if parsed.scheme == "https" else 80))
        except OutboundRefused as exc:
            raise InvalidMessage(field_name, str(exc)) from None
        except (OSError, UnicodeError):
            return  # not resolvable now: the send resolves and checks it


# What a policy of the settings is when nothing is allowed.
STRICT = AddressPolicy()
