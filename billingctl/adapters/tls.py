"""The one TLS context a process's outbound clients share (decision 263).

httpx builds a context for every client and loads certifi's whole bundle into it (about 140 certificates
parsed, some 20 ms of CPU, 8 % of a one-shot job's instructions) although a process talks to two or three
hosts. Here one context serves every client, and where the system keeps its trust store as OpenSSL's
hashed directory (Debian's /etc/ssl/certs, kept by `update-ca-certificates`) it is looked up lazily: a
handshake reads the one or two certificates its chain needs. Verification is the same as httpx's default
(hostname checked, certificate required); only where the trusted certificates are read from changes.

The order, as httpx and OpenSSL read it: `SSL_CERT_FILE`, then `SSL_CERT_DIR` (an operator's own trust
store), then the system's hashed directory, then certifi's bundle (a system without one)."""

from __future__ import annotations

import functools
import os
import re
import ssl

HASHED = re.compile(r"[0-9a-f]{8}\.\d+")


def is_hashed_directory(path: str | None) -> bool:
    """OpenSSL's lookup by subject hash finds certificates only through `<hash>.<n>` names."""
    if not path or not os.path.isdir(path):
        return False
    with os.scandir(path) as entries:
        return any(HASHED.fullmatch(entry.name) for entry in entries)


def trust_store(environ=os.environ, system_capath: str | None = None) -> dict:
    """Where the trusted certificates are read from: `cafile=` or `capath=` for `create_default_context`."""
    if environ.get("SSL_CERT_FILE"):
        return {"cafile": environ["SSL_CERT_FILE"]}
    if environ.get("SSL_CERT_DIR"):
        return {"capath": environ["SSL_CERT_DIR"]}
    system_capath = system_capath if system_capath is not None else ssl.get_default_verify_paths().capath
    if is_hashed_directory(system_capath):
        return {"capath": system_capath}
    import certifi

    return {"cafile": certifi.where()}


@functools.cache
def context() -> ssl.SSLContext:
    """The process's context (built on first use: a command that calls no one builds none)."""
    return ssl.create_default_context(**trust_store())
