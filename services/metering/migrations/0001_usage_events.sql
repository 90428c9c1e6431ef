-- Raw usage: one row per accepted request, as the router reported it.
--
-- Duplicates are made harmless at three levels. The metering service checks
-- each batch against the rows already stored (by request id, within the
-- batch's time range) and inserts only new ones, so the rollups that
-- materialized views build from every insert stay exact; a retried insert
-- carries the same deduplication token (migration 0004). ReplacingMergeTree
-- keys rows on (tenant, time, request_id), which a duplicate shares with its
-- original, so one written by anything else is merged away; `SELECT ...
-- FINAL` shows the deduplicated table at any time.
CREATE TABLE IF NOT EXISTS usage_events
(
    request_id        String COMMENT 'Tollgate request id (x-request-id)',
    time              DateTime64(3, 'UTC') COMMENT 'When the request ended',
    tenant            LowCardinality(String) COMMENT 'Who pays',
    key_id            Nullable(String) COMMENT 'API key id; NULL when auth is off',
    model             LowCardinality(String) COMMENT 'Canonical model id',
    worker_id         Nullable(String) COMMENT 'Worker that ran it',
    prompt_tokens     UInt32 COMMENT 'Prompt tokens, engine count',
    completion_tokens UInt32 COMMENT 'Completion tokens, engine count',
    outcome           LowCardinality(String) COMMENT 'completed, cancelled, client_disconnected, worker_lost, ...',
    finish_reason     LowCardinality(Nullable(String)) COMMENT 'stop, length, ...',
    streamed          Bool,
    queue_s           Nullable(Float32) COMMENT 'Seconds until a worker took it',
    ttft_s            Nullable(Float32) COMMENT 'Seconds until the first output',
    total_s           Float32 COMMENT 'Seconds from arrival to end',
    http_status       UInt16,
    stream_seq        UInt64 DEFAULT 0 COMMENT 'Sequence in the usage stream',
    ingested_at       DateTime64(3, 'UTC') DEFAULT now64(3),
    INDEX request_id_bloom request_id TYPE bloom_filter(0.001) GRANULARITY 1
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMM(time)
ORDER BY (tenant, time, request_id);
