"""An S3/IAM client independent of the filter (boto3), for moto_server: the
test harness (tests/support/s3.rs), the demo (envoy/demo.sh) and the compose
stack (envoy/compose.yaml, service objectstore-init) bootstrap and inspect the
store with it. Region us-east-1, path-style addressing. Run with a Python
that has boto3 (.venv/bin/python; the motoserver/moto image has it too):

  s3ctl.py [--host HOST] CMD PORT BUCKET ARGS...     (HOST default 127.0.0.1)

  bootstrap PORT BUCKET [SEED] [--env-file PATH]
            [--lifecycle-days N [--lifecycle-prefix PREFIX]]
                                            -> {"accessKeyId", "secretAccessKey"[, "lifecycle"]}
  list      PORT BUCKET AKID SECRET         -> [{"key", "size"}, ...]
  get       PORT BUCKET KEY AKID SECRET     -> object bytes on stdout; exit 3 if NoSuchKey
  put       PORT BUCKET KEY AKID SECRET     <- object bytes on stdin
  delete    PORT BUCKET KEY AKID SECRET
  lifecycle PORT BUCKET AKID SECRET DAYS [PREFIX] -> the lifecycle config read back

bootstrap --env-file writes AWS_ACCESS_KEY_ID=... and AWS_SECRET_ACCESS_KEY=...
lines (mode 0600) for a shell to source with `set -a` before starting Envoy.
If that file already holds a key the server accepts for BUCKET, bootstrap
reuses it instead of creating the user again, so a second `compose up`
against the same running server succeeds. --lifecycle-days puts the same rule
as `lifecycle` and adds the rules read back as "lifecycle".

Any other S3 error prints "<HTTP status> <code>: <message>" on stderr, exit 2.
"""

import argparse
import json
import os
import shlex
import sys
import urllib.request

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError

# moto_server's IAM access control is on when INITIAL_NO_AUTH_ACTION_COUNT is
# finite. Bootstrap opens a window of exactly this many unsigned actions (the
# IAM calls CreateUser, PutUserPolicy, CreateAccessKey) and closes it after
# (moto-api/reset-auth, never signed). Any S3/IAM request counts, even an
# unsigned `GET /` probe, which is why it re-opens the window itself instead
# of relying on the server's start-up value. Shared with tests/support/s3.rs
# (NO_AUTH_ACTIONS).
NO_AUTH_ACTIONS = 3
USER = "redis-guard"
REGION = "us-east-1"
ENV_ACCESS_KEY_ID = "AWS_ACCESS_KEY_ID"
ENV_SECRET_ACCESS_KEY = "AWS_SECRET_ACCESS_KEY"

HOST = "127.0.0.1"


def client(service, port, akid="bootstrap", secret="bootstrap"):
    return boto3.client(
        service,
        endpoint_url=f"http://{HOST}:{port}",
        region_name=REGION,
        aws_access_key_id=akid,
        aws_secret_access_key=secret,
        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}),
    )


def read_env_file(path):
    """(akid, secret) from an env file bootstrap wrote, or None."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return None
    values = {}
    for line in text.splitlines():
        name, sep, value = line.partition("=")
        if sep:
            values[name.strip()] = " ".join(shlex.split(value))
    akid, secret = values.get(ENV_ACCESS_KEY_ID), values.get(ENV_SECRET_ACCESS_KEY)
    return (akid, secret) if akid and secret else None


def write_env_file(path, akid, secret):
    # Written whole under a temporary name and renamed, so a reader never
    # sees half a file; created 0600 because it holds the secret.
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an older tmp file keeps its mode otherwise
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(f"{ENV_ACCESS_KEY_ID}={shlex.quote(akid)}\n")
        f.write(f"{ENV_SECRET_ACCESS_KEY}={shlex.quote(secret)}\n")
    os.replace(tmp, path)


def key_still_works(port, bucket, creds):
    # A signed HeadBucket with a key this server never issued fails (403),
    # as does one against a restarted, empty server (404): either way the
    # store has to be bootstrapped again.
    try:
        client("s3", port, *creds).head_bucket(Bucket=bucket)
        return True
    except ClientError:
        return False


def put_lifecycle(s3, bucket, days, prefix):
    rule = {
        "ID": "expire",
        "Status": "Enabled",
        "Filter": {"Prefix": prefix},
        "Expiration": {"Days": int(days)},
    }
    s3.put_bucket_lifecycle_configuration(
        Bucket=bucket, LifecycleConfiguration={"Rules": [rule]}
    )
    return s3.get_bucket_lifecycle_configuration(Bucket=bucket)["Rules"]


def create_user(port, bucket, seed):
    def moto_api(path, body=""):
        url = f"http://{HOST}:{port}/moto-api/{path}"
        headers = {"Content-Type": "text/plain"}
        urllib.request.urlopen(urllib.request.Request(url, body.encode(), headers))

    # Seeding moto's id generator first makes the access key a function of the
    # seed: a restarted server bootstrapped with the same seed issues the same key.
    moto_api(f"seed?a={int(seed)}")
    moto_api("reset-auth", str(NO_AUTH_ACTIONS))
    try:
        iam = client("iam", port)
        iam.create_user(UserName=USER)
        policy = {"Effect": "Allow", "Action": "s3:*", "Resource": "*"}
        iam.put_user_policy(
            UserName=USER,
            PolicyName="s3-all",
            PolicyDocument=json.dumps({"Version": "2012-10-17", "Statement": [policy]}),
        )
        key = iam.create_access_key(UserName=USER)["AccessKey"]
    finally:
        moto_api("reset-auth", "0")  # signatures required from here on, even after a failure
    akid, secret = key["AccessKeyId"], key["SecretAccessKey"]
    client("s3", port, akid, secret).create_bucket(Bucket=bucket)
    return akid, secret


def bootstrap(argv):
    p = argparse.ArgumentParser(prog="s3ctl.py bootstrap")
    p.add_argument("port")
    p.add_argument("bucket")
    p.add_argument("seed", nargs="?", default="0")
    p.add_argument("--env-file", help="write the key here for a shell to source")
    p.add_argument("--lifecycle-days", type=int, help="expire objects after N days")
    p.add_argument("--lifecycle-prefix", default="", help="only objects under this prefix")
    args = p.parse_args(argv)
    creds = read_env_file(args.env_file) if args.env_file else None
    if creds is None or not key_still_works(args.port, args.bucket, creds):
        creds = create_user(args.port, args.bucket, args.seed)
    out = {"accessKeyId": creds[0], "secretAccessKey": creds[1]}
    if args.lifecycle_days is not None:
        s3 = client("s3", args.port, *creds)
        out["lifecycle"] = put_lifecycle(
            s3, args.bucket, args.lifecycle_days, args.lifecycle_prefix
        )
    if args.env_file:
        write_env_file(args.env_file, *creds)
    print(json.dumps(out))
    return 0


def main(argv):
    global HOST
    # Only options before CMD are s3ctl's own: what follows is positional
    # (keys and secrets taken as given) except for bootstrap's options.
    p = argparse.ArgumentParser(prog="s3ctl.py", usage="%(prog)s [--host HOST] CMD PORT BUCKET ARGS...")
    p.add_argument("--host", default=HOST, help="moto_server's address (default %(default)s)")
    p.add_argument("cmd")
    p.add_argument("args", nargs=argparse.REMAINDER)
    top = p.parse_args(argv[1:])
    HOST = top.host
    cmd, rest = top.cmd, top.args
    if cmd == "bootstrap":
        return bootstrap(rest)
    wanted = {"list": 4, "get": 5, "put": 5, "delete": 5, "lifecycle": 5}
    if cmd not in wanted:
        sys.exit(f"unknown command {cmd!r}; see {__file__}")
    if len(rest) < wanted[cmd]:
        sys.exit(f"{cmd}: too few arguments; see {__file__}")
    port, bucket, rest = rest[0], rest[1], rest[2:]
    if cmd in ("list", "lifecycle"):
        akid, secret, rest = rest[0], rest[1], rest[2:]
    else:
        key, akid, secret = rest[0], rest[1], rest[2]
    s3 = client("s3", port, akid, secret)
    if cmd == "list":
        out = []
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            out += [{"key": o["Key"], "size": o["Size"]} for o in page.get("Contents", [])]
        print(json.dumps(out))
    elif cmd == "get":
        try:
            body = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
        except ClientError as e:
            if e.response["Error"]["Code"] == "NoSuchKey":
                return 3
            raise
        sys.stdout.buffer.write(body)
    elif cmd == "put":
        s3.put_object(Bucket=bucket, Key=key, Body=sys.stdin.buffer.read())
    elif cmd == "delete":
        s3.delete_object(Bucket=bucket, Key=key)
    elif cmd == "lifecycle":
        rules = put_lifecycle(s3, bucket, rest[0], rest[1] if len(rest) > 1 else "")
        print(json.dumps({"Rules": rules}))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv))
    except ClientError as e:
        err = e.response["Error"]
        status = e.response["ResponseMetadata"].get("HTTPStatusCode")
        print(f"{status} {err.get('Code')}: {err.get('Message')}", file=sys.stderr)
        sys.exit(2)
