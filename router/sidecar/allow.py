"""Which prefill targets a sidecar may contact, and which peers may send it a prefill leg:
literal addresses only, matched against ``--allow``.

The prefill address comes from a request header, so it is an SSRF vector: names are never
resolved, zone ids and unbracketed IPv6 with a port are refused, and an empty list permits nothing.
The same list names the peers whose sidecars may send this one a prefill leg (by IP: their source
port is any).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_host_port(value: str) -> tuple[IPAddress, int] | None:
    """``ip:port`` or ``[ipv6]:port`` with a literal address, else ``None`` (names are never resolved)."""
    host, sep, port = value.rpartition(":")
    if not sep:
        return None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        return None  # an IPv6 address with a port must be bracketed, or the port is ambiguous
    if "%" in host:
        return None  # zone ids name an interface, not a pod
    # isdigit() alone accepts non-ASCII digits that int() would happily convert.
    if not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        return None
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    return _unmapped(address), int(port)


def format_host_port(address: IPAddress, port: int) -> str:
    return f"[{address}]:{port}" if address.version == 6 else f"{address}:{port}"


def _unmapped(address: IPAddress) -> IPAddress:
    # ::ffff:10.0.0.1 is 10.0.0.1 on the wire; compare it as such.
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


class PrefillAllowList:
    """Which prefill targets a sidecar may contact: CIDRs, bare IPs (any port) and exact ``ip:port``."""

    def __init__(self, entries: Iterable[str]) -> None:
        self.networks: list[IPNetwork] = []
        self.endpoints: set[tuple[IPAddress, int]] = set()
        for entry in entries:
            self._add(entry.strip(), entry)

    def _add(self, text: str, entry: str) -> None:
        if "/" in text:
            try:
                network = ipaddress.ip_network(text)
            except ValueError as exc:
                raise ValueError(f"invalid prefill allow entry {entry!r}: {exc}") from None
            self.networks.append(network)
            return
        bare = text[1:-1] if text.startswith("[") and text.endswith("]") else text
        try:
            address = ipaddress.ip_address(bare)
        except ValueError:
            pass
        else:
            if "%" in bare:
                raise ValueError(f"invalid prefill allow entry {entry!r}: zone ids are not supported")
            address = _unmapped(address)
            self.networks.append(ipaddress.ip_network(address))
            return
        host_port = parse_host_port(text)
        if host_port is None:
            raise ValueError(
                f"invalid prefill allow entry {entry!r}: expected a CIDR, an IP address or ip:port "
                "([v6]:port); host names are not accepted"
            )
        self.endpoints.add(host_port)

    def permits(self, host_port: str) -> bool:
        parsed = parse_host_port(host_port.strip())
        if parsed is None:
            return False
        address, port = parsed
        return (address, port) in self.endpoints or any(address in net for net in self.networks)

    def permits_peer(self, host: str) -> bool:
        """Whether a connection from IP ``host`` may come from a peer: any entry's address, any port."""
        try:
            address = _unmapped(ipaddress.ip_address(host))
        except ValueError:
            return False
        return any(address in net for net in self.networks) or any(
            address == allowed for allowed, _ in self.endpoints
        )

    def __bool__(self) -> bool:
        return bool(self.networks or self.endpoints)


def first_prefiller(values: list[str]) -> str | None:
    """The first entry of a (possibly repeated, possibly comma-separated) prefill header."""
    for value in values:
        for item in value.split(","):
            item = item.strip()
            if item.lower().startswith("http://"):
                item = item[len("http://") :].rstrip("/")
            if item:
                return item
    return None
