-- The rollups of one day, computed again from the deduplicated raw rows.
-- The metering service uses them at start to repair a rollup left short by
-- a crash between the raw write and its rollup writes (the views' SELECTs
-- are those of migration 0002, over usage_events FINAL for one day).
CREATE VIEW IF NOT EXISTS usage_hourly_rebuild AS
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
FROM usage_events FINAL
WHERE toDate(time) = {day:Date}
GROUP BY hour, tenant, key_id, model;

CREATE VIEW IF NOT EXISTS usage_daily_rebuild AS
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
FROM usage_events FINAL
WHERE toDate(time) = {day:Date}
GROUP BY day, tenant, key_id, model;
