-- Prices per model and million tokens. A price applies from valid_from until
-- the next price of the same model (or until valid_to, when set). The
-- metering service loads the catalog's prices at start; with a ClickHouse
-- server, prices may also be inserted directly. A later row with the same
-- (model, valid_from) replaces an earlier one.
CREATE TABLE IF NOT EXISTS prices
(
    model                  LowCardinality(String),
    valid_from             DateTime('UTC'),
    valid_to               Nullable(DateTime('UTC')),
    prompt_per_million     Decimal(18, 6),
    completion_per_million Decimal(18, 6),
    currency               LowCardinality(String) DEFAULT 'USD',
    updated_at             DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = ReplacingMergeTree(updated_at)
ORDER BY (model, valid_from);

-- Usage turned into cost, per hour, tenant, key and model. `priced` is false
-- where no price covers the hour (cost is then NULL, never silently zero).
CREATE VIEW IF NOT EXISTS usage_cost AS
SELECT
    u.hour AS hour,
    u.tenant AS tenant,
    u.key_id AS key_id,
    u.model AS model,
    u.requests AS requests,
    u.prompt_tokens AS prompt_tokens,
    u.completion_tokens AS completion_tokens,
    p.model != '' AND (p.valid_to IS NULL OR u.hour < p.valid_to) AS priced,
    if(priced, p.currency, NULL) AS currency,
    if(priced, toDecimal128(u.prompt_tokens, 6) * p.prompt_per_million / 1000000, NULL) AS prompt_cost,
    if(priced, toDecimal128(u.completion_tokens, 6) * p.completion_per_million / 1000000, NULL)
        AS completion_cost,
    prompt_cost + completion_cost AS cost
FROM
(
    SELECT hour, tenant, key_id, model,
           sum(requests) AS requests,
           sum(prompt_tokens) AS prompt_tokens,
           sum(completion_tokens) AS completion_tokens
    FROM usage_hourly
    GROUP BY hour, tenant, key_id, model
) AS u
ASOF LEFT JOIN (SELECT * FROM prices FINAL) AS p
    ON u.model = p.model AND u.hour >= p.valid_from;
