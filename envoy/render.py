#!/usr/bin/env python3
"""Renders the stack's config templates (envoy.yaml, webdis.json).

Used by the demo (envoy/demo.sh) and the compose stack (compose.yaml), so
both run the very files the tests render. Every double-brace NAME
placeholder in a template must be given with --set NAME=VALUE (or, for
FILTER_CONFIG, --filter-config FILE; for JWKS, --jwks FILE: the JWT issuer's
public keys, JSON); a placeholder left over or a --set no template uses is
an error, so a renamed placeholder cannot go unnoticed.

--webdis-credentials FILE makes Webdis' HTTP Basic credentials for this
stack: the user redis-guard and a new random password, inserted as
WEBDIS_USERNAME and WEBDIS_PASSWORD (webdis.json's http_basic_auth) and
written to FILE (mode 0600, as is the rendered webdis.json) as
REDIS_GUARD_WEBDIS_AUTHORIZATION="Basic ..."
(the header envoy.yaml's webdis cluster adds to every callout), and as
REDIS_GUARD_WEBDIS_USERNAME=... and REDIS_GUARD_WEBDIS_PASSWORD=... (what the
filter reads with redis.credentials.fromEnvironment, where it sends them
itself): load FILE into Envoy's environment.

--redis-users FILE makes the passwords of redis.acl's two Redis users: the
default user, which Webdis connects as (its SHA-256 in redis.acl, and
REDIS_AUTH, the JSON string webdis.json's redis_auth takes), and admin, for
operators (its SHA-256 in redis.acl), written to FILE (mode 0600) as
REDIS_ADMIN_PASSWORD=...

  render.py --out DIR [--set NAME=VALUE ...] [--filter-config FILE] [--jwks FILE]
            [--webdis-credentials FILE] [--redis-users FILE] TEMPLATE...

Each TEMPLATE is written to DIR under its own file name, mode 0600 when it
uses a secret (WEBDIS_PASSWORD, REDIS_AUTH), as the credential files are.
"""
import argparse
import base64
import hashlib
import json
import os
import re
import secrets
import sys

PLACEHOLDER = re.compile(r"\{\{([A-Z_]+)\}\}")
# Placeholders whose values are secrets: a template using one is rendered
# readable by its owner only (webdis.json: Webdis' Basic password and
# redis_auth). redis.acl holds only SHA-256s of random passwords and stays
# readable, as Redis in the compose stack runs as another user.
SECRET_PLACEHOLDERS = {"WEBDIS_PASSWORD", "REDIS_AUTH"}


def write_file(path: str, text: str, secret: bool) -> None:
    """Writes `text` to `path` under a new temporary name, renamed over it:
    a secret is created 0600, so no other user can open it at any moment,
    and a file left by an earlier run never lends it its mode."""
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if secret else 0o666)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="directory for the rendered files")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE")
    p.add_argument("--filter-config", help="filter JSON, inserted as FILTER_CONFIG")
    p.add_argument("--jwks", help="the JWT issuer's JWKS (JSON), inserted as JWKS")
    p.add_argument("--webdis-credentials", metavar="FILE",
                   help="make Webdis credentials; write them to FILE for Envoy's environment")
    p.add_argument("--redis-users", metavar="FILE",
                   help="make the Redis users' passwords; write the admin's to FILE")
    p.add_argument("templates", nargs="+")
    args = p.parse_args()

    values = {}
    for item in args.set:
        name, sep, value = item.partition("=")
        if not sep or not PLACEHOLDER.fullmatch("{{" + name + "}}"):
            p.error(f"--set {item!r}: expected NAME=VALUE with NAME in A-Z and _")
        values[name] = value
    if args.filter_config:
        with open(args.filter_config, encoding="utf-8") as f:
            text = f.read()
        try:
            json.loads(text)
        except ValueError as e:
            p.error(f"{args.filter_config} is not JSON: {e}")
        # One JSON string literal: a valid YAML scalar that Envoy hands to the
        # filter unchanged.
        values["FILTER_CONFIG"] = json.dumps(text)
    if args.jwks:
        with open(args.jwks, encoding="utf-8") as f:
            try:
                jwks = json.load(f)
            except ValueError as e:
                p.error(f"{args.jwks} is not JSON: {e}")
        if not isinstance(jwks, dict) or not isinstance(jwks.get("keys"), list):
            p.error(f"{args.jwks}: a JWKS is an object with a `keys` list")
        # One line, and no single quote: it sits in a single-quoted scalar.
        values["JWKS"] = json.dumps(jwks, separators=(",", ":")).replace("'", "\\u0027")

    if args.webdis_credentials:
        # 32 characters: Webdis 0.1.9 never admits a `user:password` over 53
        # bytes (its base64 form is capped at 72 characters).
        password = secrets.token_urlsafe(24)
        values["WEBDIS_USERNAME"] = "redis-guard"
        values["WEBDIS_PASSWORD"] = password
        basic = base64.b64encode(f"redis-guard:{password}".encode()).decode()
        # Quoted for the shell (demo.sh and compose source the file): the
        # value holds a space.
        write_file(args.webdis_credentials,
                   f"REDIS_GUARD_WEBDIS_AUTHORIZATION='Basic {basic}'\n"
                   f"REDIS_GUARD_WEBDIS_USERNAME=redis-guard\nREDIS_GUARD_WEBDIS_PASSWORD={password}\n",
                   secret=True)

    if args.redis_users:
        password = secrets.token_urlsafe(24)
        admin = secrets.token_urlsafe(24)
        # redis.acl holds their SHA-256 only (Redis' `#<hash>` form).
        values["REDIS_PASSWORD_HASH"] = hashlib.sha256(password.encode()).hexdigest()
        values["REDIS_AUTH"] = json.dumps(password)
        values["REDIS_ADMIN_PASSWORD_HASH"] = hashlib.sha256(admin.encode()).hexdigest()
        write_file(args.redis_users, f"REDIS_ADMIN_PASSWORD={admin}\n", secret=True)

    os.makedirs(args.out, exist_ok=True)
    used = set()
    for template in args.templates:
        with open(template, encoding="utf-8") as f:
            text = f.read()
        wanted = set(PLACEHOLDER.findall(text))
        missing = sorted(wanted - values.keys())
        if missing:
            print(f"render.py: {template}: no value for {', '.join(missing)}", file=sys.stderr)
            return 1
        used |= wanted
        rendered = PLACEHOLDER.sub(lambda m: values[m.group(1)], text)
        write_file(os.path.join(args.out, os.path.basename(template)), rendered,
                   secret=bool(wanted & SECRET_PLACEHOLDERS))
    unused = sorted(values.keys() - used)
    if unused:
        print(f"render.py: no template uses {', '.join(unused)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
