"""mitmproxy settings under which the capture misses calls or records them other than they went.

Why: the addon sees a request in its ``request`` hook; mitmproxy's own addons that rewrite
requests (``modify_body``, ``modify_headers``, ``map_remote``, ``map_local``, an intercept edit)
run after it, settings that let traffic pass uninterpreted (``ignore_hosts``, a ``tcp`` mode) hide
calls from it, and flows read from a file were never sent through it. Each went by without a word
(a probe): the proxy now says so once at start, or when the setting changes while it runs.
"""

from __future__ import annotations

from typing import Any

#: Options the notes read: a change of one of them while the proxy runs is noted again.
WATCHED = frozenset({"modify_body", "modify_headers", "map_remote", "map_local", "intercept", "server_replay",
                     "client_replay", "rfile", "ignore_hosts", "allow_hosts", "tcp_hosts", "udp_hosts", "mode",
                     "proxyauth"})

_REWRITERS = ("modify_body", "modify_headers", "map_remote")
#: Reverse-proxy schemes whose traffic mitmproxy passes as raw bytes (no HTTP to read).
_RAW_SCHEMES = frozenset({"tcp", "tls", "udp", "dtls", "quic", "dns"})


def _raw_mode(spec: str) -> bool:
    """Whether ``spec`` (a ``--mode``) passes its traffic as raw bytes: a DNS server, or a reverse
    proxy to a ``tcp://``, ``tls://``, ``udp://``, ``dtls://``, ``quic://`` or ``dns://`` server."""
    from mitmproxy.proxy.mode_specs import DnsMode, ProxyMode, ReverseMode

    try:
        mode = ProxyMode.parse(spec)
    except ValueError:  # mitmproxy refuses it itself
        return False
    return isinstance(mode, DnsMode) or (isinstance(mode, ReverseMode) and mode.scheme in _RAW_SCHEMES)


def blind_spots(options: Any, only: frozenset[str] | set[str] | None = None) -> list[str]:
    """One line per setting of ``options`` (mitmproxy's) that hides calls from the capture or
    changes them after it read them; ``only``: just the notes that involve those option names."""
    def opt(name: str, default: Any = None) -> Any:
        return getattr(options, name, default)

    notes: list[tuple[set[str], str]] = []
    rewriting = {name: f"{name} ({len(opt(name))} rule(s))" for name in _REWRITERS if opt(name, [])}
    if opt("intercept"):
        rewriting["intercept"] = f"intercept ({opt('intercept')}: an edited request)"
    if rewriting:
        notes.append((set(rewriting), f"{', '.join(rewriting.values())}: changes a request after the capture read "
                      "it; a row records the request as the client sent it (its host, its identity headers, which "
                      "then reach the server) and says in its error when the body or server changed"))
    if opt("map_local", []):
        notes.append(({"map_local"}, "map_local: answers from local files are recorded as model calls"))
    if opt("server_replay", []):
        notes.append(({"server_replay"}, "server_replay: answers replayed from a file are recorded as model calls "
                      "(a replayed stream as an error: its body was not saved)"))
    if opt("client_replay", []):
        notes.append(({"client_replay"}, "client_replay: each replayed request is a new call with an id of its own; "
                      "a flow saved by a capture proxy holds the fields it added and no identity (its headers were "
                      "removed)"))
    if opt("rfile"):
        notes.append(({"rfile"}, f"rfile: flows read from {opt('rfile')} are not recorded (they were not sent "
                      "through this proxy); only calls made through it are"))
    for name in ("ignore_hosts", "tcp_hosts", "udp_hosts"):
        if opt(name, []):
            notes.append(({name}, f"{name}: calls to the hosts it names pass uninterpreted and are not recorded"))
    if opt("allow_hosts", []):
        notes.append(({"allow_hosts"}, "allow_hosts: calls to any other host pass uninterpreted and are not "
                      "recorded"))
    modes = [str(m) for m in opt("mode", []) or []]
    raw = [m for m in modes if _raw_mode(m)]
    if raw:
        notes.append(({"mode"}, f"mode {', '.join(raw)}: traffic passes as raw bytes there and is not recorded"))
    if any(m.split("@", 1)[0] == "socks5" for m in modes) and not opt("proxyauth"):
        notes.append(({"mode", "proxyauth"}, "mode socks5 without proxyauth: SOCKS5 user names are not read "
                      "(mitmproxy asks for none), so calls there have no rollout id from them; --set "
                      "proxyauth=any takes any"))
    return [line for names, line in notes if only is None or names & set(only)]
