-- The delivery log of spend alerts' webhooks: one row per attempt to POST an
-- alert to an endpoint (tg.webhook-call.v1, from the auth service). Kept a year.
CREATE TABLE IF NOT EXISTS webhook_calls
(
    call_id      String COMMENT 'One id per attempt',
    time         DateTime64(3, 'UTC') COMMENT 'When the POST was sent',
    alert_id     String COMMENT 'The alert (Tollgate-Delivery header)',
    webhook_id   LowCardinality(String),
    tenant       LowCardinality(String) COMMENT 'The alert''s tenant',
    url          String COMMENT 'Scheme, host, port and path: no credentials, no query',
    attempt      UInt32 COMMENT '1 for the alert''s first delivery round, then 2, ...',
    outcome      LowCardinality(String) COMMENT 'delivered (2xx), refused (another status) or unreachable',
    http_status  Nullable(UInt16),
    error        LowCardinality(Nullable(String)) COMMENT 'Why there was no answer',
    seconds      Float32 COMMENT 'How long the endpoint took',
    ingested_at  DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMM(time)
ORDER BY (tenant, time, call_id)
TTL toDateTime(time) + toIntervalDay(365)
SETTINGS non_replicated_deduplication_window = 1000;

-- Every version of every key's and tenant's budgets (tg.budget.v1, from the
-- auth service, which follows the key and tenant records). Read with FINAL, or
-- through budgets_current: the latest version of each key or tenant.
CREATE TABLE IF NOT EXISTS budgets
(
    scope            LowCardinality(String) COMMENT 'key or tenant',
    tenant           String,
    key_id           String COMMENT 'The key; empty for a tenant''s budgets',
    revision         UInt64 COMMENT 'The record''s revision in its bucket: the newest wins',
    time             DateTime64(3, 'UTC') COMMENT 'When this version was seen',
    period           LowCardinality(Nullable(String)) COMMENT 'day, month or total',
    budget_tokens    Nullable(UInt64),
    budget_amount    Nullable(Decimal(38, 9)),
    budget_currency  LowCardinality(Nullable(String)),
    state            LowCardinality(String) COMMENT 'active, over_budget, revoked or removed',
    ingested_at      DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = ReplacingMergeTree(revision)
ORDER BY (scope, tenant, key_id)
SETTINGS non_replicated_deduplication_window = 1000;

-- Budgets as they stand: one row per key or tenant with a budget, not revoked
-- or removed, and the window of its current period ('20261203', '202612' or
-- 'total'), the same windows the budget ledger counts in.
CREATE VIEW IF NOT EXISTS budgets_current AS
SELECT
    scope, tenant, key_id, period, budget_tokens, budget_amount, budget_currency, state,
    multiIf(period = 'day', toStartOfDay(now('UTC')),
            period = 'month', toDateTime(toStartOfMonth(now('UTC')), 'UTC'),
            toDateTime(0, 'UTC')) AS period_start
FROM budgets FINAL
WHERE state NOT IN ('revoked', 'removed')
  AND period IS NOT NULL
  AND (budget_tokens IS NOT NULL OR budget_amount IS NOT NULL);
