"""API keys: `sk-sluice-<key id>.<secret>`; only a salted hash of the secret is stored.

The key id is public (it finds the row); the secret is 256 random bits, so a
salted SHA-256 is as strong as a slow hash would be and keeps the permission
check cheap. Keys never appear in logs or events: log `key_id` only.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass

PREFIX = "sk-sluice-"
_KEY_RE = re.compile(r"^sk-sluice-([a-z0-9]{16})\.([A-Za-z0-9_-]{43})$")


@dataclass(frozen=True, slots=True)
class NewKey:
    key: str
    key_id: str
    salt: bytes
    secret_hash: bytes


def hash_secret(salt: bytes, secret: str) -> bytes:
    return hashlib.sha256(salt + secret.encode()).digest()


def generate() -> NewKey:
    key_id = "".join(secrets.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(16))
    secret = secrets.token_urlsafe(32)
    salt = secrets.token_bytes(16)
    return NewKey(f"{PREFIX}{key_id}.{secret}", key_id, salt, hash_secret(salt, secret))


def parse(key: str) -> tuple[str, str] | None:
    """(key id, secret) of a well-formed key, else None."""
    match = _KEY_RE.fullmatch(key)
    return (match.group(1), match.group(2)) if match else None


def key_id_of(key: str) -> str:
    """The key id of a key (or the key id itself); raises ValueError otherwise."""
    if re.fullmatch(r"[a-z0-9]{16}", key):
        return key
    parsed = parse(key)
    if parsed is None:
        raise ValueError("not a sluice API key (expected sk-sluice-<id>.<secret>)")
    return parsed[0]


def verify(salt: bytes, secret_hash: bytes, secret: str) -> bool:
    return hmac.compare_digest(hash_secret(salt, secret), secret_hash)


def bearer_key(authorization: bytes | str | None) -> str | None:
    """The key in an `authorization: Bearer <key>` header value, or None."""
    if authorization is None:
        return None
    if isinstance(authorization, bytes):
        try:
            authorization = authorization.decode("ascii")
        except UnicodeDecodeError:
            return None
    scheme, _, value = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    return value.strip()
