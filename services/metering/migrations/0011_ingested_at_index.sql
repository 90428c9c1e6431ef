-- The rollup check at start reads the days of the rows ingested lately
-- (a backlog brings rows of older days): a min-max index on ingested_at lets
-- it skip the granules ingested before, which is nearly all of them.
ALTER TABLE usage_events ADD INDEX IF NOT EXISTS ingested_at_minmax ingested_at TYPE minmax GRANULARITY 1;
ALTER TABLE usage_events MATERIALIZE INDEX ingested_at_minmax SETTINGS mutations_sync = 2;
