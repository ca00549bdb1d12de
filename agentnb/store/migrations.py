"""Numbered schema migrations, applied in order when a store is opened.

Never edit a migration that has shipped: add a new one.  ``PRAGMA user_version``
records how many have been applied.
"""

from __future__ import annotations

MIGRATIONS: list[str] = [
    # 1: the initial schema (docs/events.md)
    """
    CREATE TABLE jobs (
        id               INTEGER PRIMARY KEY AUTOINCREMENT,
        parent_id        INTEGER REFERENCES jobs(id),
        piece            TEXT NOT NULL,
        piece_yaml       TEXT NOT NULL,
        piece_path       TEXT,
        model            TEXT NOT NULL,
        instruction      TEXT NOT NULL,
        status           TEXT NOT NULL,
        current_movement TEXT,
        resume_movement  TEXT,
        movement_seq     INTEGER NOT NULL DEFAULT 0,
        workdir          TEXT NOT NULL,
        options          TEXT NOT NULL DEFAULT '{}',
        enriched         TEXT,
        error            TEXT,
        claimed_by       TEXT,
        created          REAL NOT NULL,
        updated          REAL NOT NULL,
        started          REAL,
        ended            REAL
    );
    CREATE INDEX jobs_status ON jobs(status, id);
    CREATE INDEX jobs_parent ON jobs(parent_id);

    CREATE TABLE comments (
        id      INTEGER PRIMARY KEY AUTOINCREMENT,
        job_id  INTEGER NOT NULL REFERENCES jobs(id),
        author  TEXT NOT NULL,
        body    TEXT NOT NULL,
        ts      REAL NOT NULL
    );
    CREATE INDEX comments_job ON comments(job_id, id);

    CREATE TABLE movements (
        job_id     INTEGER NOT NULL REFERENCES jobs(id),
        seq        INTEGER NOT NULL,
        name       TEXT NOT NULL,
        status     TEXT NOT NULL,
        started    REAL NOT NULL,
        ended      REAL,
        iterations INTEGER NOT NULL DEFAULT 0,
        next_step  TEXT,
        forced     INTEGER NOT NULL DEFAULT 0,
        summary    TEXT,
        PRIMARY KEY (job_id, seq)
    );

    CREATE TABLE events (
        id           INTEGER PRIMARY KEY AUTOINCREMENT,
        job_id       INTEGER NOT NULL REFERENCES jobs(id),
        movement_seq INTEGER,
        iteration    INTEGER,
        ts           REAL NOT NULL,
        kind         TEXT NOT NULL,
        payload      TEXT NOT NULL
    );
    CREATE INDEX events_job ON events(job_id, id);
    CREATE INDEX events_kind ON events(kind, job_id);
    """,
    # 2: large texts stored once (issue 11, item 14).  A job's instruction of TEXT_REF_MIN_CHARS or more
    # lives in `texts`; `jobs.instruction` then holds the placeholder and `instruction_ref` its hash.
    # Where the instruction recurs inside `jobs.enriched` (`enriched_ref`) or a `movement_start`'s
    # `user` (payload key `_texts`), the placeholder stands for it.  Store.job/jobs/events expand them.
    """
    CREATE TABLE texts (
        hash TEXT PRIMARY KEY,
        body TEXT NOT NULL
    );
    ALTER TABLE jobs ADD COLUMN instruction_ref TEXT REFERENCES texts(hash);
    ALTER TABLE jobs ADD COLUMN enriched_ref TEXT REFERENCES texts(hash)
    """,
    # 3: batches (issue 14, docs/design-lab.md).  A batch is its cases and variants (JSON), and the fingerprint
    # that tells a resume with the same cases from a new batch under a taken name.  Its jobs are ordinary
    # jobs tagged with the batch name, the case index and the variant index.
    """
    CREATE TABLE batches (
        name        TEXT PRIMARY KEY,
        created     REAL NOT NULL,
        updated     REAL NOT NULL,
        fingerprint TEXT NOT NULL,
        cases       TEXT NOT NULL,
        variants    TEXT NOT NULL,
        options     TEXT NOT NULL DEFAULT '{}'
    );
    ALTER TABLE jobs ADD COLUMN batch TEXT REFERENCES batches(name);
    ALTER TABLE jobs ADD COLUMN batch_case INTEGER;
    ALTER TABLE jobs ADD COLUMN batch_variant INTEGER;
    CREATE INDEX jobs_batch ON jobs(batch, batch_case, batch_variant)
    """,
    # 4: forks (issue 15, docs/fork-compare.md#fork).  A fork is an ordinary job that re-serves movement runs
    # 1 … forked_from_seq-1 of job forked_from_job and runs live from forked_from_seq on.
    """
    ALTER TABLE jobs ADD COLUMN forked_from_job INTEGER REFERENCES jobs(id);
    ALTER TABLE jobs ADD COLUMN forked_from_seq INTEGER
    """,
    # 5: leases (issue 17, docs/stores.md#leases).  A claim sets lease_until (epoch seconds) and increments lease_gen;
    # the claimer renews lease_until while it runs the job.  Another claimer takes over a running job
    # whose lease_until has passed ("recovered: lease expired"), and every write for a job checks the
    # generation its writer claimed (fencing), so a writer that lost its lease writes nothing more.
    # lease_until NULL: claimed before leases (or not running); the same-host pid check still applies.
    """
    ALTER TABLE jobs ADD COLUMN lease_until REAL;
    ALTER TABLE jobs ADD COLUMN lease_gen INTEGER NOT NULL DEFAULT 0
    """,
    # 6: epochs (issue 31, docs/design-lab.md#epochs).  A batch runs every case × variant k times; batch_epoch is
    # which run of its case × variant a batch job is, from 1.  NULL: a job outside a batch, or a batch job made
    # before epochs (read as epoch 1).  The batch index ends with it: a batch's jobs are read in that order.
    """
    ALTER TABLE jobs ADD COLUMN batch_epoch INTEGER;
    DROP INDEX jobs_batch;
    CREATE INDEX jobs_batch ON jobs(batch, batch_case, batch_variant, batch_epoch)
    """,
    # 7: the call cache (issue 31, docs/design-lab.md#call-cache, docs/stores.md#call-cache).  One row per
    # answered request (`kind` 'call', `key` the sha256 of model spec, endpoint, messages, tools, parameters
    # and epoch) or per recorded clock (`kind` 'clock': the date-and-time block a cached job's prompts reuse).
    # `body` holds the recorded response as JSON, or, when long, `body_ref` names it in `texts` (stored once).
    # `prompt_tokens`/`completion_tokens`: the original call's counts (what a hit saves), NULL when unreported.
    """
    CREATE TABLE call_cache (
        key               TEXT PRIMARY KEY,
        kind              TEXT NOT NULL,
        model             TEXT NOT NULL,
        body              TEXT,
        body_ref          TEXT REFERENCES texts(hash),
        prompt_tokens     INTEGER,
        completion_tokens INTEGER,
        job_id            INTEGER,
        created           REAL NOT NULL,
        hits              INTEGER NOT NULL DEFAULT 0,
        last_hit          REAL
    );
    CREATE INDEX call_cache_created ON call_cache(created)
    """,
    # 8: events_kind leaves out the kinds every LLM call writes (store/frames_sql.py's PER_CALL_KINDS_SQL says why):
    # a call's commit then writes the events and events_job pages only.  Their frames read through events_job.
    """
    DROP INDEX events_kind;
    CREATE INDEX events_kind ON events(kind, job_id)
        WHERE kind NOT IN ('llm_request', 'llm_response', 'tool_call', 'tool_result')
    """,
]
