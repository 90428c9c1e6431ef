-- Hourly and daily rollups by tenant, key and model, filled on every insert
-- into usage_events. Sums are SimpleAggregateFunction columns; latencies keep
-- quantile states, so p50/p95/p99 can be merged over any range.
CREATE TABLE IF NOT EXISTS usage_hourly
(
    hour              DateTime('UTC'),
    tenant            LowCardinality(String),
    key_id            String COMMENT 'Empty when auth is off',
    model             LowCardinality(String),
    requests          SimpleAggregateFunction(sum, UInt64),
    failed            SimpleAggregateFunction(sum, UInt64) COMMENT 'Requests whose outcome is not completed',
    prompt_tokens     SimpleAggregateFunction(sum, UInt64),
    completion_tokens SimpleAggregateFunction(sum, UInt64),
    total_s           AggregateFunction(quantiles(0.5, 0.95, 0.99), Float32),
    ttft_s            AggregateFunction(quantiles(0.5, 0.95, 0.99), Nullable(Float32))
)
ENGINE = AggregatingMergeTree
PARTITION BY toYYYYMM(hour)
ORDER BY (tenant, hour, model, key_id);

CREATE MATERIALIZED VIEW IF NOT EXISTS usage_hourly_mv TO usage_hourly AS
SELECT
    toStartOfHour(time) AS hour,
    tenant,
    ifNull(key_id, '') AS key_id,
    model,
    count() AS requests,
    countIf(outcome != 'completed') AS failed,
    sum(prompt_tokens) AS prompt_tokens,
    sum(completion_tokens) AS completion_tokens,
    quantilesState(0.5, 0.95, 0.99)(total_s) AS total_s,
    quantilesState(0.5, 0.95, 0.99)(ttft_s) AS ttft_s
FROM usage_events
GROUP BY hour, tenant, key_id, model;

CREATE TABLE IF NOT EXISTS usage_daily
(
    day               Date,
    tenant            LowCardinality(String),
    key_id            String COMMENT 'Empty when auth is off',
    model             LowCardinality(String),
    requests          SimpleAggregateFunction(sum, UInt64),
    failed            SimpleAggregateFunction(sum, UInt64),
    prompt_tokens     SimpleAggregateFunction(sum, UInt64),
    completion_tokens SimpleAggregateFunction(sum, UInt64),
    total_s           AggregateFunction(quantiles(0.5, 0.95, 0.99), Float32),
    ttft_s            AggregateFunction(quantiles(0.5, 0.95, 0.99), Nullable(Float32))
)
ENGINE = AggregatingMergeTree
PARTITION BY toYYYYMM(day)
ORDER BY (tenant, day, model, key_id);

CREATE MATERIALIZED VIEW IF NOT EXISTS usage_daily_mv TO usage_daily AS
SELECT
    toDate(time) AS day,
    tenant,
    ifNull(key_id, '') AS key_id,
    model,
    count() AS requests,
    countIf(outcome != 'completed') AS failed,
    sum(prompt_tokens) AS prompt_tokens,
    sum(completion_tokens) AS completion_tokens,
    quantilesState(0.5, 0.95, 0.99)(total_s) AS total_s,
    quantilesState(0.5, 0.95, 0.99)(ttft_s) AS ttft_s
FROM usage_events
GROUP BY day, tenant, key_id, model;
