#!/bin/sh
# Writes docker/.env (mode 600) with fresh random credentials for compose.yaml; an existing
# docker/.env is kept. compose.yaml refuses to start without them (${VAR:?...}); nothing in
# the repository holds a password or token. The optional settings are in .env.example.
set -eu
cd "$(dirname "$0")"
if [ -e .env ]; then
    echo "docker/.env exists; keeping it" >&2
    exit 0
fi
umask 077
python3 - > .env <<'PY'
import secrets

print("# written by docker/make-env.sh; keep it out of version control (docker/.gitignore)")
print(f"POSTGRES_PASSWORD={secrets.token_hex(24)}")
print("MINIO_ROOT_USER=dpivon")
print(f"MINIO_ROOT_PASSWORD={secrets.token_hex(24)}")
print(f"RAY_AUTH_TOKEN={secrets.token_hex(32)}")
PY
echo "wrote docker/.env" >&2
