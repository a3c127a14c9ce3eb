#!/bin/sh
# First start: a cluster owned by `postgres`, password auth, POSTGRES_USER owning
# POSTGRES_DB. Every start: listen on POSTGRES_HOST:POSTGRES_PORT.
set -eu
mkdir -p "$PGDATA" /run/postgresql
chown -R postgres:postgres "$PGDATA" /run/postgresql
chmod 700 "$PGDATA"
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    printf '%s' "$POSTGRES_PASSWORD" > /tmp/pw && chown postgres /tmp/pw
    runuser -u postgres -- initdb -D "$PGDATA" -U postgres --auth=scram-sha-256 --pwfile=/tmp/pw
    runuser -u postgres -- postgres -D "$PGDATA" -c listen_addresses= -k /run/postgresql &
    until runuser -u postgres -- pg_isready -q -h /run/postgresql; do sleep 0.2; done
    PGPASSWORD="$POSTGRES_PASSWORD" runuser -u postgres -- psql -h /run/postgresql -v ON_ERROR_STOP=1 \
        -c "CREATE USER \"$POSTGRES_USER\" PASSWORD '$POSTGRES_PASSWORD'" \
        -c "CREATE DATABASE \"$POSTGRES_DB\" OWNER \"$POSTGRES_USER\""
    runuser -u postgres -- pg_ctl -D "$PGDATA" -m fast -w stop
    rm -f /tmp/pw
fi
# setpriv execs (runuser would stay as PID 1 between Docker's signals and postgres)
exec setpriv --reuid=postgres --regid=postgres --init-groups postgres -D "$PGDATA" -k /run/postgresql \
    -c listen_addresses="${POSTGRES_HOST:-127.0.0.1}" -p "${POSTGRES_PORT:-5432}"
