#!/usr/bin/env python3
"""The demo's JWT issuer: a key made per run, and tokens signed with it, so
`make demo` can show a limit keyed on a verified claim. HS256 (a shared
secret) keeps it to Python's standard library; a real issuer signs with a
private key and publishes only its public keys (RS256/ES256).

  demo_jwt.py keys JWKS_OUT SECRET_OUT   a new secret, and the JWKS Envoy's
                                         jwt_authn verifies with
  demo_jwt.py sign SECRET_FILE CLAIMS    a token for CLAIMS (JSON), issued by
                                         envoy/envoy.yaml's issuer, valid 1 h
"""
import base64
import hashlib
import hmac
import json
import os
import sys
import time

ISSUER = "https://issuer.example.com"  # envoy/envoy.yaml's jwt_authn provider


def b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def keys(jwks_out: str, secret_out: str) -> None:
    secret = os.urandom(32)
    # Created 0600 under a new name and renamed over the old one: only the
    # demo's user may sign tokens, and an older file never lends its mode.
    tmp = f"{secret_out}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secret)
    os.replace(tmp, secret_out)
    jwks = {"keys": [{"kty": "oct", "alg": "HS256", "kid": "demo", "k": b64(secret)}]}
    with open(jwks_out, "w", encoding="utf-8") as f:
        json.dump(jwks, f)


def sign(secret_file: str, claims: str) -> str:
    with open(secret_file, "rb") as f:
        secret = f.read()
    payload = {"iss": ISSUER, "exp": int(time.time()) + 3600, **json.loads(claims)}
    header = {"alg": "HS256", "typ": "JWT", "kid": "demo"}
    signing_input = ".".join(
        b64(json.dumps(part, separators=(",", ":")).encode()) for part in (header, payload))
    mac = hmac.new(secret, signing_input.encode(), hashlib.sha256).digest()
    return f"{signing_input}.{b64(mac)}"


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "keys":
        keys(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 4 and sys.argv[1] == "sign":
        print(sign(sys.argv[2], sys.argv[3]))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
