-- Captured exchanges (keys or tenants with capture on): the request body and
-- the response, for finding failure patterns and replaying inputs. Rows expire
-- after the retention the metering service sets at start
-- (TOLLGATE_METERING_CAPTURE_RETENTION_DAYS, 30 days by default).
CREATE TABLE IF NOT EXISTS exchanges
(
    request_id         String COMMENT 'Same id as usage_events and x-request-id',
    time               DateTime64(3, 'UTC') COMMENT 'When the request ended',
    tenant             LowCardinality(String),
    key_id             Nullable(String),
    model              LowCardinality(String),
    endpoint           LowCardinality(String) COMMENT 'chat.completions or completions',
    streamed           Bool,
    request_body       String CODEC(ZSTD(3)) COMMENT 'The client JSON body (cut at the router cap)',
    request_truncated  Bool,
    response_text      String CODEC(ZSTD(3)) COMMENT 'Generated text; streams reassembled',
    response_body      String CODEC(ZSTD(3)) COMMENT 'Response JSON; for a stream, rebuilt',
    response_truncated Bool,
    finish_reason      LowCardinality(Nullable(String)),
    outcome            LowCardinality(String),
    http_status        UInt16,
    prompt_tokens      UInt32,
    completion_tokens  UInt32,
    ttft_s             Nullable(Float32),
    total_s            Float32,
    ingested_at        DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMMDD(time)
ORDER BY (tenant, time, request_id)
TTL toDateTime(time) + toIntervalDay(30);

-- Results of `tollgate replay`: each captured input sent again, compared.
CREATE TABLE IF NOT EXISTS replays
(
    replay_id                  String COMMENT 'One id per replay run',
    request_id                 String COMMENT 'The captured request',
    time                       DateTime64(3, 'UTC'),
    original_model             LowCardinality(String),
    model                      LowCardinality(String),
    http_status                UInt16,
    original_completion_tokens UInt32,
    completion_tokens          UInt32,
    original_finish_reason     LowCardinality(Nullable(String)),
    finish_reason              LowCardinality(Nullable(String)),
    original_total_s           Float32,
    total_s                    Float32,
    exact_match                Bool,
    original_repetition        Float32 COMMENT '0: no repeated 3-grams .. 1: all repeated',
    repetition                 Float32,
    ingested_at                DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = ReplacingMergeTree
ORDER BY (replay_id, request_id);
