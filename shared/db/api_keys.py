"""API keys: creating, listing, revoking and checking them (``tuneq keys``, the API's auth).

A key is ``tq_<id>_<secret>``: ``id`` is public (listed, revoked by), ``secret`` is 32 random
bytes. Only the SHA-256 of the whole key is stored: the key is random and long, so a slow
password hash would add nothing but latency to every request, and a database leak still
gives no usable key.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
import secrets
from datetime import timedelta

from sqlmodel import Session, col, select

from shared.db.models import ApiKey, as_utc, utcnow

KEY_PREFIX = "tq_"
# last_used_at is written at most this often per key, so requests do not each write a row.
LAST_USED_RESOLUTION = timedelta(seconds=60)
_OWNER = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@+-]{0,199}")


class InvalidOwner(ValueError):
    pass


def check_owner(owner: str) -> str:
    """The owner name as stored, or InvalidOwner saying what a name may hold."""
    if not _OWNER.fullmatch(owner):
        raise InvalidOwner(
            f"invalid owner {owner!r}: use 1 to 200 letters, digits and . _ @ + -, starting with a letter or digit"
        )
    return owner


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def create_key(*, session: Session, owner: str, admin: bool = False) -> tuple[ApiKey, str]:
    """A new key for ``owner`` (an admin's: sees every owner's jobs): the row, and the key
    itself (not stored anywhere)."""
    key_id = secrets.token_hex(6)
    key = f"{KEY_PREFIX}{key_id}_{secrets.token_urlsafe(32)}"
    row = ApiKey(id=key_id, owner=check_owner(owner), key_hash=hash_key(key), admin=admin)
    session.add(row)
    session.commit()
    session.refresh(row)
    return row, key


def list_keys(*, session: Session) -> list[ApiKey]:
    return list(session.exec(select(ApiKey).order_by(col(ApiKey.created_at), col(ApiKey.id))).all())


def revoke_key(*, session: Session, key_id: str) -> ApiKey | None:
    """Revoke a key by id (revoking it again keeps the first time); None when there is no such key."""
    row = session.get(ApiKey, key_id)
    if row is None:
        return None
    if row.revoked_at is None:
        row.revoked_at = utcnow()
        session.add(row)
        session.commit()
        session.refresh(row)
    return row


def holder_of_key(*, session: Session, key: str) -> ApiKey | None:
    """The row of a valid (known, not revoked) key, else None. Records when it was last used."""
    if not key.startswith(KEY_PREFIX):
        return None
    row = session.exec(select(ApiKey).where(ApiKey.key_hash == hash_key(key))).first()
    if row is None or row.revoked_at is not None:
        return None
    now = utcnow()
    last = row.last_used_at
    if last is None or as_utc(last) < now - LAST_USED_RESOLUTION:
        row.last_used_at = now
        session.add(row)
        session.commit()
    return row


def is_loopback(host: str) -> bool:
    """Whether a --host listens on loopback only: 127.0.0.0/8, ::1, localhost."""
    name = host.strip().strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False
