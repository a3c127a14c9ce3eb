# PostgreSQL from Debian's packages (15 in bookworm). entrypoint-postgres.sh creates the
# cluster, its user and database on first start. See docs/operations.md (Images).
FROM obliviate-base:bookworm
RUN apt-get update && apt-get install -y postgresql-15 && rm -rf /var/lib/apt/lists/*
COPY entrypoint-postgres.sh /usr/local/bin/
ENV PGDATA=/var/lib/postgresql/data PATH=/usr/lib/postgresql/15/bin:$PATH
ENTRYPOINT ["/usr/local/bin/entrypoint-postgres.sh"]
