"""Who may take part in a weight sync: the run's secret, the HMAC proofs each side gives of
holding it, and the addresses on which no secret is needed.

A per-run secret (>= 32 random bytes, see new_secret) reaches the engines through Ray, inside
the receiver the synchronizer makes (base.Receiver), never over a weight socket. Proofs are
HMAC-SHA256 over a domain, the prover's role and fresh values of both sides (nonces, version),
checked with hmac.compare_digest, so a proof cannot be replayed, reflected or reused for
another sync. Without a secret only local addresses work: an ipc:// socket file (never the
abstract "@" namespace, which has no file permissions) or inproc://."""

from __future__ import annotations

import hashlib
import hmac
import secrets

MIN_SECRET_BYTES = 32
_DOMAIN = "agentgym-mega weight sync v1"
_COLLECTIVE_DOMAIN = "agentgym-mega collective sync v1"


def new_secret() -> str:
    """A fresh per-run secret (32 random bytes, hex) for a sender and the engines it feeds."""
    return secrets.token_hex(MIN_SECRET_BYTES)


def secret_bytes(secret: str | bytes | None) -> bytes | None:
    """The secret as bytes, checked: None stays None (a local address may do without)."""
    if secret is None:
        return None
    if isinstance(secret, str):
        secret = secret.encode()
    if not isinstance(secret, (bytes, bytearray)):
        raise TypeError(f"the weight-sync secret must be str or bytes, got {type(secret).__name__}")
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"the weight-sync secret must be at least {MIN_SECRET_BYTES} bytes, got {len(secret)} "
                         "(use weight_sync.new_secret())")
    return bytes(secret)


def proof(secret: bytes, role: str, engine_nonce: str, trainer_nonce: str, version) -> str:
    """HMAC-SHA256 by which `role` ("trainer" or "engine") shows it holds the run's secret."""
    message = "\n".join([_DOMAIN, role, engine_nonce, trainer_nonce, str(version)]).encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def proof_ok(secret: bytes, given, role: str, engine_nonce: str, trainer_nonce: str, version) -> bool:
    if not isinstance(given, str):
        return False
    expected = proof(secret, role, engine_nonce, trainer_nonce, version)
    return hmac.compare_digest(expected.encode(), given.encode("utf-8", "replace"))


def collective_key(secret: bytes, *parts) -> str:
    """The collective transport's keys: its rendezvous prefix and its commit proofs."""
    message = "\n".join([_COLLECTIVE_DOMAIN, *map(str, parts)]).encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def collective_key_ok(secret: bytes, given, *parts) -> bool:
    return isinstance(given, str) and hmac.compare_digest(given.encode(), collective_key(secret, *parts).encode())


def scheme(address: str) -> str:
    return address.split("://", 1)[0] if "://" in address else address


def ipc_path(address: str) -> str | None:
    """The socket file of an ipc:// address; None for anything else, including the abstract
    namespace (ipc://@name), which has no file permissions to restrict who connects."""
    if not address.startswith("ipc://") or address.startswith("ipc://@"):
        return None
    return address[len("ipc://"):]


def local_only(address: str) -> bool:
    """Transports on which only this user's processes can reach the socket without a secret."""
    return ipc_path(address) is not None or address.startswith("inproc://")
