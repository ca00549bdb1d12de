"""Numbered schema migrations of the PostgreSQL store, applied in order when it is opened.

Never edit a migration that has shipped: add a new one.  The table ``agentnb_schema`` records how many have
been applied.  Migration 1 is the SQLite store's migrations 1–4 in one (the tables and columns are the same,
so a workspace copies between the two backends column for column); from here on each backend numbers its
own migrations, since DDL differs between the two dialects.

Types: ids are BIGSERIAL (SQLite's INTEGER PRIMARY KEY is 64-bit too); times are DOUBLE PRECISION seconds
since the epoch, as SQLite's REAL; an event's ``payload`` is ``json``, not ``jsonb``: ``json`` keeps the text
exactly as :func:`agentnb.events.encode_payload` wrote it (key order, number spelling), so events read back
are the events written, while the frames can still read fields with ``#>``/``#>>``.
"""

from __future__ import annotations

__all__ = ["PG_MIGRATIONS", "PG_SCHEMA_VERSION"]

PG_MIGRATIONS: list[str] = [
    # 1: the schema of SQLite migrations 1–4 (docs/events.md, texts, batches, forks)
    """
    CREATE TABLE texts (
        hash TEXT PRIMARY KEY,
        body TEXT NOT NULL
    );
    CREATE TABLE batches (
        name        TEXT PRIMARY KEY,
        created     DOUBLE PRECISION NOT NULL,
        updated     DOUBLE PRECISION NOT NULL,
        fingerprint TEXT NOT NULL,
        cases       TEXT NOT NULL,
        variants    TEXT NOT NULL,
        options     TEXT NOT NULL DEFAULT '{}'
    );
    CREATE TABLE jobs (
        id               BIGSERIAL PRIMARY KEY,
        parent_id        BIGINT REFERENCES jobs(id),
        piece            TEXT NOT NULL,
        piece_yaml       TEXT NOT NULL,
        piece_path       TEXT,
        model            TEXT NOT NULL,
        instruction      TEXT NOT NULL,
        status           TEXT NOT NULL,
        current_movement TEXT,
        resume_movement  TEXT,
        movement_seq     BIGINT NOT NULL DEFAULT 0,
        workdir          TEXT NOT NULL,
        options          TEXT NOT NULL DEFAULT '{}',
        enriched         TEXT,
        error            TEXT,
        claimed_by       TEXT,
        created          DOUBLE PRECISION NOT NULL,
        updated          DOUBLE PRECISION NOT NULL,
        started          DOUBLE PRECISION,
        ended            DOUBLE PRECISION,
        instruction_ref  TEXT REFERENCES texts(hash),
        enriched_ref     TEXT REFERENCES texts(hash),
        batch            TEXT REFERENCES batches(name),
        batch_case       BIGINT,
        batch_variant    BIGINT,
        forked_from_job  BIGINT REFERENCES jobs(id),
        forked_from_seq  BIGINT
    );
    CREATE INDEX jobs_status ON jobs(status, id);
    CREATE INDEX jobs_parent ON jobs(parent_id);
    CREATE INDEX jobs_batch ON jobs(batch, batch_case, batch_variant);

    CREATE TABLE comments (
        id      BIGSERIAL PRIMARY KEY,
        job_id  BIGINT NOT NULL REFERENCES jobs(id),
        author  TEXT NOT NULL,
        body    TEXT NOT NULL,
        ts      DOUBLE PRECISION NOT NULL
    );
    CREATE INDEX comments_job ON comments(job_id, id);

    CREATE TABLE movements (
        job_id     BIGINT NOT NULL REFERENCES jobs(id),
        seq        BIGINT NOT NULL,
        name       TEXT NOT NULL,
        status     TEXT NOT NULL,
        started    DOUBLE PRECISION NOT NULL,
        ended      DOUBLE PRECISION,
        iterations BIGINT NOT NULL DEFAULT 0,
        next_step  TEXT,
        forced     BIGINT NOT NULL DEFAULT 0,
        summary    TEXT,
        PRIMARY KEY (job_id, seq)
    );

    CREATE TABLE events (
        id           BIGSERIAL PRIMARY KEY,
        job_id       BIGINT NOT NULL REFERENCES jobs(id),
        movement_seq BIGINT,
        iteration    BIGINT,
        ts           DOUBLE PRECISION NOT NULL,
        kind         TEXT NOT NULL,
        payload      JSON NOT NULL
    );
    CREATE INDEX events_job ON events(job_id, id);
    CREATE INDEX events_kind ON events(kind, job_id, id)
    """,
    # 2: leases (SQLite's migration 5: see there) and a job's files (issue 17, docs/stores.md).  Workers on
    # other machines share only the database, so a job's work directory lives here: one row per file,
    # `path` relative to the work directory in POSIX form, `mode` its st_mode (type and permission bits: a regular
    # file, or a symbolic link whose `data` is its target), `sha256` of `data`.
    # A file the job deleted has no row.  SQLite workspaces keep their work directories on disk.
    """
    ALTER TABLE jobs ADD COLUMN lease_until DOUBLE PRECISION;
    ALTER TABLE jobs ADD COLUMN lease_gen BIGINT NOT NULL DEFAULT 0;
    CREATE TABLE files (
        job_id  BIGINT NOT NULL REFERENCES jobs(id),
        path    TEXT NOT NULL,
        mode    INTEGER NOT NULL,
        size    BIGINT NOT NULL,
        sha256  TEXT NOT NULL,
        data    BYTEA NOT NULL,
        updated DOUBLE PRECISION NOT NULL,
        PRIMARY KEY (job_id, path)
    )
    """,
    # 3: epochs (SQLite's migration 6: see there)
    """
    ALTER TABLE jobs ADD COLUMN batch_epoch BIGINT;
    DROP INDEX jobs_batch;
    CREATE INDEX jobs_batch ON jobs(batch, batch_case, batch_variant, batch_epoch)
    """,
    # 4: the call cache (SQLite's migration 7: see there)
    """
    CREATE TABLE call_cache (
        key               TEXT PRIMARY KEY,
        kind              TEXT NOT NULL,
        model             TEXT NOT NULL,
        body              TEXT,
        body_ref          TEXT REFERENCES texts(hash),
        prompt_tokens     BIGINT,
        completion_tokens BIGINT,
        job_id            BIGINT,
        created           DOUBLE PRECISION NOT NULL,
        hits              BIGINT NOT NULL DEFAULT 0,
        last_hit          DOUBLE PRECISION
    );
    CREATE INDEX call_cache_created ON call_cache(created)
    """,
]

PG_SCHEMA_VERSION = len(PG_MIGRATIONS)
